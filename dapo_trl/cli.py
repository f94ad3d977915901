"""`train_dapo.py` / `dapo-train`: TRL's parser over (script, DAPOConfig, ModelConfig) flags or a YAML `--config`."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import itertools
import logging
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig, ScriptArguments, TrlParser, get_peft_config

from .config import DAPOConfig
from .data import BUILTIN_ARITHMETIC, DatasetLoadError, load_prompt_dataset
from .rewards import REWARD_BUILDERS, REWARD_FUNCTIONS, MissingRewardOptions, build_reward
from .rewards.verl_compat import from_verl_compute_score, is_verl_compute_score

logger = logging.getLogger("dapo_trl")

BUILTIN_TINY_MODEL = "builtin:tiny"
# Metrics printed in the end-of-run summary, in this order, when they were logged: the leading ones, then every
# reward function's mean (rewards/<name>/mean), then the rest.
LEADING_SUMMARY_METRICS = ("loss", "reward", "reward_std")
SUMMARY_METRICS = (
    "overlong/penalized_frac",
    "completions/mean_length",
    "completions/clipped_ratio",
    "frac_reward_zero_std",
    "dynamic_sampling/rounds",
    "dynamic_sampling/groups_generated",
    "dynamic_sampling/groups_kept",
    "dynamic_sampling/keep_rate",
    "dynamic_sampling/filler_groups",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "entropy",
)


TOOL_NAMES = ("code_interpreter",)
TRL_DEPRECATED_CALLS = r"`(is_gradient_checkpointing|gradient_checkpointing_enable|gradient_checkpointing_disable)` is"


class UserFacingError(RuntimeError):
    """An error whose message is the whole story: printed without a traceback."""


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
        default=None, metadata={"help": "SandboxFusion base URL for --sandbox remote, e.g. http://host:8080."}
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
    plot: bool = field(
        default=True,
        metadata={
            "help": "Write the charts (python -m dapo_trl.plot) to OUTPUT_DIR/plots at the end of training; "
            "--plot false to skip."
        },
    )


def resolve_reward_function(name: str, script_args: DAPOScriptArguments | None = None) -> Any:
    """A registered reward by name (built with the options it reads from `script_args`, e.g. the judge's endpoint),
    or any importable callable by dotted path."""
    if name in REWARD_BUILDERS:
        try:
            return build_reward(name, script_args)
        except MissingRewardOptions as error:
            needed = " and ".join(f"--{option}" for option in error.required)
            raise UserFacingError(f"--reward_funcs {name} needs {needed}.") from None
    if ":" in name:  # module:function or path/to/file.py:function (verl's custom_reward_function.path / .name)
        module_name, _, attribute = name.rpartition(":")
    else:
        module_name, _, attribute = name.rpartition(".")
    if not module_name or not attribute:
        raise UserFacingError(
            f"--reward_funcs {name!r}: unknown reward; use one of {sorted(REWARD_FUNCTIONS)}, a dotted path "
            "(my_pkg.rewards.fn), module:function or path/to/file.py:function."
        )
    try:
        function = getattr(_import_reward_module(module_name), attribute)
    except (ImportError, AttributeError, OSError, SyntaxError) as error:
        raise UserFacingError(f"--reward_funcs {name!r}: cannot import it ({error}).") from None
    if is_verl_compute_score(function):  # verl's per-response signature: adapt it to TRL's batched one
        return from_verl_compute_score(function)
    return function


def _import_reward_module(module_name: str) -> Any:
    """A module by dotted name, or a Python file by path (imported under a name derived from the path)."""
    if not module_name.endswith(".py"):
        return importlib.import_module(module_name)
    path = Path(module_name).expanduser().resolve()
    if not path.is_file():
        raise ImportError(f"no file {str(path)!r}")
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]  # the same name in every process
    spec = importlib.util.spec_from_file_location(f"dapo_trl_reward_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up by name
    spec.loader.exec_module(module)
    return module


# --tool_config sets these script fields; the same flag given with another non-default value is a conflict.
TOOL_CONFIG_FIELDS = {
    "sandbox": lambda settings: "remote",
    "sandbox_url": lambda settings: settings.sandbox_url,
    "sandbox_timeout": lambda settings: settings.timeout_s,
    "sandbox_memory_mb": lambda settings: settings.memory_mb,
    "sandbox_max_concurrency": lambda settings: settings.max_concurrency,
}


def apply_tool_config(script_args: DAPOScriptArguments, world_size: int = 1) -> Any:
    """Read --tool_config (verl's tool YAML) into the --sandbox_* fields; returns its settings (None without it)."""
    if not script_args.tool_config:
        return None
    from .tools.verl_config import ToolConfigError, load_verl_tool_config

    try:
        settings = load_verl_tool_config(script_args.tool_config, world_size=world_size)
    except ToolConfigError as error:
        raise UserFacingError(f"--tool_config: {error}") from None
    defaults = {f.name: f.default for f in dataclasses.fields(DAPOScriptArguments)}
    for name, value_of in TOOL_CONFIG_FIELDS.items():
        given, value = getattr(script_args, name), value_of(settings)
        if given not in (defaults[name], value):
            raise UserFacingError(
                f"--{name} {given} contradicts --tool_config {script_args.tool_config}, which sets it to {value}: "
                "drop one of them."
            )
        setattr(script_args, name, value)
    if script_args.tools and script_args.tools != [TOOL_NAMES[0]]:
        raise UserFacingError(f"--tool_config describes the {TOOL_NAMES[0]} tool only; drop --tools from the call.")
    script_args.tools = [TOOL_NAMES[0]]
    for note in settings.notes:
        logger.warning("--tool_config %s: %s", script_args.tool_config, note)
    return settings


def build_tools(script_args: DAPOScriptArguments, world_size: int = 1) -> list[Any]:
    """The tool functions named by --tools (or --tool_config), each over the sandbox the --sandbox_* flags describe."""
    settings = apply_tool_config(script_args, world_size)
    unknown = [name for name in script_args.tools if name not in TOOL_NAMES]
    if unknown:
        raise UserFacingError(f"--tools {' '.join(unknown)}: unknown tool; available: {', '.join(TOOL_NAMES)}.")
    if not script_args.tools:
        return []
    from .tools.code_interpreter import build_code_interpreter

    try:
        interpreter = build_code_interpreter(
            script_args.sandbox,
            url=script_args.sandbox_url,
            timeout_s=script_args.sandbox_timeout,
            memory_mb=script_args.sandbox_memory_mb,
            max_concurrency=script_args.sandbox_max_concurrency,
            rate_limit=script_args.sandbox_rate_limit,
            require_isolation=script_args.sandbox_require_isolation,
            max_output_chars=script_args.tool_max_output_chars,
        )
    except ValueError as error:
        raise UserFacingError(f"--tools code_interpreter: {error}") from None
    if script_args.sandbox == "local" and script_args.sandbox_require_isolation:
        interpreter.sandbox.isolation()  # fail now, not at the first tool call
    if settings is not None:
        from .tools.verl_config import apply_tool_schema

        apply_tool_schema(interpreter.tool, settings)
    return [interpreter.tool]


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

    name = model_args.model_name_or_path or BUILTIN_TINY_MODEL
    if name == BUILTIN_TINY_MODEL:
        from .tiny_model import build_tiny_model

        name = str(build_tiny_model(warm_start=True))
        logger.info("using the built-in tiny model at %s", name)
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


def summary_columns(steps: list[dict[str, Any]], max_columns: int = 8) -> list[tuple[str, list[dict[str, Any]]]]:
    """One column per logged step, or, for longer runs, `max_columns` consecutive windows (shown as their mean)."""
    if len(steps) <= max_columns:
        return [(f"step {entry.get('step', '?')}", [entry]) for entry in steps]
    bounds = [round(i * len(steps) / max_columns) for i in range(max_columns + 1)]
    windows = [steps[start:end] for start, end in itertools.pairwise(bounds)]
    return [(f"{window[0].get('step', '?')}-{window[-1].get('step', '?')}", window) for window in windows]


def print_summary(log_history: list[dict[str, Any]]) -> None:
    """Print the DAPO metrics of every logged step (or of 8 windows of steps, averaged) as a small table."""
    steps = [entry for entry in log_history if "loss" in entry or "reward" in entry]
    if not steps:
        return
    reward_means = sorted(
        {key for entry in steps for key in entry if key.startswith("rewards/") and key.endswith("/mean")}
    )
    ordered = (*LEADING_SUMMARY_METRICS, *reward_means, *SUMMARY_METRICS)
    names = [name for name in ordered if any(name in entry for entry in steps)]
    columns = summary_columns(steps)
    averaged = any(len(window) > 1 for _, window in columns)
    print("\nDAPO metrics per logged step" + (" (mean over each window of steps)" if averaged else ""))
    print(f"{'metric':<34}" + "".join(f"{title:>12}" for title, _ in columns))
    for name in names:
        cells = ""
        for _, window in columns:
            values = [entry[name] for entry in window if isinstance(entry.get(name), int | float)]
            cells += f"{sum(values) / len(values):>12.4f}" if values else f"{'-':>12}"
        print(f"{name:<34}{cells}")


def write_charts(output_dir: str, log_history: list[dict[str, Any]]) -> None:
    """--plot: the finished run's charts in OUTPUT_DIR/plots; a failure only warns (the model is already saved)."""
    try:
        from .plot import plot_run

        charts = plot_run(output_dir, log_history=log_history)
    except Exception as error:  # charts are a convenience: never fail a finished run over them
        logger.warning("could not write the charts: %s: %s", type(error).__name__, error)
        return
    if charts:
        print(f"charts: {Path(output_dir) / 'plots'}")
    else:
        logger.warning("no charts: none of the charted metrics was logged")


def main(argv: list[str] | None = None) -> int:
    # TRL 1.16 calls transformers 5's deprecated gradient-checkpointing methods around every generation: a
    # FutureWarning per step that no flag can fix. A user's own deprecated --gradient_checkpointing still warns.
    warnings.filterwarnings("ignore", message=TRL_DEPRECATED_CALLS, category=FutureWarning)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    # No abbreviations: a typo such as --epsilon_hi must fail, not silently set epsilon_high.
    parser = TrlParser((DAPOScriptArguments, DAPOConfig, ModelConfig), allow_abbrev=False)
    try:
        script_args, training_args, model_args = parser.parse_args_and_config(args=argv)
    except ValueError as error:  # DAPOConfig validation: the message names the field and the fix
        print(f"error: {error}", file=sys.stderr)
        return 2
    try:
        from .trainer import DAPOTrainer

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
        if script_args.eval_dataset_name:
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
            peft_config=get_peft_config(model_args),
            tools=tools or None,
        )
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except (UserFacingError, DatasetLoadError) as error:  # messages that say what to change: no traceback
        print(f"error: {error}", file=sys.stderr)
        return 2
    trainer.save_model(training_args.output_dir)
    if trainer.accelerator.is_main_process:
        print_summary(trainer.state.log_history)
        print(f"\nsaved to {training_args.output_dir}")
        if script_args.plot:
            write_charts(training_args.output_dir, trainer.state.log_history)
    return 0


if __name__ == "__main__":
    sys.exit(main())
