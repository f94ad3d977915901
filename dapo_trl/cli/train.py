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

import torch
from accelerate import PartialState
from transformers.utils import is_bitsandbytes_available
from trl import ModelConfig, get_peft_config, get_quantization_config

from ..config import DAPOConfig
from ..data import DatasetLoadError, load_prompt_dataset
from ..training.faults.checkpoints import IncompleteCheckpointError
from .arguments import BUILTIN_TINY_MODEL, DAPOParser
from .components import UserFacingError, build_tools, resolve_reward_function
from .run_summary import print_summary, write_charts

logger = logging.getLogger("dapo_trl")

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


# The ModelConfig and DAPOConfig flags that are from_pretrained keywords too: (flag, keyword).
FLAG_KEYWORDS = (
    ("model_revision", "revision"),
    ("trust_remote_code", "trust_remote_code"),
    ("attn_implementation", "attn_implementation"),
    ("dtype", "dtype"),
)
BNB_4BIT_FLAGS = ("bnb_4bit_quant_type", "use_bnb_nested_quant", "bnb_4bit_quant_storage")
IGNORED_INIT_KWARGS = "The `model_init_kwargs` will be ignored"  # GRPOTrainer's warning for a model passed loaded


def _is_default(owner: Any, name: str) -> bool:
    return getattr(owner, name) == type(owner).__dataclass_fields__[name].default


def from_pretrained_kwargs(model_args: ModelConfig, training_args: DAPOConfig) -> dict[str, Any]:
    """from_pretrained's keywords as TRL's `trl/scripts/grpo.py` builds them: --model_revision, --trust_remote_code,
    --attn_implementation and --dtype, then `--model_init_kwargs` over them. A flag left at its default gives way to
    the same key (as in TRL); a flag set to another value than the key is refused, naming both. Flags at None are left
    out (from_pretrained's own default)."""
    given = dict(training_args.model_init_kwargs or {})
    if "torch_dtype" in given:  # transformers' old name, which would lose to the dtype --dtype passes
        if "dtype" in given:
            raise UserFacingError(
                "--model_init_kwargs sets both 'dtype' and 'torch_dtype' (its old name): keep 'dtype'."
            )
        given["dtype"] = given.pop("torch_dtype")
    kwargs: dict[str, Any] = {}
    for flag, keyword in FLAG_KEYWORDS:
        owner = training_args if flag == "trust_remote_code" else model_args
        value = getattr(owner, flag)
        if keyword in given and given[keyword] != value and not _is_default(owner, flag):
            raise UserFacingError(
                f"--{flag} {value} and --model_init_kwargs' {keyword!r}: {given[keyword]!r} disagree: set "
                f"{keyword} in one of them."
            )
        if value is not None:
            kwargs[keyword] = value
    kwargs.update(given)
    return kwargs


def quantization_config(model_args: ModelConfig, init_kwargs: dict[str, Any]) -> Any:
    """--load_in_4bit / --load_in_8bit as TRL's scripts build them (`trl.get_quantization_config`: None without
    them); refused, naming the flag and what to do instead, where bitsandbytes cannot train them."""
    if not model_args.load_in_4bit:
        shaping = [f"--{name}" for name in BNB_4BIT_FLAGS if not _is_default(model_args, name)]
        if shaping:
            raise UserFacingError(
                f"{', '.join(shaping)}: shape 4-bit weights only; add --load_in_4bit true or drop them."
            )
    if not (model_args.load_in_4bit or model_args.load_in_8bit):
        return None
    flag = "--load_in_4bit" if model_args.load_in_4bit else "--load_in_8bit"
    if not torch.cuda.is_available():
        raise UserFacingError(
            f"{flag}: bitsandbytes' 4-bit and 8-bit weights need a CUDA GPU, and this machine has none. Drop {flag} "
            "to train the model unquantized in --dtype (with --use_peft true only LoRA adapters train, as in QLoRA)."
        )
    if not is_bitsandbytes_available():
        raise UserFacingError(f"{flag} needs the bitsandbytes package: pip install bitsandbytes")
    if not model_args.use_peft:
        raise UserFacingError(
            f"{flag} needs --use_peft true: quantized weights cannot be trained, only LoRA adapters on them (QLoRA)."
        )
    if model_args.load_in_4bit and model_args.dtype in (None, "auto"):
        raise UserFacingError("--load_in_4bit computes in --dtype: set --dtype bfloat16, float16 or float32.")
    if "quantization_config" in init_kwargs:
        raise UserFacingError(f"{flag} and --model_init_kwargs' 'quantization_config' both quantize: keep one.")
    return get_quantization_config(model_args)


def load_model_and_tokenizer(model_args: ModelConfig, training_args: DAPOConfig) -> tuple[Any, Any]:
    """Load the policy and tokenizer; an unreachable hub becomes one actionable message, not a traceback.

    The from_pretrained keywords (`from_pretrained_kwargs`) become `training_args.model_init_kwargs`, as in TRL's
    script, so that a reference model TRL or DAPOTrainer loads is loaded as the policy was."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..builtin_models import BUILTIN_MODELS, resolve_builtin_model

    name = model_args.model_name_or_path or BUILTIN_TINY_MODEL
    if name in BUILTIN_MODELS:
        name = resolve_builtin_model(name)
        logger.info("using the built-in %s model at %s", model_args.model_name_or_path or BUILTIN_TINY_MODEL, name)
    init_kwargs = from_pretrained_kwargs(model_args, training_args)
    model_kwargs = dict(init_kwargs)
    if training_args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        model_kwargs["device_map"] = None  # as in TRL: "auto" fails under distributed training
    quantization = quantization_config(model_args, init_kwargs)
    if quantization is not None:
        model_kwargs["quantization_config"] = quantization
        if model_kwargs.get("device_map") is None:  # this process's GPU, as TRL's get_kbit_device_map (not in 1.16)
            model_kwargs["device_map"] = {"": PartialState().local_process_index}
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            name, revision=init_kwargs.get("revision"), trust_remote_code=init_kwargs.get("trust_remote_code", False)
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
    training_args.model_init_kwargs = init_kwargs
    return model, tokenizer


class DropIgnoredInitKwargsWarning(logging.Filter):
    """GRPOTrainer warns that `model_init_kwargs` are ignored when its model comes loaded; train_dapo.py loaded the
    model with them (`load_model_and_tokenizer`), and TRL loads the reference model with them: the warning is untrue
    here."""

    def filter(self, record: logging.LogRecord) -> bool:
        return IGNORED_INIT_KWARGS not in record.getMessage()


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

        logging.getLogger("trl.trainer.grpo_trainer").addFilter(DropIgnoredInitKwargsWarning())

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
