"""`key=value` command-line overrides for the test scripts, typed the way a user would mean them."""


def parse_value(text: str):
    """'3' -> 3, '0.5' -> 0.5, 'true'/'false'/'none' -> True/False/None, anything else stays a string."""
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return {"true": True, "false": False, "none": None}.get(text.lower(), text)


def parse_overrides(arguments: list[str]) -> dict:
    return {key: parse_value(value) for key, value in (argument.split("=", 1) for argument in arguments)}


def leave_together(accelerator) -> None:
    """train_dapo.py's teardown (every rank waits for the others, then the process groups go: see
    `dapo_trl.cli.train.leave_together`); then the script leaves without running interpreter shutdown, where a gloo
    thread's abort was once still seen after the teardown. Its outputs are written by then."""
    import os
    import sys

    from dapo_trl.cli.train import leave_together as teardown

    teardown(accelerator)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
