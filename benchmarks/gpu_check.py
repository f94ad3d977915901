"""GPU check: DAPOTrainer against TRL's GRPOTrainer at a real model size on one CUDA GPU, padding-free against
padded, with activation checkpointing: real tokens per second, peak GPU memory, and whether packed forwards ran and
reached a varlen attention kernel. Ten minutes at most; no vLLM.

What it runs
------------
For each response length L (default 4096 and 16384) and each attention implementation (default: `sdpa`, plus
`flash_attention_2` / `flash_attention_3` when the flash-attn package for it is installed), three real training runs
of `--steps` optimizer steps through the trainers themselves, each in its own process (`benchmarks/long_context.py
--run-one`, whose machinery this reuses): TRL's `GRPOTrainer` (`loss_type="dapo"`), `DAPOTrainer` with
`padding_free=False` (TRL's padded micro-batches) and `DAPOTrainer` with `padding_free=True` (the default);
`--budget N` adds a fourth, padding-free under `max_tokens_per_microbatch=N`. The model is a random-init
Qwen2.5-0.5B (or `--model qwen2.5-1.5b`) built offline from a `Qwen2Config` of its dimensions (real 151,936-token
vocabulary, the built-in tiny tokenizer's ids), bf16 mixed precision (TRL loads the weights in fp32 and trains
under bf16 autocast), activation checkpointing on. There is no generation: a
scripted rollout (TRL's `rollout_func`, as the other benchmarks do) returns `--rows` completions per step with
DAPO-like long-tailed lengths (log-normal, median L / 5, capped at L; the first row exactly L, so padded micro-batches
are L wide), the same rows for every trainer; the reward gives every group spread, so every row trains.

What it prints (and writes as results.json and table.md under `--out`)
---------------------------------------------------------------------
A header with the card (`torch.cuda.get_device_name`), its memory, torch / CUDA / transformers / TRL / accelerate /
flash-attn versions, then a markdown table, one row per run: real tokens per second over the steps after the first
(TRL's `step_time`), the ratio to GRPOTrainer's in the same run (same L and attention), peak GPU memory
(`torch.cuda.max_memory_allocated`) and its ratio to GRPOTrainer's, tokens fed per real token, the share of training
forwards that ran packed (position ids restarting per row, no attention mask: `training/step/packing.py`), the packing
mode DAPOTrainer chose (`sequence`: one sequence per forward, for varlen kernels; `bins`: rows packed into bins as
wide as the longest row, with a dense block-diagonal mask, for sdpa / eager), and the attention path the calls took:
`flash varlen` (flash_attn_varlen_func, the packed kernel: transformers 5 derives cu_seqlens from the restarting
position ids) or `flash dense`, else the mask sdpa got (`dense mask`: no varlen kernel). A run out of memory prints
`OOM`; one cut by the time budget (`--budget-s`, 540 s from the start), `timed out` or `skipped`. Then the checks:
each DAPOTrainer run trained the same real tokens as GRPOTrainer's; GRPOTrainer and padded DAPOTrainer never ran a
packed forward; padding-free DAPOTrainer ran every training forward packed; with flash attention, its attention calls
ran the varlen kernel and never the dense one. The exit status is 1 when a check or a run failed (out of memory and
the time budget are results, not failures), 2 when the check cannot run here.

Requirements
------------
One CUDA GPU and, besides torch, transformers (>= 5.17), accelerate and peft: trl 1.16, datasets and requests,
which a bare GPU image may lack (math-verify too: not needed by this check, but by dapo_trl's math reward). Without
network access, download the wheels on a connected machine with the same Python version and platform (else add
`--python-version 3.X --platform manylinux2014_x86_64 --only-binary=:all:`):

    pip download trl==1.16.0 datasets math-verify -d wheels

(that resolves their dependencies too, torch and its CUDA wheels among them through accelerate: several GB the
install below leaves unused when the image's torch satisfies them. To skip them: `pip download --no-deps
trl==1.16.0 -d wheels && pip download datasets math-verify -d wheels`), then, on the GPU machine:

    pip install --no-index --find-links wheels trl==1.16.0 datasets math-verify

(`WHEELS=wheels benchmarks/gpu_check.sh` does that install first). The script checks its imports first and names
what is missing. flash-attn is optional: without it the packed forwards run sdpa bins, and no varlen kernel can run.
The model is built offline (no hub access needed).

Run from the repository root:

    benchmarks/gpu_check.sh --out gpu-check-results      # one CUDA GPU, under 10 minutes (a hard cap of 600 s)
    python benchmarks/gpu_check.py --lengths 4096 8192 16384 --attn sdpa flash_attention_2 --out results
    python benchmarks/gpu_check.py --quick               # CPU, tiny model, seconds: the suite's check, no figure

Without a CUDA GPU the full form refuses to run (its CPU figures would mean nothing); `--quick` is the CPU form.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from a checkout without installing
sys.path.insert(0, str(HERE))

# module -> what to install when it is missing (the GPU image has torch, transformers, accelerate and peft)
REQUIRED = {
    "torch": "torch",
    "transformers": "transformers>=5.17",
    "accelerate": "accelerate",
    "peft": "peft",
    "trl": "trl==1.16.0",
    "datasets": "datasets",
    "requests": "requests",
}
# attention implementation -> the package its kernels come from
FLASH_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
VARLEN = tuple(FLASH_PACKAGES)
VARIANTS = ("GRPOTrainer", "DAPOTrainer padded", "DAPOTrainer padding-free")


def missing_requirements() -> list[str]:
    """What to install before the check can run (empty when nothing is missing)."""
    missing = [pip for module, pip in REQUIRED.items() if importlib.util.find_spec(module) is None]
    if not missing:
        from common import package_version

        if not package_version("trl").startswith("1.16."):
            missing.append(f"trl==1.16.0 (installed: {package_version('trl')})")
        else:
            try:  # dapo_trl's own imports, run from this checkout
                import dapo_trl  # noqa: F401
            except ModuleNotFoundError as error:
                missing.append(f"{error.name} (imported by dapo_trl)")
    return missing


def environment(device: str) -> dict[str, Any]:
    import torch
    from common import package_version

    packages = ("torch", "transformers", "trl", "accelerate", "peft", "datasets", "flash-attn", "flash_attn_3")
    versions = {package: package_version(package) for package in packages}
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        **{package: "none" if found == "?" else found for package, found in versions.items()},
        "cuda": torch.version.cuda,
        "device": device,
    }
    if device == "cuda":  # asked in a child process: a CUDA context here would hold GPU memory through every run
        probe = (
            "import json, torch; properties = torch.cuda.get_device_properties(0); "
            "print(json.dumps([torch.cuda.get_device_name(0), round(properties.total_memory / 2**20)]))"
        )
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
        facts["gpu"], facts["gpu_memory_mb"] = json.loads(done.stdout.strip().splitlines()[-1])
    return facts


def attention_list(requested: list[str]) -> list[str]:
    """The attention implementations to run: `auto` is sdpa plus each flash attention whose package is installed."""
    if requested != ["auto"]:
        return requested
    return ["sdpa", *(name for name, package in FLASH_PACKAGES.items() if importlib.util.find_spec(package))]


def attention_path(result: dict[str, Any]) -> str:
    """The attention calls' path, as shares: flash kernels when any ran, else the masks the calls got."""
    counts = result.get("flash_kernels") or result.get("attention_calls") or {}
    total = sum(counts.values())
    if not total:
        return "not probed"
    return ", ".join(f"{name} {100 * count / total:.0f}%" for name, count in sorted(counts.items()))


def packed_share(result: dict[str, Any]) -> float:
    forwards = result["forwards"]
    return forwards["packed"] / max(forwards["packed"] + forwards["padded"], 1)


def checks(runs: list[dict[str, Any]]) -> list[tuple[str, bool]]:
    """(what, passed) for every run that trained: the same tokens as GRPOTrainer's run, which forwards ran packed,
    and which kernel the packed ones ran."""
    found = []
    baselines = {(run["length"], run["attention"]): run for run in runs if run["variant"] == "GRPOTrainer"}
    for run in runs:
        if run["status"] != "ok":
            continue
        result, name = run["result"], f"{run['length']} {run['attention']} {run['variant']}"
        baseline = baselines.get((run["length"], run["attention"]), {})
        if run is not baseline and baseline.get("status") == "ok":
            same = result["real_tokens"] == baseline["result"]["real_tokens"]
            found.append((f"{name}: trained the same real tokens as GRPOTrainer", same))
        if run["padding_free"]:
            found.append((f"{name}: every training forward ran packed", packed_share(result) == 1.0))
            if run["attention"] in VARLEN:
                kernels = result["flash_kernels"]
                varlen = kernels.get("flash varlen", 0) > 0 and kernels.get("flash dense", 0) == 0
                found.append((f"{name}: attention ran the varlen kernel only", varlen))
        else:
            found.append((f"{name}: no packed forward", result["forwards"]["packed"] == 0))
    return found


def run_options(args: argparse.Namespace, work: Path, length: int, attention: str, variant: str) -> dict[str, Any]:
    """`long_context.run_one`'s options for one run."""
    return {
        "work": str(work),
        "model": args.model,
        "dtype": args.dtype,
        "device": args.device,
        "length": length,
        "rows": args.rows,
        "steps": args.steps,
        "checkpointing": True,
        "attn": attention,
        "mix": "long-tail",
        "padding_free": "padding-free" in variant,
        "budget": args.budget if "budget" in variant else None,
    }


def run(options: dict[str, Any], variant: str, quick: bool, timeout: float) -> tuple[str, dict[str, Any] | str]:
    """(status, result or the reason): ok, oom, failed or timed out."""
    trainer = variant.split()[0]
    if quick:  # every run in this process: one interpreter start
        from long_context import run_one

        with contextlib.redirect_stdout(sys.stderr):  # TRL's per-step log lines
            result = run_one(trainer, options)
        return ("oom", "") if result["oom"] else ("ok", result)
    env = {**os.environ, "LONG_CONTEXT_OPTIONS": json.dumps(options)}
    command = [sys.executable, str(HERE / "long_context.py"), "--run-one", trainer]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timed out", f"past the time budget ({timeout:.0f} s left)"
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        oom = "out of memory" in done.stderr.lower() or done.returncode in (-9, 137)
        return ("oom", "") if oom else ("failed", done.stderr.strip()[-600:])
    result = json.loads(lines[-1])
    return ("oom", "") if result["oom"] else ("ok", result)


COLUMNS = (
    "response tokens",
    "attention",
    "trainer",
    "real tokens / s",
    "vs GRPO",
    "peak GPU MB",  # peak RSS MB with --quick (CPU)
    "vs GRPO",
    "fed / real tokens",
    "time / step (s)",
    "packed forwards",
    "packing",
    "attention path",
)


def table_row(run: dict[str, Any], baseline: dict[str, Any] | None) -> str:
    head = f"| {run['length']} | {run['attention']} | {run['variant']} |"
    if run["status"] != "ok":
        reason = {"oom": "OOM", "skipped": "skipped (time budget)"}.get(run["status"], run["status"])
        return head + f" {reason} |" + " |" * (len(COLUMNS) - 4)
    result = run["result"]
    speed, memory = result["timed_tokens_per_s"], result["peak_mb"]
    if baseline is None:  # GRPOTrainer ran out of memory (or failed, or was cut) at this length
        speed_ratio = memory_ratio = "no GRPO figure"
    else:
        speed_ratio = f"{speed / baseline['timed_tokens_per_s']:.2f}"
        memory_ratio = f"{memory / baseline['peak_mb']:.2f}"
    return (
        f"{head} {speed:.0f} | {speed_ratio} | {memory:.0f} | {memory_ratio} | {result['fed_per_real']:.2f} | "
        f"{result['step_time']:.2f} | {100 * packed_share(result):.0f}% | {result['packing_mode'] or '-'} | "
        f"{attention_path(result)} |"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CPU, the tiny model, 64 tokens, 2 steps: a check")
    parser.add_argument("--model", choices=("qwen2.5-0.5b", "qwen2.5-1.5b"), default="qwen2.5-0.5b")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384], help="longest response tokens")
    parser.add_argument("--attn", nargs="+", default=["auto"], help="attn_implementations (auto: sdpa + flash)")
    parser.add_argument("--rows", type=int, default=8, help="completions per optimizer step (4 prompts x 2)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--budget", type=int, default=None, help="also run padding-free under this token budget")
    parser.add_argument("--budget-s", type=float, default=540, help="seconds for the whole check (runs past it skip)")
    parser.add_argument("--out", default=os.environ.get("GPU_CHECK_OUT"), help="results folder (default: under --work)")
    parser.add_argument("--work", default=None, help="folder for the model (default: a temp dir)")
    args = parser.parse_args()
    started = time.monotonic()
    missing = missing_requirements()
    if missing:
        print("gpu_check: missing " + ", ".join(missing) + ". Install them (without network: see the header of")
        print("benchmarks/gpu_check.py): pip install --no-index --find-links wheels trl==1.16.0 datasets math-verify")
        return 2
    import torch

    if args.quick:
        args.model, args.dtype, args.device, args.lengths, args.rows, args.steps = "tiny", "fp32", "cpu", [64], 4, 1
        args.attn = ["sdpa"]
    elif not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}): the check measures a GPU and refuses to run on CPU. "
            "`python benchmarks/gpu_check.py --quick` is the CPU form (a check of the script, no figures)."
        )
        return 2
    else:
        args.dtype, args.device = "bf16", "cuda"
    from common import build_model

    work = Path(args.work or tempfile.mkdtemp(prefix="gpu-check-"))
    out = Path(args.out) if args.out else work / "results"
    out.mkdir(parents=True, exist_ok=True)
    facts = environment(args.device)
    attentions = attention_list(args.attn)
    precision = "bf16 autocast, fp32 weights (TRL's load)" if args.dtype == "bf16" else args.dtype
    variants = [*VARIANTS, *([f"DAPOTrainer padding-free, budget {args.budget}"] if args.budget else [])]
    settings = {
        "model": args.model,
        "precision": precision,
        "lengths": args.lengths,
        "attention": attentions,
        "rows_per_step": args.rows,
        "steps": args.steps,
        "activation_checkpointing": True,
        "completion_lengths": "long-tail (log-normal, median L/5, capped at L; the first row exactly L)",
        "budget_s": args.budget_s,
    }
    lines = [
        f"GPU check: {facts.get('gpu', 'CPU (--quick: no figures)')}"
        + (f", {facts['gpu_memory_mb']} MB" if "gpu_memory_mb" in facts else ""),
        "versions: "
        + ", ".join(f"{name} {facts[name]}" for name in ("torch", "transformers", "trl", "accelerate", "flash-attn"))
        + f", CUDA {facts['cuda']}",
        f"model {args.model} (random init), {precision}, activation checkpointing on, {args.rows} rows x "
        f"{args.steps} steps per run (first untimed), long-tailed response lengths up to L, attention: "
        + ", ".join(attentions),
    ]
    if not args.quick and not any(name in VARLEN for name in attentions):
        lines.append("no flash-attn installed: packed forwards run sdpa bins (dense masks); no varlen kernel can run")
    for line in lines:
        print(line)
    build_started = time.monotonic()
    build_model(args.model, work, args.dtype)  # once, before the runs
    print(f"model built in {time.monotonic() - build_started:.0f} s")
    columns = [name.replace("GPU", "RSS") if args.quick else name for name in COLUMNS]
    header = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for line in header:
        print(line, flush=True)
    runs: list[dict[str, Any]] = []
    rows: list[str] = []

    def save() -> None:
        report = {"environment": facts, "settings": settings, "runs": runs, "checks": [], "complete": False}
        (out / "results.json").write_text(json.dumps(report, indent=1))

    for length in args.lengths:
        for attention in attentions:
            baseline = None
            for variant in variants:
                left = args.budget_s - (time.monotonic() - started)
                entry: dict[str, Any] = {
                    "length": length,
                    "attention": attention,
                    "variant": variant,
                    "padding_free": "padding-free" in variant,
                }
                if left < 20 and not args.quick:
                    entry["status"] = "skipped"
                else:
                    run_started = time.monotonic()
                    options = run_options(args, work, length, attention, variant)
                    entry["status"], outcome = run(options, variant, args.quick, left)
                    entry["wall_s"] = round(time.monotonic() - run_started, 1)
                    entry["result" if entry["status"] == "ok" else "reason"] = outcome
                if variant == "GRPOTrainer" and entry["status"] == "ok":
                    baseline = entry["result"]
                elif "result" in entry and baseline is not None:
                    entry["vs_grpo"] = {
                        "tokens_per_s": entry["result"]["timed_tokens_per_s"] / baseline["timed_tokens_per_s"],
                        "peak_memory": entry["result"]["peak_mb"] / baseline["peak_mb"],
                    }
                runs.append(entry)
                rows.append(table_row(entry, baseline))
                print(rows[-1], flush=True)
                if entry["status"] == "failed":
                    print(f"  failed: {entry['reason']}", file=sys.stderr)
                save()
    found = checks(runs)
    failed_runs = [run for run in runs if run["status"] == "failed"]
    passed = all(ok for _, ok in found) and not failed_runs
    print("\nchecks:")
    for what, ok in found:
        print(f"- {'ok' if ok else 'FAILED'}: {what}")
    for failed in failed_runs:
        print(f"- FAILED: {failed['length']} {failed['attention']} {failed['variant']}: {failed['status']}")
    cut = sum(run["status"] in ("skipped", "timed out") for run in runs)
    if cut:
        print(f"- {cut} runs cut by the time budget (--budget-s {args.budget_s:.0f}): run fewer --lengths or --attn")
    print("checks: all passed" if passed else "checks: some FAILED")
    elapsed = time.monotonic() - started
    print(f"elapsed {elapsed:.0f} s; results: {out / 'results.json'}, {out / 'table.md'}")
    if args.quick:
        print("(--quick: CPU, the tiny model, every run in one process: a check of the script, no figures)")
    report = {
        "environment": facts,
        "settings": settings,
        "runs": runs,
        "checks": [{"check": what, "passed": ok} for what, ok in found],
        "passed": passed,
        "elapsed_s": round(elapsed, 1),
        "complete": True,
    }
    (out / "results.json").write_text(json.dumps(report, indent=1))
    (out / "table.md").write_text("\n".join([*lines, "", *header, *rows, ""]))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
