"""`python -m dapo_trl.from_verl SCRIPT --output DIR`: a verl run (script or YAML) as a dapo-trl recipe.

Writes into DIR:

- `recipe.yaml`: for `train_dapo.py --config DIR/recipe.yaml` (DAPOConfig, script and ModelConfig field names);
- `accelerate.yaml`: `trainer.nnodes` x `trainer.n_gpus_per_node` processes, ZeRO-3 or DDP (see
  `verl_import.trainer_keys.plan_accelerate`);
- `vllm_server.sh`: the vLLM server for the rollout settings, through `scripts/start_vllm_server.sh`;
- `report.md`: every key of the input, mapped (to what), approximated (how), unsupported (why) or not needed
  (verl infrastructure with nothing to translate), the batch / step arithmetic, and the verl defaults applied.

The three parts live in `dapo_trl.verl_import`: `read_verl_input` (`reader`: shell resolution, Hydra values),
`translate` (`translate`: the mapping; simple keys are data in `SIMPLE_RULES` / `NOT_NEEDED_KEYS`, the rest one
module per concern), and `write_outputs` (`outputs`). Exit status: 0 written; 1 a key that changes the training
cannot be translated (only `report.md` is written; `--allow-unsupported` writes everything anyway); 2 the input
cannot be read or a variable cannot be resolved.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .verl_import.hydra import VerlInputError
from .verl_import.outputs import write_outputs
from .verl_import.reader import read_verl_input
from .verl_import.translate import translate
from .verl_import.translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED

# --allow-unsupported's example of a key that changes the training and has no counterpart here (tested as blocking).
UNSUPPORTED_EXAMPLE = "algorithm.use_pf_ppo=True: policy-filtered PPO"


# ---------------------------------------------------------------------------------------------- command line
def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dapo_trl.from_verl",
        description="Translate a verl run script (python3 -m verl.trainer.main_ppo key=value ...) or verl YAML "
        "config into a dapo-trl recipe: DIR/recipe.yaml (train_dapo.py --config), DIR/accelerate.yaml, "
        "DIR/vllm_server.sh and DIR/report.md (what became of every key).",
    )
    parser.add_argument("source", help="verl run script (shell) or verl YAML config (.yaml/.yml)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides, appended as the script's $@ would be")
    parser.add_argument("--output", "-o", required=True, help="folder to write the recipe and the report into")
    parser.add_argument(
        "--env", action="append", default=[], metavar="NAME=VALUE", help="a variable for the script (repeatable)"
    )
    parser.add_argument(
        "--ignore-environment",
        action="store_true",
        help="resolve the script's variables from its own assignments and --env only, not this shell's environment",
    )
    parser.add_argument(
        "--allow-unsupported",
        action="store_true",
        help="write the recipe even when a key that changes the training cannot be translated (e.g. "
        f"{UNSUPPORTED_EXAMPLE}; report.md lists each such key), and exit 0",
    )
    return parser.parse_intermixed_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    environment: dict[str, str] = {} if args.ignore_environment else dict(os.environ)
    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            print(f"error: --env {item!r}: expected NAME=VALUE", file=sys.stderr)
            return 2
        environment[name] = value
    try:
        found = read_verl_input(args.source, environment, args.overrides)
    except VerlInputError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    t = translate(found)
    out_dir = Path(args.output)
    unresolved = {key: found.unresolved[key] for key in found.unresolved}
    if unresolved and not args.allow_unsupported:
        write_outputs(t, out_dir, report_only=True)
        print("error: variables the script does not set and the environment does not have:", file=sys.stderr)
        for key, variables in unresolved.items():
            print(f"  {key}: {', '.join(variables)}", file=sys.stderr)
        substituted = [key for key, variables in unresolved.items() if any(v.startswith("command ") for v in variables)]
        if substituted:  # --env cannot help: the translator never runs commands
            print(
                "a command substitution $(...) is not run: give those keys their value as overrides after the "
                f"script, e.g. {substituted[0]}=VALUE",
                file=sys.stderr,
            )
        print(
            "set variables with --env NAME=VALUE (or export them), or pass --allow-unsupported to skip those keys; "
            f"see {out_dir / 'report.md'}",
            file=sys.stderr,
        )
        return 2
    blocking = t.blocking
    if blocking and not args.allow_unsupported:
        write_outputs(t, out_dir, report_only=True)
        print("error: these keys change the training and cannot be translated:", file=sys.stderr)
        for entry in blocking:
            print(f"  {entry.key} = {entry.value}: {entry.how}", file=sys.stderr)
        print(f"see {out_dir / 'report.md'}; --allow-unsupported writes the recipe anyway", file=sys.stderr)
        return 1
    written = write_outputs(t, out_dir)
    counts = {
        status: sum(e.status == status for e in t.entries.values())
        for status in (MAPPED, APPROXIMATED, UNSUPPORTED, NOT_NEEDED)
    }
    print(f"translated {len(t.entries)} keys from {found.source}: " + ", ".join(f"{n} {s}" for s, n in counts.items()))
    for path in written:
        print(f"  {path}")
    for entry in blocking:
        print(f"warning: not translated ({entry.key}): {entry.how}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
