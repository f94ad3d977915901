"""The reward: DAPO's overlong penalty, the reward function, and dynamic sampling (verl's filter_groups)."""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from ..rewards.verl_default import NOT_HERE, scorer_name
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

SCORER_DESCRIPTIONS = {
    "gsm8k": "GSM8K's '#### N' scorer (1 / 0)",
    "math_reward": "Hendrycks' MATH scorer on the last \\boxed{} (1 / 0)",
    "math_dapo": "DAPO's 'Answer:' scorer (+1 / -1)",
    "sandbox_fusion": "verl's SandboxFusion code scorer (pass rate of the first 10 test cases)",
}


def map_dynamic_sampling(t: Translation) -> None:
    enabled = as_boolean(t.value("algorithm.filter_groups.enable"))
    t.set(filter_groups_enable=enabled)
    t.record(
        "algorithm.filter_groups.enable",
        MAPPED,
        recipe_line("filter_groups_enable", enabled),
        "dynamic sampling"
        + ("" if t.given("algorithm.filter_groups.enable") else " (verl's default is off, dapo-trl's on)"),
    )
    gen_key = "data.gen_batch_size"
    oversample = t.batch.filter_groups_oversample
    if not enabled:
        for key in ("algorithm.filter_groups.metric", "algorithm.filter_groups.max_num_gen_batches"):
            t.mark(key, NOT_NEEDED, how="dynamic sampling is off")
        if t.given(gen_key) and oversample != 1:
            t.mark(
                gen_key,
                APPROXIMATED,
                "",
                "without dynamic sampling verl's DAPO trainer trains on the whole "
                "generation batch; here a rollout step is train_batch_size prompts",
            )
        else:
            t.mark(gen_key, NOT_NEEDED, how="dynamic sampling is off")
        return
    rounds = int(t.value("algorithm.filter_groups.max_num_gen_batches") or 0)
    rounds = max(rounds, 0)
    t.set(max_filter_gen_batches=rounds, filter_groups_oversample=oversample, filter_groups_on_exhausted="error")
    t.record(
        "algorithm.filter_groups.max_num_gen_batches",
        MAPPED,
        f"max_filter_gen_batches: {rounds}, filter_groups_on_exhausted: error",
        "most generation rounds per step (0 = unlimited); when they run out verl stops with an error, and so "
        "does this recipe (filter_groups_on_exhausted: fill trains on what was kept instead)",
    )
    metric = t.value("algorithm.filter_groups.metric")
    if metric == "acc":
        t.mark(
            "algorithm.filter_groups.metric",
            MAPPED,
            "accuracy_reward_name: (first reward)",
            "groups are kept when the accuracy reward has a spread",
        )
    else:
        t.record(
            "algorithm.filter_groups.metric",
            APPROXIMATED,
            "accuracy_reward_name: (first reward)",
            f"verl filters on {metric!r}; dapo-trl filters on the first reward function's raw value (before "
            "the overlong penalty)",
        )
    if t.given(gen_key):
        status = APPROXIMATED if any("gen_batch_size" in note for note in t.batch.notes) else MAPPED
        t.mark(
            gen_key,
            status,
            recipe_line("filter_groups_oversample", oversample),
            f"each dynamic-sampling round generates gen_batch_size / train_batch_size = {oversample} generation "
            "batches of prompts",
        )
        t.step_rows.append(
            (
                "prompts per dynamic-sampling round",
                f"gen_batch_size = {t.value(gen_key)}",
                f"filter_groups_oversample x train_batch_size = {oversample} x {t.batch.train_batch_size}",
            )
        )


# Where verl scripts set DAPO's overlong buffer: the recipe's reward_model.overlong_buffer, main_ppo's
# reward_model.reward_kwargs (passed to the DAPO reward manager, often with hydra's +), the newer reward.reward_kwargs.
OVERLONG_BUFFER = (
    "reward_model.overlong_buffer.",
    "reward_model.reward_kwargs.overlong_buffer_cfg.",
    "reward.reward_kwargs.overlong_buffer_cfg.",
)


def map_reward(t: Translation) -> None:
    enable_key, enable = t.first(*(prefix + "enable" for prefix in OVERLONG_BUFFER))
    length_key, length = t.first(*(prefix + "len" for prefix in OVERLONG_BUFFER))
    factor_key, factor = t.first(*(prefix + "penalty_factor" for prefix in OVERLONG_BUFFER))
    if as_boolean(enable):
        t.set(apply_overlong_penalty=True, overlong_buffer_len=int(length), overlong_penalty_factor=float(factor))
        t.mark(enable_key, MAPPED, "apply_overlong_penalty: true", "DAPO's soft overlong punishment (Eq. 13)")
        t.mark(length_key, MAPPED, recipe_line("overlong_buffer_len", length), "L_cache")
        t.mark(factor_key, MAPPED, recipe_line("overlong_penalty_factor", factor), "penalty scale")
    else:
        t.set(apply_overlong_penalty=False)
        t.record(
            enable_key,
            MAPPED,
            "apply_overlong_penalty: false",
            "no overlong penalty (verl's default; dapo-trl's default is on)",
        )
        for key in (length_key, factor_key):
            t.mark(key, NOT_NEEDED, how="the overlong penalty is off")
    for prefix in OVERLONG_BUFFER:
        t.mark(prefix + "log", NOT_NEEDED, how="the penalty is always logged (rewards/overlong_penalty/*)")
    for key in ("reward.reward_kwargs.max_resp_len", "reward_model.reward_kwargs.max_resp_len"):
        t.mark(key, NOT_NEEDED, how="L_max is max_completion_length")
    for key in ("reward_model.reward_manager", "reward.reward_manager.name"):
        t.mark(key, NOT_NEEDED, how="verl's reward manager; the DAPO manager's overlong penalty is mapped above")
    if as_boolean(t.value("reward_model.enable")):
        t.mark(
            "reward_model.enable",
            UNSUPPORTED,
            "",
            "model-based rewards are not translated: pass the reward as --reward_funcs",
            blocking=True,
        )

    path, name = t.value("custom_reward_function.path"), t.value("custom_reward_function.name")
    if path and str(path).endswith("retool/retool.py") and name == "compute_score":
        t.set(reward_funcs=["retool"])
        how = (
            "ReTool's compute_score (DAPO's strict-box scorer with the tool-turn rule for wrong answers) is "
            "dapo-trl's retool reward; it scores the model's own text only, verl's the whole response including "
            "tool output"
        )
        t.mark("custom_reward_function.path", APPROXIMATED, "reward_funcs: [retool]", how)
        t.mark("custom_reward_function.name", APPROXIMATED, "reward_funcs: [retool]", how)
    elif path:
        reference = f"{path}:{name}"
        t.set(reward_funcs=[reference])
        how = (
            "imported by train_dapo.py from that file (relative to where it runs) and called once per response "
            "with verl's arguments; if the file imports verl, verl must be installed"
        )
        t.mark("custom_reward_function.path", MAPPED, recipe_line("reward_funcs", [reference]), how)
        t.mark("custom_reward_function.name", MAPPED, recipe_line("reward_funcs", [reference]), how)
    else:
        map_default_reward(t)
    t.mark_all("custom_reward_function.reward_kwargs.*", UNSUPPORTED, "", "extra reward arguments are not passed")


def data_sources(path: Any) -> dict[str, int] | None:
    """Rows per `data_source` in one of verl's data files, or None when the file is not here to read."""
    text = os.path.expanduser(str(path))
    if "://" in text or not os.path.isfile(text):
        return None
    from ..data import LOCAL_FORMATS  # loads `datasets`: only when a data file is here to read

    try:
        kind = LOCAL_FORMATS.get(os.path.splitext(text)[1].lower())  # what --dataset_name reads, by extension
        if kind is None:
            return None
        if kind == "parquet":  # the one column only: a training set's parquet can be large
            import pyarrow.parquet as pq

            table = pq.read_table(text, columns=["data_source"])
        else:
            from datasets import load_dataset

            table = load_dataset(kind, data_files=text, split="train").select_columns(["data_source"]).data.table
    except Exception:  # noqa: BLE001 - no data_source column, or a file the loaders cannot read: the report says so
        return {}
    return dict(Counter(str(source) for source in table.column("data_source").to_pylist()))


def map_default_reward(t: Translation) -> None:
    """No custom reward: verl scores each row by its data_source (default_compute_score); so does verl_default.

    The report names the scorer each data source in the run's files gets; a source without a scorer here blocks
    the translation (the run would stop at construction).
    """
    url = t.value("reward_model.sandbox_fusion.url")
    if url:
        t.set(sandbox_url=str(url))
        t.mark("reward_model.sandbox_fusion.url", MAPPED, recipe_line("sandbox_url", url), "code sources are run there")
    for key, default in (("max_concurrent", 64), ("memory_limit_mb", 1024)):
        name = f"reward_model.sandbox_fusion.{key}"
        if t.value(name) is not None and int(t.value(name)) != default:
            t.mark(name, APPROXIMATED, "", f"the code scorer uses verl's default, {default}")
        else:
            t.mark(name, MAPPED, "", f"verl's default, {default}, as the code scorer uses")
    unsupported: dict[str, str] = {}
    for key in ("data.train_files", "data.val_files"):
        for file in as_list(t.value(key)):
            counts = data_sources(file)
            if counts is None:
                t.notes.append(
                    f"reward: {file} is not here to read, so its data sources are not known; verl_default scores "
                    "openai/gsm8k, the MATH sets, math_dapo / math / aime* and stops on any other source"
                )
                continue
            if not counts:
                t.notes.append(f"reward: {file} has no data_source column; verl_default needs one")
                unsupported[str(file)] = "no data_source column"
            for source, rows in sorted(counts.items()):
                scorer = scorer_name(source, sandbox=bool(url))
                if scorer is None:
                    verl_scorer = f"verl's {NOT_HERE[source]}" if source in NOT_HERE else "no scorer in verl either"
                    unsupported[source] = verl_scorer
                    t.notes.append(
                        f"reward: data_source {source!r} ({rows} rows of {file}): NO scorer here ({verl_scorer})"
                    )
                else:
                    t.notes.append(
                        f"reward: data_source {source!r} ({rows} rows of {file}): {SCORER_DESCRIPTIONS[scorer]}"
                    )
    t.set(reward_funcs=["verl_default"])
    how = (
        "verl's default_compute_score: the scorer is picked per row by its data_source column, as verl does "
        "(openai/gsm8k: '#### N'; the MATH sets: Hendrycks' boxed answer; math_dapo / math / aime*: DAPO's "
        "'Answer:' line; the report's notes say which data source of the run's files gets which)"
    )
    if unsupported:
        how = (
            "verl_default has no scorer for "
            + ", ".join(f"{source!r} ({why})" for source, why in unsupported.items())
            + ": pass --reward_funcs your_file.py:compute_score (verl's signature), or "
            "verl.utils.reward_score:default_compute_score with verl installed"
        )
    status = UNSUPPORTED if unsupported else MAPPED
    t.record("custom_reward_function.path", status, "reward_funcs: [verl_default]", how, blocking=bool(unsupported))
    t.mark("custom_reward_function.name", NOT_NEEDED, how="no custom reward file")
