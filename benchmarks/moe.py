"""Mixture-of-experts training forwards: the tiny MoE against the dense tiny model, and what routing replay costs;
on a CUDA GPU, also at Qwen3-30B-A3B's layer width.

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

`--model qwen3-30b-a3b-layers` builds, random init on the device, `--layers` (default 4) of Qwen3-30B-A3B's 48
decoder layers at their real width (hidden 2048, 32 query and 4 key-value heads, 128 experts of width 768, 8 per
token, its 151,936-token vocabulary): the MoE configurations only, each against plain MoE. On a CUDA GPU every
configuration runs there, under bf16 autocast with fp32 weights (as the trainer trains), and the replayed routing
starts in host memory, as a micro-batch's does: the pass moves each pack's routing to the GPU.

Then the bytes per token routing replay adds to every row (decoder layers x top-k x 1 byte, 2 beyond 254 experts)
for the tiny MoE and for real geometries, against the 8 bytes per token a rollout result holds without it, and
what one DAPO-scale generation batch (512 prompts x 16 completions x 20k tokens) then carries.

    python benchmarks/moe.py [--rows 16] [--tokens 96] [--repeats 5] [--rounds 2]
    python benchmarks/moe.py --model qwen3-30b-a3b-layers --rows 16 --tokens 2048 --rounds 1   # a CUDA GPU
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
MODELS = ("tiny", "qwen3-30b-a3b-layers")
GEOMETRIES = {  # name: (decoder layers, experts per token, experts)
    "builtin:tiny-moe": (2, 2, 8),
    "Qwen3-30B-A3B": (48, 8, 128),
    "Qwen3-235B-A22B": (94, 8, 128),
    "DeepSeek-V3": (61, 8, 256),
}
DAPO_BATCH_TOKENS = 512 * 16 * 20_000


def qwen3_30b_a3b_layers(layers: int):
    """Qwen3-30B-A3B's config.json dimensions with `layers` decoder layers."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151_936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        router_aux_loss_coef=0.001,
        max_position_embeddings=40_960,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    )


def worker(config: str, rows: int, tokens: int, repeats: int, cache: str, model_name: str, layers: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    from dapo_trl.algorithm.router_aux import router_load
    from dapo_trl.builtin_models import build_tiny_model
    from dapo_trl.moe.routing_replay import ROUTING_KWARG, RouterHooks
    from dapo_trl.training.step.packing import padding_free_per_token

    quiet()
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    architecture = "dense" if config == "dense" else "moe"
    if model_name == "tiny":
        path = build_tiny_model(Path(cache) / architecture, architecture=architecture)
        model, vocab, top_k, experts = AutoModelForCausalLM.from_pretrained(path).to(device), 700, 2, 8
        layers = 2
    else:
        with device:  # random init where it trains: 2.7B parameters at 4 layers
            model = AutoModelForCausalLM.from_config(qwen3_30b_a3b_layers(layers), dtype=torch.float32)
        vocab, top_k, experts = 151_936, 8, 128
    model.train()
    add_fused_lm_head(model)
    hooks = RouterHooks(model) if architecture == "moe" else None
    keep = tokens // 2
    ids = torch.randint(3, vocab, (rows, tokens), device=device)
    mask = torch.ones_like(ids)
    routing = None
    if config == "moe + routing replay":  # top_k distinct experts per token and layer, in host memory
        routing = (torch.rand(rows, tokens, layers, experts).argsort(-1)[..., :top_k] + 1).to(torch.uint8)
    aux = config == "moe + aux loss"
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda")

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
            load = router_load(hooks.collected, top_k, packed.real_tokens())
        return out.log_probs, None, load

    def step() -> None:
        with autocast:
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
            loss = -logps.float().mean() + (0.001 * aux_loss if aux_loss is not None else 0.0)
        loss.backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()

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
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
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
    parser.add_argument("--model", choices=MODELS, default="tiny", help="qwen3-30b-a3b-layers: for a CUDA GPU")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers of qwen3-30b-a3b-layers (its has 48)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rows, args.tokens, args.repeats, args.rounds = 4, 32, 1, 1
    if args.worker:
        result = worker(args.worker, args.rows, args.tokens, args.repeats, args.cache, args.model, args.layers)
        print(json.dumps(result))
        return
    configs = CONFIGS if args.model == "tiny" else CONFIGS[1:]
    versions = {name: package_version(name) for name in ("torch", "transformers", "trl")}
    print(", ".join(f"{name} {value}" for name, value in versions.items()))
    print(
        f"training pass: {args.rows} rows x {args.tokens} real tokens, packed, forward + backward, median of "
        f"{args.repeats}\n"
    )
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(args.rounds):
            for config in configs:
                if args.quick:  # one interpreter start for all: peak memory is then not each configuration's own
                    result = worker(config, args.rows, args.tokens, args.repeats, cache, args.model, args.layers)
                else:
                    command = [sys.executable, __file__, "--worker", config, "--cache", cache]
                    command += ["--rows", str(args.rows), "--tokens", str(args.tokens)]
                    command += ["--repeats", str(args.repeats), "--model", args.model, "--layers", str(args.layers)]
                    answer = subprocess.run(command, capture_output=True, text=True, check=True).stdout.splitlines()
                    result = json.loads(answer[-1])
                best = results.get(config)
                if best is None or result["tokens_per_second"] > best["tokens_per_second"]:
                    results[config] = result
    baseline = configs[0]
    print(
        f"on {results[baseline]['device']}; model: {args.model}"
        + (f", {args.layers} layers" if configs[0] != "dense" else "")
    )
    print(
        f"| {'configuration':<22} | {'parameters':>13} | tokens/s | vs {baseline:<5} | peak RSS MiB | CUDA peak MiB |"
    )
    print(f"|{'-' * 24}|{'-' * 14}:|---------:|---------:|-------------:|--------------:|")
    for config, result in results.items():
        cuda = "-" if result["cuda_peak_mib"] is None else f"{result['cuda_peak_mib']:.0f}"
        ratio = result["tokens_per_second"] / results[baseline]["tokens_per_second"]
        print(
            f"| {config:<22} | {result['parameters']:>13,} | {result['tokens_per_second']:>8,.0f} | "
            f"{ratio:>8.2f} | {result['peak_rss_mib']:>12.0f} | {cuda:>13} |"
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
