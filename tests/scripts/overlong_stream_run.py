"""A DAPOTrainer built on a streamed train set with `max_prompt_length`, where process 1's stream holds only overlong
prompts and process 0's only short ones (as a stream split by node could): every process must raise the same error
at construction (none may build and then wait in a collective for the one that raised).

Run as `python overlong_stream_run.py OUT MAX_PROMPT_LENGTH` (one process) or under
`accelerate launch --multi_gpu --num_processes 2`. Writes OUT/rank{R}.txt: "built", or "ValueError: <message>".
"""

import os
import sys
from pathlib import Path

from accelerate import Accelerator
from datasets import Dataset
from script_args import leave_together

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

SHORT = {"prompt": [{"role": "user", "content": "hi"}], "solution": "1"}
LONG = {"prompt": [{"role": "user", "content": "word " * 200}], "solution": "1"}


def main() -> None:
    out, max_prompt_length = Path(sys.argv[1]), int(sys.argv[2])
    rank = int(os.environ.get("RANK", "0"))
    config = DAPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=8,
        max_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        **activation_checkpointing_kwargs(False),
        max_prompt_length=max_prompt_length,
    )
    stream = Dataset.from_list([SHORT if rank == 0 else LONG] * 4).to_iterable_dataset()
    try:
        DAPOTrainer(model=str(build_tiny_model()), args=config, train_dataset=stream)
        outcome = "built"
    except ValueError as error:
        outcome = f"ValueError: {error}"
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.txt").write_text(outcome)
    leave_together(Accelerator())  # exiting while the peer holds the gloo group aborted about one run in three


if __name__ == "__main__":
    main()
