"""Packed vs padded per-token log-probs of the same rows, per attention implementation and dtype (prints a table).

The rows have very different prompt and completion lengths (left / right padding as TRL builds them). For each
attention implementation the model runs once on the padded batch (TRL's forward) and once packed the way
DAPOTrainer packs for it (bins as wide as the longest row for sdpa / eager, one sequence for flex / flash), and the
table gives the largest and mean absolute difference over the scored completion tokens.

    python benchmarks/packing_exactness.py                     # CPU, built-in tiny model, sdpa and eager, fp32
    python benchmarks/packing_exactness.py --quick             # sdpa only: the suite's check
    python benchmarks/packing_exactness.py --device cuda --model qwen2.5-0.5b --attn sdpa flex_attention eager
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch  # noqa: E402
from common import build_model  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402

from dapo_trl.training.step.packing import VARLEN_ATTENTION, pack_rows, unpack_per_token  # noqa: E402

ROWS = [(64, 1024), (10, 5), (33, 700), (1, 300), (50, 1), (20, 90)]  # (prompt, completion) real lengths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="sdpa only (as --attn sdpa): a check in seconds")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", choices=("tiny", "qwen2.5-0.5b"), default="tiny")
    parser.add_argument("--attn", nargs="+", default=["sdpa", "eager"])
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    if args.quick:
        args.attn = ["sdpa"]
    work = Path(args.work or tempfile.mkdtemp(prefix="packing-exactness-"))
    path, _ = build_model(args.model, work, "fp32")
    width_prompt, width_completion = max(p for p, _ in ROWS), max(c for _, c in ROWS)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 700, (len(ROWS), width_prompt + width_completion), generator=generator).to(args.device)
    mask = torch.zeros_like(ids)
    for row, (prompt, completion) in enumerate(ROWS):
        mask[row, width_prompt - prompt : width_prompt + completion] = 1
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :width_prompt] = -100
    scored = mask[:, width_prompt:].bool()
    print("| attention | dtype | packing | max abs diff | mean abs diff |\n|---|---|---|---|---|")
    for attention in args.attn:
        for dtype in (torch.float32, torch.bfloat16):
            model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention, dtype=dtype)
            model.to(args.device)
            add_fused_lm_head(model)
            one_sequence = attention in VARLEN_ATTENTION
            with torch.no_grad():
                padded = model(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True).log_probs
                packed = pack_rows(ids, mask, width_completion, None if one_sequence else int(mask.sum(1).max()))
                out = model(
                    input_ids=packed.input_ids,
                    position_ids=packed.position_ids,
                    labels=packed.labels,
                    fused_lm_head=True,
                )
            difference = padded[:, -width_completion:] - unpack_per_token(packed, out.log_probs, width_completion)
            difference = difference[scored].abs().float()
            kind = "one sequence" if one_sequence else "bins"
            print(
                f"| {attention} | {str(dtype).split('.')[-1]} | {kind} | {difference.max().item():.2e} | "
                f"{difference.mean().item():.2e} |"
            )


if __name__ == "__main__":
    main()
