"""Mixture-of-experts training forwards: the tiny MoE against the dense tiny model, and what routing replay costs.

What is measured
----------------
The built-in tiny models' architectures (random init: `build_tiny_model(architecture="dense" | "moe")`, same
tokenizer, hidden 64, 2 layers; the MoE routes each token to 2 of 8 experts of width 32, the dense MLP is 128 wide)
run DAPOTrainer's padding-free training pass: `--rows` rows of `--tokens` real tokens packed into bins
(`training.step.packing.padding_free_per_token`, TRL's fused log-prob head, sdpa), forward and backward, `--repeats`
times after one warm-up. Configurations: dense; MoE; MoE with the router auxiliary loss from router loads
(`algorithm.router_aux`); MoE replaying a routing (`moe.routing_replay`, the hooks installed). Each runs in a process
of its own, so its peak resident memory (ru_maxrss, CPU; the CUDA allocator's peak on a GPU) is its own; the
table gives real tokens per second (median over repeats, the best of `--rounds` processes per configuration, run
in turn so that load on the machine hits all alike), the ratio to dense, and the peak memory.

Then the bytes per token routing replay adds to every row (decoder layers x top-k x 1 byte, 2 beyond 254 experts)
for the tiny MoE and for real geometries, against the 8 bytes per token a rollout result holds without it, and
what one DAPO-scale generation batch (512 prompts x 16 completions x 20k tokens) then carries.

    python benchmarks/moe.py [--rows 16] [--tokens 96] [--repeats 5] [--rounds 2]
    python benchmarks/moe.py --quick    # 4 rows x 32 tokens, once, every configuration in this process: a check
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import package_version, quiet

CONFIGS = ("dense", "moe", "moe + aux loss", "moe + routing replay")
GEOMETRIES = {  # name: (decoder layers, experts per token, experts)
    "builtin:tiny-moe": (2, 2, 8),
    "Qwen3-30B-A3B": (48, 8, 128),
    "Qwen3-235B-A22B": (94, 8, 128),
    "DeepSeek-V3": (61, 8, 256),
}
DAPO_BATCH_TOKENS = 512 * 16 * 20_000


def worker(config: str, rows: int, tokens: int, repeats: int, cache: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from dapo_trl.algorithm.router_aux import router_load
    from dapo_trl.moe.routing_replay import ROUTING_KWARG, RouterHooks
    from dapo_trl.tiny_model import build_tiny_model
    from dapo_trl.training.step.packing import padding_free_per_token

    quiet()
    torch.manual_seed(0)
    architecture = "dense" if config == "dense" else "moe"
    model = AutoModelForCausalLM.from_pretrained(
        build_tiny_model(Path(cache) / architecture, architecture=architecture)
    )
    model.train()
    add_fused_lm_head(model)
    hooks = RouterHooks(model) if architecture == "moe" else None
    keep = tokens // 2
    ids = torch.randint(3, 700, (rows, tokens))
    mask = torch.ones_like(ids)
    routing = None
    if config == "moe + routing replay":
        routing = (torch.rand(rows, tokens, 2, 8).argsort(-1)[..., :2] + 1).to(torch.uint8)  # 2 distinct experts
    aux = config == "moe + aux loss"

    def packed_forward(packed):
        extra = {} if packed.routing is None else {ROUTING_KWARG: packed.routing}
        if aux:
            hooks.collect, hooks.collected = True, []
        out = model(
            input_ids=packed.input_ids,
            position_ids=packed.position_ids,
            labels=packed.labels,
            fused_lm_head=True,
            **extra,
        )
        load = None
        if aux:
            hooks.collect = False
            load = router_load(hooks.collected, 2, packed.real_tokens())
        return out.log_probs, None, load

    def step() -> None:
        logps, _, aux_loss = padding_free_per_token(
            ids,
            mask,
            keep,
            packed_forward=packed_forward,
            padded_forward=None,
            max_tokens=None,
            max_rows=None,
            routing=routing,
        )
        loss = -logps.mean() + (0.001 * aux_loss if aux_loss is not None else 0.0)
        loss.backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    cuda_peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    return {
        "tokens_per_second": rows * tokens / statistics.median(seconds),
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cuda_peak_mib": cuda_peak,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="4 rows x 32 tokens, 1 repeat, 1 round, in this process: a check"
    )
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.tokens, args.repeats, args.rounds = 4, 32, 1, 1
    if args.worker:
        print(json.dumps(worker(args.worker, args.rows, args.tokens, args.repeats, args.cache)))
        return
    versions = {name: package_version(name) for name in ("torch", "transformers", "trl")}
    print(", ".join(f"{name} {value}" for name, value in versions.items()))
    print(
        f"training pass: {args.rows} rows x {args.tokens} real tokens, packed, forward + backward, median of "
        f"{args.repeats}\n"
    )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(args.rounds):
            for config in CONFIGS:
                if args.quick:  # one interpreter start for all: peak memory is then not each configuration's own
                    result = worker(config, args.rows, args.tokens, args.repeats, cache)
                else:
                    command = [sys.executable, __file__, "--worker", config, "--cache", cache]
                    command += ["--rows", str(args.rows), "--tokens", str(args.tokens)]
                    command += ["--repeats", str(args.repeats)]
                    answer = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
                    result = json.loads(answer[-1])
                best = results.get(config)
                if best is None or result["tokens_per_second"] > best["tokens_per_second"]:
                    results[config] = result
    dense = results["dense"]["tokens_per_second"]
    print(f"| {'configuration':<22} | parameters | tokens/s | vs dense | peak RSS MiB | CUDA peak MiB |")
    print(f"|{'-' * 24}|-----------:|---------:|---------:|-------------:|--------------:|")
    for config, result in results.items():
        cuda = "-" if result["cuda_peak_mib"] is None else f"{result['cuda_peak_mib']:.0f}"
        print(
            f"| {config:<22} | {result['parameters']:>10,} | {result['tokens_per_second']:>8,.0f} | "
            f"{result['tokens_per_second'] / dense:>8.2f} | {result['peak_rss_mib']:>12.0f} | {cuda:>13} |"
        )
    if args.quick:
        print("(--quick: every configuration in one process, so peak memory is not each one's own)")
    print("\nrouting replay's payload (expert index + 1 per decoder layer and routed expert, 0 = not recorded)\n")
    print("| model            | layers x top-k (experts) | bytes/token | vs ids + log-probs (8 B) | per DAPO batch |")
    print("|------------------|--------------------------|------------:|-------------------------:|---------------:|")
    for name, (layers, top_k, experts) in GEOMETRIES.items():
        per_token = layers * top_k * (1 if experts < 255 else 2)
        batch = per_token * DAPO_BATCH_TOKENS / 2**30
        print(
            f"| {name:<16} | {f'{layers} x {top_k} ({experts})':<24} | {per_token:>11} | {per_token / 8:>23.1f}x |"
            f" {batch:>10.1f} GiB |"
        )
    print("\n(per DAPO batch: 512 prompts x 16 completions x 20k tokens, over all processes; each process holds about")
    print(" its share, in host memory: benchmarks/routing_memory.py, docs/moe.md)")


if __name__ == "__main__":
    main()
