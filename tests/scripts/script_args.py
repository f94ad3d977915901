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
    """Every rank waits for the others, then the process group is torn down before the interpreter exits: a rank
    that exits while its peer still holds the gloo connection can abort ("terminate called without an active
    exception") after a run that succeeded. That abort was still seen once after the teardown (a C++ thread destroyed
    at interpreter exit), so the script then leaves without running interpreter shutdown: its outputs are written."""
    import os
    import sys

    import torch.distributed

    accelerator.wait_for_everyone()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
