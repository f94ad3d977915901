"""`train_dapo.py` / `dapo-train` / `python -m dapo_trl.cli`: model loading and `main`.

The flags and their parser (`DAPOParser`: script, DAPOConfig and ModelConfig flags or a YAML `--config`) are
`arguments`, reward and tool resolution `components`, the end-of-run table and charts `run_summary`.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Any

from trl import ModelConfig, get_peft_config

from ..config import DAPOConfig
from ..data import DatasetLoadError, load_prompt_dataset
from ..training.checkpoints import IncompleteCheckpointError
from .arguments import DAPOParser
from .components import UserFacingError, build_tools, resolve_reward_function
from .run_summary import print_summary, write_charts

logger = logging.getLogger("dapo_trl")

BUILTIN_TINY_MODEL = "builtin:tiny"
TRL_DEPRECATED_CALLS = r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is"


def resolve_chat_template(value: str) -> str:
    """A TRL chat template by name (trl/chat_templates/NAME.jinja) or the text of a .jinja file."""
    import trl

    if os.path.isfile(value):
        return Path(value).read_text(encoding="utf-8")
    bundled = Path(trl.__file__).parent / "chat_templates"
    candidate = bundled / f"{value}.jinja"
    if candidate.is_file():
        return candidate.read_text(encoding="utf-8")
    names = sorted(p.stem for p in bundled.glob("*.jinja") if not p.stem.endswith("_training"))
    raise UserFacingError(f"--chat_template {value!r}: not a file nor a TRL template; TRL has {', '.join(names)}.")


def load_model_and_tokenizer(model_args: ModelConfig, training_args: DAPOConfig) -> tuple[Any, Any]:
    """Load the policy and tokenizer; an unreachable hub becomes one actionable message, not a traceback."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..tiny_model import BUILTIN_MODELS, resolve_builtin_model

    name = model_args.model_name_or_path or BUILTIN_TINY_MODEL
    if name in BUILTIN_MODELS:
        name = resolve_builtin_model(name)
        logger.info("using the built-in %s model at %s", model_args.model_name_or_path or BUILTIN_TINY_MODEL, name)
    model_kwargs: dict[str, Any] = {
        "revision": model_args.model_revision,
        "trust_remote_code": training_args.trust_remote_code,
    }
    if model_args.dtype not in (None, "auto"):
        model_kwargs["dtype"] = model_args.dtype
    if model_args.attn_implementation is not None:
        model_kwargs["attn_implementation"] = model_args.attn_implementation
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=model_args.model_revision, trust_remote_code=training_args.trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(name, **model_kwargs)
    except OSError as error:
        raise UserFacingError(
            f"could not load model {name!r}: {str(error).splitlines()[0]}\n"
            "  If it is a hub id, this machine cannot reach the hub and has no cached copy: download it where the "
            "hub is reachable and set MODEL_PATH / --model_name_or_path to the local folder, or unset it to use the "
            "built-in tiny model."
        ) from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return model, tokenizer


def peft_config(model_args: ModelConfig, script_args: Any) -> Any:
    """TRL's LoRA config from the ModelConfig flags (None without --use_peft), with --lora_exclude_modules added."""
    config = get_peft_config(model_args)
    excluded = script_args.lora_exclude_modules
    if excluded and config is None:
        raise UserFacingError("--lora_exclude_modules needs --use_peft true: it names modules LoRA leaves out.")
    if excluded:
        # As TRL treats --lora_target_modules: one value is PEFT's regular expression, several are names.
        config.exclude_modules = excluded[0] if len(excluded) == 1 else set(excluded)
    return config


def main(argv: list[str] | None = None) -> int:
    # TRL 1.16 calls transformers 5's deprecated gradient-checkpointing methods around every generation: a
    # FutureWarning per step that no flag can fix. A user's own deprecated --gradient_checkpointing still warns.
    warnings.filterwarnings("ignore", message=TRL_DEPRECATED_CALLS, category=FutureWarning)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        script_args, training_args, model_args = DAPOParser().parse_args_and_config(args=argv)
    except ValueError as error:  # DAPOConfig's checks: the message names the field and the fix
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        from ..trainer import DAPOTrainer

        reward_funcs = [resolve_reward_function(name, script_args) for name in script_args.reward_funcs]
        model, tokenizer = load_model_and_tokenizer(model_args, training_args)
        if script_args.chat_template:
            tokenizer.chat_template = resolve_chat_template(script_args.chat_template)
        tools = build_tools(script_args, world_size=training_args.world_size)
        if tools:
            from trl.chat_template_utils import supports_tool_calling

            if not supports_tool_calling(tokenizer):
                raise UserFacingError(
                    "--tools: the tokenizer's chat template cannot render tool calls; pass --chat_template qwen2_5 "
                    "(the Hermes format ReTool uses) or a .jinja file with tool support."
                )
        data_options = {
            "prompt_column": script_args.prompt_column,
            "answer_column": script_args.answer_column,
            "template": script_args.prompt_template,
            "skip_malformed": script_args.skip_malformed_rows,
        }
        train_dataset = load_prompt_dataset(
            script_args.dataset_name,
            split=script_args.dataset_train_split,
            config=script_args.dataset_config,
            **data_options,
        )
        eval_dataset = None
        evaluates = training_args.eval_strategy != "no" or training_args.val_before_train or training_args.eval_on_start
        if script_args.eval_dataset_name and not evaluates:
            logger.info("--eval_dataset_name not loaded: --eval_strategy is 'no' and nothing validates before training")
        elif script_args.eval_dataset_name:
            from datasets import concatenate_datasets

            eval_dataset = concatenate_datasets(
                [
                    load_prompt_dataset(name, template=script_args.prompt_template)
                    for name in script_args.eval_dataset_name
                ]
            )
        trainer = DAPOTrainer(
            model=model,
            reward_funcs=reward_funcs,
            args=training_args,
            train_dataset=train_dataset,
            eval_dataset=eval_dataset,
            processing_class=tokenizer,
            peft_config=peft_config(model_args, script_args),
            tools=tools or None,
        )
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except (UserFacingError, DatasetLoadError, IncompleteCheckpointError) as error:  # say what to change, no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    if trainer.preempted:  # the checkpoint is written; the scheduler's deadline is near: no final save
        if trainer.accelerator.is_main_process:
            step = trainer.state.global_step
            saved = f"checkpoint-{step} is complete in {training_args.output_dir}" if step else "nothing to save yet"
            print(
                f"\npreempted after step {step}: {saved}; run the same command with --resume_from_checkpoint "
                "latest to continue."
            )
        leave_together(trainer.accelerator)
        return 0
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        print_summary(trainer.state.log_history)
        print(f"\nsaved to {training_args.output_dir}")
        if script_args.plot:
            write_charts(training_args.output_dir, trainer.state.log_history)
    leave_together(trainer.accelerator)
    return 0


def leave_together(accelerator: Any) -> None:
    """Every process waits for the others, then the process groups are torn down (Accelerate's `end_training`).

    A process that exits while a peer is still saving can abort after a run that succeeded ("terminate called
    without an active exception": a gloo worker thread finishing its last collective needs the GIL while the
    interpreter shuts down), which `accelerate launch` reports as a failed run.
    """
    import gc

    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
    accelerator.end_training()
    gc.collect()  # sub-groups (sequence parallelism) still referenced by the trainer go with it, threads joined


if __name__ == "__main__":
    sys.exit(main())
