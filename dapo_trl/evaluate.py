"""Evaluate any checkpoint: avg@n and pass@k per data source.

    python -m dapo_trl.evaluate --model ./out/checkpoint-100 --dataset aime2024 aime2025 --num_samples 32

Sampling goes through vLLM when it is installed (`--backend auto`), else transformers' `generate`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from .data import load_prompt_dataset
from .evaluation import (
    build_results,
    format_table,
    sample_with_transformers,
    sample_with_vllm,
    score_responses,
    summarize,
    write_samples,
)
from .rewards import REWARD_FUNCTIONS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dapo_trl.evaluate", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument(
        "--model", required=True, help="checkpoint folder or hub id ('builtin:tiny' for the tiny model)"
    )
    parser.add_argument(
        "--dataset",
        nargs="+",
        required=True,
        help="presets (aime2024, aime2025, gsm8k, dapo-math-17k), hub ids, local files, "
        "'preset:/path/file' or builtin:arithmetic",
    )
    parser.add_argument("--num_samples", type=int, default=32, help="responses per prompt (avg@n, pass@1..n)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=0.7)
    parser.add_argument("--max_new_tokens", type=int, default=1024)
    parser.add_argument(
        "--reward",
        default="dapo_math",
        choices=sorted(REWARD_FUNCTIONS),
        help="scorer deciding correctness (reward > 0)",
    )
    parser.add_argument("--prompt_template", default="dapo", help="'dapo', 'none' or a string with {problem}")
    parser.add_argument("--max_prompts", type=int, default=None, help="evaluate only the first N prompts per dataset")
    parser.add_argument("--batch_size", type=int, default=8, help="prompts per generate() call (transformers)")
    parser.add_argument("--backend", default="auto", choices=["auto", "vllm", "transformers"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None, help="write metrics and every sampled response to this JSON file")
    args = parser.parse_args(argv)
    if args.num_samples < 1 or args.max_new_tokens < 1 or args.temperature <= 0 or not 0 < args.top_p <= 1:
        parser.error("need --num_samples >= 1, --max_new_tokens >= 1, --temperature > 0 and 0 < --top_p <= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    from datasets import concatenate_datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_path = args.model
    if model_path == "builtin:tiny":
        from .testing import build_tiny_model

        model_path = str(build_tiny_model())
    datasets = []
    for name in args.dataset:
        dataset = load_prompt_dataset(name, template=args.prompt_template, seed=args.seed)
        datasets.append(dataset.select(range(min(len(dataset), args.max_prompts or len(dataset)))))
    dataset = concatenate_datasets(datasets)
    rows = [dataset[i] for i in range(len(dataset))]
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except OSError as error:
        print(f"error: could not load {model_path!r}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    use_vllm = args.backend == "vllm" or (args.backend == "auto" and importlib.util.find_spec("vllm") is not None)
    sampling = {
        "num_samples": args.num_samples,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "max_new_tokens": args.max_new_tokens,
    }
    prompts = [row["prompt"] for row in rows]
    torch.manual_seed(args.seed)
    if use_vllm:
        completions = sample_with_vllm(model_path, tokenizer, prompts, seed=args.seed, **sampling)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype="auto")
        model.to("cuda" if torch.cuda.is_available() else "cpu").eval()
        completions = sample_with_transformers(model, tokenizer, prompts, batch_size=args.batch_size, **sampling)
    correct = score_responses(REWARD_FUNCTIONS[args.reward], rows, completions)
    results = build_results(list(range(len(rows))), rows, completions, correct)
    metrics = summarize(results)
    print(format_table(metrics))
    if args.output:
        write_samples(args.output + ".samples.jsonl", results)
        with open(args.output, "w") as f:
            json.dump(
                {"metrics": metrics, "args": vars(args), "backend": "vllm" if use_vllm else "transformers"}, f, indent=2
            )
        print(f"metrics written to {args.output}, responses to {args.output}.samples.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
