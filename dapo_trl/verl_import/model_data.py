"""The model (weights, dtype, LoRA, chat template) and the data (files, prompt column, overlong prompts, seed)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from .moe import ROUTER_AUX_LOSS_KEYS
from .translation import (
    APPROXIMATED,
    MAPPED,
    NOT_NEEDED,
    UNSUPPORTED,
    Translation,
    as_boolean,
    as_list,
    recipe_line,
)

RETOOL_ANSWER_FORMAT = "\nThe answer format must be: \\boxed{'The final answer goes here.'}"


def model_size_billions(path: str | None) -> float | None:
    """Parameter count in billions read from a model path's names (`Qwen2.5-32B` -> 32, `...-1.5b-...` -> 1.5)."""
    if not path:
        return None
    sizes = [
        float(number) / (1000.0 if unit.lower() == "m" else 1.0)
        for number, unit in re.findall(r"(?<![A-Za-z0-9.])(\d+(?:\.\d+)?)([bBmM])(?![A-Za-z0-9])", str(path))
    ]
    return max(sizes) if sizes else None


def map_model(t: Translation) -> None:
    key = "actor_rollout_ref.model.path"
    path = t.value(key)
    if path:
        t.set(model_name_or_path=str(path))
        t.mark(key, MAPPED, recipe_line("model_name_or_path", path), "the policy's initial weights")
    else:
        t.notes.append("no actor_rollout_ref.model.path: pass --model_name_or_path")
    t.set(dtype="float32")
    master = str(t.value("actor_rollout_ref.actor.fsdp_config.model_dtype") or "fp32")
    t.mark(
        "actor_rollout_ref.actor.fsdp_config.model_dtype",
        MAPPED if master in ("fp32", "float32") else APPROXIMATED,
        recipe_line("dtype", "float32"),
        "verl keeps fp32 master weights and computes in bf16: weights loaded in float32, accelerate's "
        "mixed_precision bf16",
    )
    map_lora(t)
    template = t.value("actor_rollout_ref.model.custom_chat_template")
    if template:
        t.files["chat_template.jinja"] = str(template)
        t.set(chat_template="chat_template.jinja")
        t.mark(
            "actor_rollout_ref.model.custom_chat_template",
            MAPPED,
            "chat_template: <DIR>/chat_template.jinja",
            "written next to the recipe",
        )
    if t.value("actor_rollout_ref.model.tokenizer_path"):
        t.mark("actor_rollout_ref.model.tokenizer_path", UNSUPPORTED, how="the tokenizer is loaded from the model path")
    map_config_overrides(t, str(path or "MODEL"))


def map_config_overrides(t: Translation, model: str) -> None:
    """verl's `model.override_config.X=V` changes the model config at load (GMPO's script calls its
    max_position_embeddings "very important"): here the model folder must already say so, a step the user takes."""
    prefix = "actor_rollout_ref.model.override_config."
    overrides = {
        key[len(prefix) :]: value
        for key, value in t.found.values.items()
        if key.startswith(prefix) and key not in ROUTER_AUX_LOSS_KEYS  # the router's loss weight: `moe`
    }
    if not overrides:
        return
    changes = json.dumps(overrides)
    step = (
        f"copy the model folder of {model} (a local snapshot) to PREPARED_MODEL, set {changes} in its config.json "
        "(python -c \"import json; p = 'PREPARED_MODEL/config.json'; c = json.load(open(p)); "
        f"c.update({overrides!r}); json.dump(c, open(p, 'w'), indent=2)\"), and pass --model_name_or_path "
        "PREPARED_MODEL"
    )
    for name in overrides:
        t.mark(prefix + name, UNSUPPORTED, "", f"a model config change verl makes at load; before training, {step}")
    t.notes.append(f"verl overrides the model config at load ({', '.join(overrides)}): before training, {step}")


def map_lora(t: Translation) -> None:
    """verl's FSDP LoRA (`model.lora_rank` > 0): PEFT's LoraConfig as verl builds it (rank, alpha, target and excluded
    modules, no dropout, no bias), through TRL's ModelConfig flags and dapo-trl's --lora_exclude_modules."""
    rank = int(t.value("actor_rollout_ref.model.lora_rank") or 0)
    adapter_path = t.value("actor_rollout_ref.model.lora_adapter_path")
    if adapter_path:  # verl trains LoRA whenever an adapter path is given, whatever lora_rank says
        t.mark(
            "actor_rollout_ref.model.lora_adapter_path",
            UNSUPPORTED,
            how="train_dapo.py starts a new adapter: to continue a saved one, load it with "
            "peft.PeftModel.from_pretrained(model, path, is_trainable=True) and pass that model to DAPOTrainer",
            blocking=True,
        )
    if rank <= 0:
        for name in ("lora_rank", "lora_alpha", "target_modules", "exclude_modules", "lora_adapter_path"):
            t.mark(f"actor_rollout_ref.model.{name}", NOT_NEEDED, how="LoRA is off (lora_rank 0)")
        return
    alpha = t.value("actor_rollout_ref.model.lora_alpha")
    modules = t.value("actor_rollout_ref.model.target_modules")
    modules = [modules] if isinstance(modules, str) else list(modules)
    # verl's LoraConfig sets no dropout (PEFT's default, 0.0); TRL's ModelConfig defaults to 0.05.
    t.set(use_peft=True, lora_r=rank, lora_alpha=int(alpha), lora_target_modules=modules, lora_dropout=0.0)
    t.mark(
        "actor_rollout_ref.model.lora_rank",
        MAPPED,
        f"use_peft: true, lora_r: {rank}, lora_dropout: 0.0",
        "LoRA through PEFT, as verl builds it (no dropout, bias none); the reference of the KL loss and of KL in the "
        "reward is the base model with the adapter off, as verl's (its ref log-probs run on the actor with "
        "disable_adapter()); vLLM gets the base with the adapter merged at every sync",
    )
    t.record("actor_rollout_ref.model.lora_alpha", MAPPED, recipe_line("lora_alpha", alpha), "LoRA's scaling alpha")
    t.record(
        "actor_rollout_ref.model.target_modules",
        MAPPED,
        recipe_line("lora_target_modules", modules),
        "PEFT's 'all-linear' is every linear layer but the output head (verl's default)",
    )
    excluded = t.value("actor_rollout_ref.model.exclude_modules")
    if excluded:
        if isinstance(excluded, str):
            excluded = [excluded]
        elif len(excluded) == 1:  # PEFT matches a list's names as suffixes; one flag value would be a regex
            excluded = [rf"(.*\.)?{re.escape(str(excluded[0]))}"]
        else:
            excluded = list(excluded)
        t.set(lora_exclude_modules=excluded)
        t.mark(
            "actor_rollout_ref.model.exclude_modules",
            MAPPED,
            recipe_line("lora_exclude_modules", excluded),
            "dapo-trl's flag for PEFT's LoraConfig.exclude_modules (TRL's ModelConfig has none); one value is a "
            "regular expression, as verl passes its string",
        )
    t.mark("actor_rollout_ref.model.exclude_modules", NOT_NEEDED, how="no module excluded")
    t.mark("actor_rollout_ref.model.lora_adapter_path", NOT_NEEDED, how="a new adapter")
    lr = t.value("actor_rollout_ref.actor.optim.lr")
    t.notes.append(
        f"LoRA: learning_rate is verl's actor.optim.lr ({lr}) unchanged. verl applies it as is to the adapter (no "
        "LoRA-specific scaling of its own); its LoRA guide (docs/advance/ppo_lora.rst) recommends about 10x the "
        "full-parameter rate, which is why its LoRA examples set a larger optim.lr themselves (e.g. 3e-6 for "
        "Qwen2.5-3B on GSM8K, against verl's default 1e-6)."
    )


def dataset_name_for(path: Any) -> tuple[str, str, str]:
    """(--dataset_name value, status, how) for one of verl's data files."""
    text = os.path.expanduser(str(path))
    if "://" in text:
        return text, UNSUPPORTED, "remote file systems are not read: copy the file locally"
    from ..data import _PRESET_BY_HUB_ID

    name = Path(text).name
    stem = name.rsplit(".", 1)[0] if Path(text).suffix else name
    if stem.lower().replace("_", "-") == "dapo-math-17k":
        return f"dapo-math-17k:{text}", MAPPED, "a local copy of DAPO-Math-17k: the dapo-math-17k preset's columns"
    hub_id = "/".join(Path(text).parts[-2:]).lower()
    if hub_id in _PRESET_BY_HUB_ID:
        preset = _PRESET_BY_HUB_ID[hub_id]
        return f"{preset}:{text}", MAPPED, f"a local copy of {hub_id}: the {preset} preset's columns"
    return text, MAPPED, "read as a local file (prompt and reward_model.ground_truth columns detected)"


def map_data(t: Translation) -> None:
    train = as_list(t.value("data.train_files"))
    if len(train) == 1:
        name, status, how = dataset_name_for(train[0])
        t.set(dataset_name=name)
        t.mark("data.train_files", status, recipe_line("dataset_name", name), how, blocking=status == UNSUPPORTED)
    elif len(train) > 1:
        t.mark(
            "data.train_files",
            UNSUPPORTED,
            "",
            "several training files: --dataset_name takes one; concatenate them into one parquet file",
            blocking=True,
        )
    else:
        t.notes.append("no data.train_files: pass --dataset_name")
    validation = as_list(t.value("data.val_files"))
    eval_names = []
    for file in validation:
        name, status, how = dataset_name_for(file)
        eval_names.append(name)
        if status == UNSUPPORTED:
            t.mark("data.val_files", UNSUPPORTED, "", how)
    if eval_names:
        t.set(eval_dataset_name=eval_names)
        t.mark(
            "data.val_files", MAPPED, recipe_line("eval_dataset_name", eval_names), "validation sets (avg@n, pass@k)"
        )
    prompt_key = t.value("data.prompt_key")
    if prompt_key != "prompt":
        t.set(prompt_column=str(prompt_key))
    t.mark(
        "data.prompt_key",
        MAPPED,
        recipe_line("prompt_column", prompt_key) if prompt_key != "prompt" else "prompt_column: auto (prompt)",
        "column holding the prompt",
    )

    # Overlong prompts: verl filters them (filter_overlong_prompts), else applies `truncation` at load time.
    filter_prompts = as_boolean(t.value("data.filter_overlong_prompts"))
    truncation = str(t.value("data.truncation"))
    if filter_prompts:
        t.set(overlong_prompt_policy="filter")
        t.record(
            "data.filter_overlong_prompts",
            MAPPED,
            "overlong_prompt_policy: filter",
            "prompts longer than max_prompt_length are dropped (and counted)",
        )
        t.mark("data.truncation", NOT_NEEDED, how="overlong prompts are filtered before truncation could apply")
    elif truncation == "error":
        t.set(overlong_prompt_policy="error")
        t.record("data.truncation", MAPPED, "overlong_prompt_policy: error", "an overlong prompt stops the run")
        t.mark("data.filter_overlong_prompts", MAPPED, "overlong_prompt_policy: error", "no filtering")
    else:
        t.set(overlong_prompt_policy="filter")
        t.mark(
            "data.truncation",
            APPROXIMATED,
            "overlong_prompt_policy: filter",
            f"verl cuts overlong prompts ({truncation}); dapo-trl never truncates a prompt and drops them "
            "instead (counted in the log)",
        )
        t.mark("data.filter_overlong_prompts", APPROXIMATED, "overlong_prompt_policy: filter", "see data.truncation")

    custom_path, custom_name = t.value("data.custom_cls.path"), t.value("data.custom_cls.name")
    if custom_path:
        if str(custom_path).endswith("retool/retool.py") and custom_name == "CustomRLHFDataset":
            t.set(prompt_template="{problem}" + RETOOL_ANSWER_FORMAT)
            how = (
                "ReTool's dataset class appends its \\boxed{} instruction to every problem: here the prompt "
                "template appends it to text problems (the AIME sets); chat-message prompts (DAPO-Math-17k) "
                "keep their own instruction (DAPO's 'Answer:' line), so the ReTool reward, which reads \\boxed{}, "
                "relies on the SFT model boxing its answers as it was taught"
            )
            t.mark("data.custom_cls.path", APPROXIMATED, "prompt_template: '{problem}' + ReTool's boxed format", how)
            t.mark("data.custom_cls.name", APPROXIMATED, "see data.custom_cls.path", "ReTool's CustomRLHFDataset")
        else:
            how = "custom dataset classes do not run here: prepare the data as a parquet file with a prompt column"
            t.mark("data.custom_cls.path", UNSUPPORTED, "", how, blocking=True)
            t.mark("data.custom_cls.name", UNSUPPORTED, "", how, blocking=True)
    for limit in ("data.train_max_samples", "data.val_max_samples"):
        value = t.value(limit)
        if value is not None and int(value) > 0:
            t.mark(limit, UNSUPPORTED, "", "no row limit here: cut the data file to the rows you want")
        else:
            t.mark(limit, NOT_NEEDED, how="-1: every row")
    if t.given("data.seed") and t.value("data.seed") is not None:
        t.set(seed=int(t.value("data.seed")))
        t.mark(
            "data.seed",
            APPROXIMATED,
            recipe_line("seed", t.value("data.seed")),
            "the Trainer's one seed: data order, and also sampling and initialisation",
        )
    else:
        t.mark("data.seed", NOT_NEEDED, how="unset")
