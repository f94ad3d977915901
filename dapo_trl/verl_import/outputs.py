"""Writing a translation: `recipe.yaml`, `report.md`, `vllm_server.sh`, `accelerate.yaml` and the extra files."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import Any

import yaml

from .translation import APPROXIMATED, MAPPED, NOT_NEEDED, UNSUPPORTED, Translation

RECIPE_SECTIONS: list[tuple[str, tuple[str, ...]]] = [
    (
        "Model and data",
        (
            "model_name_or_path",
            "dtype",
            "use_peft",
            "lora_r",
            "lora_alpha",
            "lora_target_modules",
            "lora_exclude_modules",
            "lora_dropout",
            "trust_remote_code",
            "use_liger_kernel",
            "dataset_name",
            "eval_dataset_name",
            "prompt_column",
            "prompt_template",
            "chat_template",
            "chat_template_kwargs",
            "max_prompt_length",
            "overlong_prompt_policy",
            "max_completion_length",
            "shuffle_dataset",
            "dataloader_num_workers",
            "seed",
        ),
    ),
    (
        "Batch layout (see report.md: responses per update and per rollout step equal verl's)",
        (
            "num_generations",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "steps_per_generation",
            "num_iterations",
            "max_tokens_per_microbatch",
            "per_device_eval_batch_size",
        ),
    ),
    (
        "DAPO / PPO loss",
        (
            "loss_type",
            "importance_sampling_level",
            "epsilon",
            "epsilon_high",
            "clip_ratio_c",
            "sapo_temperature_pos",
            "sapo_temperature_neg",
            "beta",
            "entropy_coeff",
            "scale_rewards",
            "router_aux_loss_coef",
        ),
    ),
    (
        "Reward and dynamic sampling",
        (
            "reward_funcs",
            "apply_overlong_penalty",
            "overlong_buffer_len",
            "overlong_penalty_factor",
            "filter_groups_enable",
            "max_filter_gen_batches",
            "filter_groups_oversample",
            "filter_groups_on_exhausted",
        ),
    ),
    (
        "Optimizer and schedule (steps are optimizer steps: verl's rollout steps x K)",
        (
            "learning_rate",
            "weight_decay",
            "max_grad_norm",
            "lr_scheduler_type",
            "lr_scheduler_kwargs",
            "warmup_steps",
            "num_train_epochs",
            "max_steps",
        ),
    ),
    (
        "Generation",
        (
            "use_vllm",
            "vllm_mode",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
            "rollout_rejection",
            "rollout_rejection_lower",
            "rollout_rejection_upper",
            "old_logprobs_source",
            "rollout_streaming",
            "routing_replay",
            "temperature",
            "top_p",
            "top_k",
            "padding_free",
            "activation_checkpointing",
            "gradient_checkpointing",  # transformers before the rename (5.17)
        ),
    ),
    ("Tools", ("tool_config", "max_tool_calling_iterations", "tool_max_output_chars")),
    (
        "Validation",
        (
            "eval_strategy",
            "eval_steps",
            "val_before_train",
            "eval_num_samples",
            "eval_temperature",
            "eval_top_p",
            "eval_samples_to_log",
        ),
    ),
    (
        "Output and logging",
        (
            "output_dir",
            "run_name",
            "project",
            "report_to",
            "logging_steps",
            "save_strategy",
            "save_steps",
            "save_total_limit",
        ),
    ),
]


def instead(t: Translation, key: str) -> str:
    """What a run of the recipe does where verl's `key` was not translated."""
    if key.endswith("policy_loss.loss_mode"):
        level = t.recipe.get("importance_sampling_level", "token")
        return f"loss_type {t.recipe.get('loss_type')} with a {level}-level clipped ratio and the same epsilons"
    if key.endswith("router_replay.mode"):
        return "routing_replay false: the training forwards route the tokens themselves"
    if key in t.found.unresolved:
        return "the key is left out, as if the script did not set it"
    correction = {
        "rollout_rs": "no rollout rejection",
        "rollout_rs_threshold": "no rollout rejection",
        "rollout_rs_threshold_lower": "no rollout rejection",
        "rollout_token_veto_threshold": "no veto",
        "rollout_is_batch_normalize": "the truncated weights as they are, not rescaled",
        "loss_type": "the clipped loss against pi_rollout (verl's ppo_clip)",
        "use_policy_gradient": "the clipped loss against pi_rollout (verl's ppo_clip)",
    }
    if key.startswith("algorithm.rollout_correction.") and key.rsplit(".", 1)[1] in correction:
        return correction[key.rsplit(".", 1)[1]]
    return "dapo-trl's setting for it (see the recipe below), not verl's"


def recipe_yaml(t: Translation) -> str:
    """The recipe as commented YAML sections; every field once."""
    lines = [
        f"# dapo-trl recipe translated from the verl run {t.found.source} by `python -m dapo_trl.from_verl`.",
        "# Train:  accelerate launch --config_file <DIR>/accelerate.yaml train_dapo.py --config <DIR>/recipe.yaml",
        "# What each verl key became, and why: report.md next to this file.",
    ]
    if t.blocking:  # written with --allow-unsupported: the run differs from verl's here
        lines += ["#", "# NOT TRANSLATED (written with --allow-unsupported): this run differs from verl's run here:"]
        for entry in {entry.key: entry for entry in t.blocking}.values():
            lines.append(f"#   {entry.key} = {entry.value}: {entry.how}. Instead: {instead(t, entry.key)}")
    placed: set[str] = set()
    sections = [*RECIPE_SECTIONS, ("Other", tuple(t.recipe))]
    for title, names in sections:
        fields = {name: t.recipe[name] for name in names if name in t.recipe and name not in placed}
        if not fields:
            continue
        placed.update(fields)
        lines += ["", f"# {title}"]
        for name, value in fields.items():
            lines.append(yaml.safe_dump({name: value}, sort_keys=False, width=1000).rstrip())
    return "\n".join(lines) + "\n"


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def report_markdown(t: Translation, out_dir: Path | None) -> str:
    here = str(out_dir) if out_dir is not None else "DIR"
    counts = {status: 0 for status in (MAPPED, APPROXIMATED, UNSUPPORTED, NOT_NEEDED)}
    for entry in t.entries.values():
        counts[entry.status] += 1
    found = t.found
    lines = [
        "# verl -> dapo-trl translation report",
        "",
        f"Input: `{found.source}` ({found.kind}" + (f", command `{found.command}`" if found.command else "") + ")",
        "",
        f"{len(t.entries)} keys: {counts[MAPPED]} mapped, {counts[APPROXIMATED]} approximated, "
        f"{counts[UNSUPPORTED]} unsupported, {counts[NOT_NEEDED]} not needed (verl infrastructure). "
        f"{len(t.defaults)} verl defaults applied for keys the input does not set.",
        "",
    ]
    if t.blocking:
        lines += ["## Blocking: these change the training and cannot be translated", ""]
        lines += [f"- `{entry.key}` = `{_cell(entry.value)}`: {entry.how}" for entry in t.blocking]
        lines += [
            "",
            "The translator exits with status 1 (only this report is written) unless --allow-unsupported.",
            "",
        ]
    lines += [
        "## How to run",
        "",
        "From the dapo-trl checkout (accelerate.yaml names configs/deepspeed/*.json relative to it):",
        "",
        "```bash",
    ]
    launch = f"accelerate launch --config_file {here}/accelerate.yaml train_dapo.py --config {here}/recipe.yaml"
    if t.recipe.get("use_vllm") and t.vllm:
        lines += [f"{here}/vllm_server.sh    # = {t.vllm.script_command()}", launch + " --vllm_server_host HOST"]
    else:
        lines.append(launch)
    lines += [
        "```",
        "",
        f"Launch: {t.accelerate_rule}; {t.accelerate.get('num_machines')} machine(s), "
        f"{t.accelerate.get('num_processes')} processes. With several machines run the launch on each with "
        "`--machine_rank R --main_process_ip HOST0 --main_process_port PORT` (as run_dapo.sh does).",
        "",
    ]
    if t.vllm and t.recipe.get("use_vllm"):
        colocate = (
            "Routing replay needs vllm_server.sh's server (--enable-return-routed-experts): the colocated engine "
            "(--vllm_mode colocate) returns no routed experts."
            if t.recipe.get("routing_replay")
            else "To generate on the training GPUs instead, as verl does: "
            f"`--vllm_mode colocate --vllm_tensor_parallel_size {t.vllm.tensor_parallel_size} "
            f"--vllm_gpu_memory_utilization {t.vllm.gpu_memory_utilization:g}`."
        )
        lines += [
            f"vLLM: the same server with TRL's launcher: `{t.vllm.trl_command()}` (without the extra engine flags). "
            "verl generates on the training GPUs (one engine per tensor-parallel group, "
            f"{t.batch.world_size // max(1, t.vllm.tensor_parallel_size)} here); a server needs GPUs of its own, "
            f"and DP replicas give it that throughput. {colocate}",
            "",
        ]
    lines += [
        "## Batch and step arithmetic",
        "",
        "verl counts save_freq, test_freq, warm-up and total_training_steps in rollout steps (one per "
        "generation batch); TRL counts optimizer steps, K per rollout step.",
        "",
        "| quantity | verl | dapo-trl |",
        "|---|---|---|",
    ]
    lines += [f"| {_cell(a)} | {_cell(b)} | {_cell(c)} |" for a, b, c in t.step_rows]
    lines.append("")
    sections = [
        (UNSUPPORTED, "Unsupported", "why"),
        (APPROXIMATED, "Approximated", "how"),
        (MAPPED, "Mapped", "how"),
        (NOT_NEEDED, "Not needed (nothing to translate)", "why"),
    ]
    for status, title, column in sections:
        entries = [entry for entry in t.entries.values() if entry.status == status]
        if not entries:
            continue
        lines += [f"## {title}", "", f"| key | value | becomes | {column} |", "|---|---|---|---|"]
        for entry in entries:
            flag = " **(blocking)**" if entry.blocking else ""
            lines.append(
                f"| `{_cell(entry.key)}` | `{_cell(entry.value)}` | {_cell(entry.target)} | {_cell(entry.how)}{flag} |"
            )
        lines.append("")
    if t.defaults:
        lines += [
            "## verl defaults applied (keys the input does not set)",
            "",
            "| key | verl default | becomes | how |",
            "|---|---|---|---|",
        ]
        for entry in t.defaults:
            flag = " **(blocking)**" if entry.blocking else ""
            lines.append(
                f"| `{entry.key}` | `{_cell(entry.value)}` | {_cell(entry.target)} | {_cell(entry.how)}{flag} |"
            )
        lines.append("")
    if t.notes:
        lines += ["## Notes", ""] + [f"- {note}" for note in t.notes] + [""]
    return "\n".join(lines) + "\n"


def vllm_script(t: Translation) -> str:
    environment = " ".join(f"{name}={shlex.quote(value)}" for name, value in t.vllm.environment().items())
    extra = " ".join(shlex.quote(arg) for arg in t.vllm.extra_args)
    return (
        "#!/usr/bin/env bash\n"
        f"# vLLM server for the recipe translated from {t.found.source}; run it from the dapo-trl checkout.\n"
        "# Then train with --vllm_server_host THIS_HOST (see report.md). Extra arguments go to vllm serve.\n"
        "set -euo pipefail\n"
        f'exec env {environment} scripts/start_vllm_server.sh {extra + " " if extra else ""}"$@"\n'
    )


def write_outputs(t: Translation, out_dir: Path, *, report_only: bool = False) -> list[Path]:
    """Write report.md, and unless `report_only` the recipe, accelerate config, vLLM script and extra files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [out_dir / "report.md"]
    written[0].write_text(report_markdown(t, out_dir), encoding="utf-8")
    if report_only:  # no recipe: remove one a previous translation left here, so none is used by mistake
        for name in ("recipe.yaml", "accelerate.yaml", "vllm_server.sh"):
            (out_dir / name).unlink(missing_ok=True)
        return written
    recipe = dict(t.recipe)
    for name, content in t.files.items():
        target = out_dir / name
        if isinstance(content, Path):
            shutil.copyfile(content, target)
        else:
            target.write_text(content, encoding="utf-8")
        written.append(target)
        for key in ("tool_config", "chat_template"):
            if recipe.get(key) == name:
                recipe[key] = str(target.resolve())  # the recipe may be used from another folder
    t.recipe = recipe
    (out_dir / "recipe.yaml").write_text(recipe_yaml(t), encoding="utf-8")
    header = (
        f"# accelerate launch --config_file {out_dir / 'accelerate.yaml'} train_dapo.py --config "
        f"{out_dir / 'recipe.yaml'}\n# {t.accelerate_rule}. Run from the dapo-trl checkout.\n"
    )
    (out_dir / "accelerate.yaml").write_text(header + yaml.safe_dump(t.accelerate, sort_keys=False), "utf-8")
    script = out_dir / "vllm_server.sh"
    script.write_text(vllm_script(t), encoding="utf-8")
    script.chmod(0o755)
    written += [out_dir / "recipe.yaml", out_dir / "accelerate.yaml", script]
    return written
