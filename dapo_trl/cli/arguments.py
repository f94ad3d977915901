"""The script's own flags (`DAPOScriptArguments`): data, rewards, tools, chat template and charts. Model flags come
from TRL's ModelConfig (`DAPOModelConfig`: the same fields, with the built-in tiny model as the default and help texts
that say what train_dapo.py does with them), training flags from DAPOConfig; `DAPOParser` (TRL's `TrlParser`) reads
all three from the command line or a YAML `--config` recipe."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from trl import ModelConfig, ScriptArguments, TrlParser

from ..builtin_models import BUILTIN_MODELS
from ..config import DAPOConfig
from ..data import BUILTIN_ARITHMETIC
from ..rewards import REWARD_FUNCTIONS

TOOL_NAMES = ("code_interpreter",)
BUILTIN_TINY_MODEL = "builtin:tiny"
QUANTIZATION_NEEDS = "a CUDA GPU, the bitsandbytes package and --use_peft true (QLoRA: only the LoRA adapters train)"


@dataclass
class DAPOScriptArguments(ScriptArguments):
    """Data and reward choices of the command line (model flags come from ModelConfig, training from DAPOConfig)."""

    dataset_name: str | None = field(
        default=BUILTIN_ARITHMETIC,
        metadata={
            "help": f"Hub dataset id (e.g. BytedTsinghua-SIA/DAPO-Math-17k), a local .jsonl/.json/.parquet/.csv "
            f"file, or '{BUILTIN_ARITHMETIC}' (generated problems, offline)."
        },
    )
    prompt_column: str | None = field(
        default=None,
        metadata={
            "help": "Column holding the problem text or chat messages (default: the preset's, or auto-detected)."
        },
    )
    answer_column: str | None = field(
        default=None,
        metadata={"help": "Column holding the answer; dotted names reach nested fields (reward_model.ground_truth)."},
    )
    prompt_template: str = field(
        default="dapo",
        metadata={
            "help": "Template for text problems: 'dapo' (DAPO's \"Answer:\" template), 'none', or a string "
            "with {problem}. Ignored for chat-message prompts."
        },
    )
    skip_malformed_rows: bool = field(
        default=False,
        metadata={
            "help": "Skip (and count) rows with a missing answer, empty prompt or wrong types instead of failing."
        },
    )
    eval_dataset_name: list[str] | None = field(
        default=None,
        metadata={
            "help": "Validation sets (presets aime2024, aime2025, gsm8k, hub ids or files); reported as avg@n and "
            "pass@k per data source every eval_steps and, with val_before_train, before training."
        },
    )
    judge_base_url: str | None = field(
        default=None,
        metadata={"help": "OpenAI-compatible endpoint (e.g. a vLLM server http://host:8000) for --reward_funcs judge."},
    )
    judge_model: str | None = field(default=None, metadata={"help": "Model name the judge endpoint serves."})
    judge_max_concurrency: int = field(default=32, metadata={"help": "Concurrent requests to the judge."})
    reward_funcs: list[str] = field(
        default_factory=lambda: ["dapo_math"],
        metadata={
            "help": f"Reward functions: names among {sorted(REWARD_FUNCTIONS)}, 'judge', or import paths "
            "(my_pkg.rewards.my_reward, my_pkg.rewards:my_reward or path/to/file.py:my_reward; a verl "
            "compute_score(data_source, solution_str, ground_truth, extra_info) is adapted). The first one is the "
            "accuracy reward unless accuracy_reward_name says."
        },
    )
    tools: list[str] = field(
        default_factory=list,
        metadata={
            "help": f"Tools the policy may call: {list(TOOL_NAMES)} (ReTool's sandboxed Python interpreter); "
            "--tool_config implies it."
        },
    )
    sandbox: str = field(
        default="local",
        metadata={"help": "Where tool code runs: 'local' (isolated processes here) or 'remote' (SandboxFusion)."},
    )
    sandbox_url: str | None = field(
        default=None,
        metadata={
            "help": "SandboxFusion base URL, e.g. http://host:8080: where --sandbox remote runs tool code, and where "
            "the verl_default reward runs code data sources (codecontests, apps, codeforces, taco) against their tests."
        },
    )
    sandbox_timeout: float = field(default=30.0, metadata={"help": "Wall-clock seconds per tool call."})
    sandbox_memory_mb: int = field(default=1024, metadata={"help": "Memory limit per tool call (MB)."})
    sandbox_max_concurrency: int = field(
        default=128, metadata={"help": "Tool calls running at once, per training process."}
    )
    sandbox_rate_limit: float | None = field(
        default=None, metadata={"help": "Tool calls started per second, per training process (default: no limit)."}
    )
    sandbox_require_isolation: bool = field(
        default=False,
        metadata={"help": "Fail instead of warning when the local sandbox cannot use namespaces or drop privileges."},
    )
    tool_max_output_chars: int = field(
        default=1024, metadata={"help": "Characters of a tool's output the model sees (head and tail kept)."}
    )
    tool_config: str | None = field(
        default=None,
        metadata={
            "help": "verl's tool config YAML (rollout.multi_turn.tool_config_path, e.g. the ReTool recipe's "
            "sandbox_fusion_tool_config.yaml): its SandboxFusionTool becomes the code interpreter on that remote "
            "sandbox (url, default_timeout, memory_limit_mb, rate_limit/num_workers concurrency, tool_schema). "
            "Implies --tools code_interpreter; fields it cannot honour are logged as warnings."
        },
    )
    chat_template: str | None = field(
        default=None,
        metadata={
            "help": "Replace the tokenizer's chat template: a TRL template name (e.g. qwen2_5, the Hermes tool "
            "format) or a .jinja file. Tools need a template that renders tool calls."
        },
    )
    lora_exclude_modules: list[str] | None = field(
        default=None,
        metadata={
            "help": "With --use_peft: modules LoRA leaves out although --lora_target_modules matches them (PEFT's "
            "LoraConfig.exclude_modules; verl's actor_rollout_ref.model.exclude_modules). One value is a regular "
            "expression the full module name must match, several are names or name suffixes."
        },
    )
    plot: bool = field(
        default=True,
        metadata={
            "help": "Write the charts (python -m dapo_trl.plot) to OUTPUT_DIR/plots at the end of training; "
            "--plot false to skip."
        },
    )
    # TRL's ScriptArguments fields that train_dapo.py has no use for: listed by --help as TRL lists them, refused when
    # set, so that none of them does nothing silently.
    dataset_test_split: str = field(
        default="test",
        metadata={"help": "Not read: validation sets come from --eval_dataset_name."},
    )
    dataset_streaming: bool = field(
        default=False,
        metadata={"help": "Not supported: the prompt set is loaded whole (DAPO-Math-17k is 17k rows); refused if set."},
    )
    ignore_bias_buffers: bool = field(
        default=False, metadata={"help": "Not supported (a DDP option of TRL's DPO scripts); refused if set."}
    )

    def __post_init__(self) -> None:
        unused = {
            "dataset_test_split": (
                self.dataset_test_split != "test",
                "pass the validation sets to --eval_dataset_name",
            ),
            "dataset_streaming": (self.dataset_streaming, "leave it false: train_dapo.py loads the prompt set whole"),
            "ignore_bias_buffers": (self.ignore_bias_buffers, "leave it false: the DAPO script has no such option"),
        }
        for name, (set_by_user, fix) in unused.items():
            if set_by_user:
                raise ValueError(f"--{name} is not read by train_dapo.py: {fix}.")


@dataclass
class DAPOModelConfig(ModelConfig):
    """TRL's `ModelConfig` flags, unchanged but for what --help says: the default model is the built-in tiny one
    (train_dapo.py loads it when the flag is unset), and bitsandbytes quantization names what it needs
    (`cli.train.quantization_config` refuses it without them)."""

    model_name_or_path: str | None = field(
        default=BUILTIN_TINY_MODEL,
        metadata={
            "help": f"Model to train: a hub id, a local folder, or a built-in model that needs no download "
            f"({', '.join(BUILTIN_MODELS)})."
        },
    )
    load_in_8bit: bool = field(
        default=False,
        metadata={"help": f"Load the base model's weights in 8 bits (bitsandbytes). Needs {QUANTIZATION_NEEDS}."},
    )
    load_in_4bit: bool = field(
        default=False,
        metadata={
            "help": "Load the base model's weights in 4 bits (bitsandbytes; computed in --dtype, shaped by "
            f"--bnb_4bit_quant_type, --use_bnb_nested_quant and --bnb_4bit_quant_storage). Needs {QUANTIZATION_NEEDS}."
        },
    )
    bnb_4bit_quant_type: str = field(
        default="nf4",
        metadata={"help": "With --load_in_4bit: the 4-bit data type.", "choices": ["fp4", "nf4"]},
    )
    use_bnb_nested_quant: bool = field(
        default=False,
        metadata={"help": "With --load_in_4bit: quantize the quantization constants too (double quantization)."},
    )
    bnb_4bit_quant_storage: str | None = field(
        default=None,
        metadata={"help": "With --load_in_4bit: the dtype the packed 4-bit weights are stored in (default: uint8)."},
    )


RECIPE_HELP = (
    "A YAML recipe whose keys are any of the flags below without their dashes (max_steps: 4), such as "
    "configs/dapo_tiny.yaml or the recipe.yaml that python -m dapo_trl.from_verl writes; an 'env:' mapping in it "
    "sets environment variables. Flags given on the command line override it."
)


class DAPOParser(TrlParser):
    """The command line's parser: TRL's `TrlParser` over (DAPOScriptArguments, DAPOConfig, DAPOModelConfig), with
    abbreviations refused (a typo such as --epsilon_hi must fail, not silently set epsilon_high) and `--config`
    listed in --help.

    `parse_args_and_config` returns (script_args, training_args, model_args)."""

    def __init__(self) -> None:
        super().__init__((DAPOScriptArguments, DAPOConfig, DAPOModelConfig), allow_abbrev=False)
        # TrlParser reads --config itself and takes it out of the arguments before argparse sees them, but never
        # declares it, so --help did not list it. Declared here for the help, first after -h; SUPPRESS keeps it off
        # the parsed namespace, which HfArgumentParser would otherwise return as a fourth value.
        action = self.add_argument("--config", metavar="RECIPE.yaml", default=argparse.SUPPRESS, help=RECIPE_HELP)
        for actions in (self._actions, self._optionals._group_actions):
            actions.remove(action)
            actions.insert(1, action)

    def parse_args_and_config(self, args: Iterable[str] | None = None, **kwargs: Any) -> tuple[Any, ...]:
        words = list(sys.argv[1:] if args is None else args)
        # TrlParser looks for the word `--config` only: `--config=recipe.yaml` becomes the two words it reads.
        words = [part for word in words for part in (word.split("=", 1) if word.startswith("--config=") else [word])]
        if words and words[-1] == "--config":
            self.error("argument --config: expected the path of a YAML recipe")
        return super().parse_args_and_config(words, **kwargs)

    def set_defaults_with_config(self, **kwargs: Any) -> list[str]:
        if "config" in kwargs:
            raise ValueError("a recipe cannot name another recipe: remove its 'config' key")
        return super().set_defaults_with_config(**kwargs)
