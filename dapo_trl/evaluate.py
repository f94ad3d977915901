"""Evaluate any checkpoint: avg@n and pass@k per data source.

    python -m dapo_trl.evaluate --model ./out/checkpoint-100 --dataset aime2024 aime2025 --num_samples 32

Sampling goes through vLLM when it is installed (`--backend auto`), else transformers' `generate`. This module
is only the command line: sampling, scoring and the metrics live in `dapo_trl.validation`, shared with training.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys

from .data import load_prompt_dataset
from .rewards import REWARD_FUNCTIONS
from .validation import ValidationSampling, format_table, summarize, validate_checkpoint, write_samples


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m dapo_trl.evaluate", description=__doc__.splitlines()[0], allow_abbrev=False
    )
    parser.add_argument(
        "--model", required=True, help="checkpoint folder or hub id ('builtin:tiny' or 'builtin:tiny-moe')"
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
    """Load the datasets and the tokenizer, then sample, score and report through `dapo_trl.validation`."""
    args = parse_args(argv)
    from datasets import concatenate_datasets
    from transformers import AutoTokenizer

    model_path = args.model
    from .builtin_models import resolve_builtin_model

    model_path = resolve_builtin_model(model_path)
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
    use_vllm = args.backend == "vllm" or (args.backend == "auto" and importlib.util.find_spec("vllm") is not None)
    backend = "vllm" if use_vllm else "transformers"
    results = validate_checkpoint(
        model_path,
        tokenizer,
        rows,
        REWARD_FUNCTIONS[args.reward],
        ValidationSampling(
            args.num_samples, args.temperature, args.top_p, args.max_new_tokens, args.batch_size, args.seed
        ),
        backend,
    )
    metrics = summarize(results)
    print(format_table(metrics))
    if args.output:
        write_samples(args.output + ".samples.jsonl", results)
        with open(args.output, "w") as f:
            json.dump({"metrics": metrics, "args": vars(args), "backend": backend}, f, indent=2)
        print(f"metrics written to {args.output}, responses to {args.output}.samples.jsonl")
    return 0


if __name__ == "__main__":
    sys.exit(main())
