"""Per-step metrics of the rows a streamed step decided on, whatever was scored when.

TRL logs `reward`, `rewards/*`, `completions/*` once per scoring pass and averages the passes at log time. A
streamed step scores in waves whose sizes depend on timing, and without carried surplus it stops at the first wave
that fills the batch, so those figures would change from run to run with the same trained batches. Here they are
computed once per step over a set of rows that timing cannot change: the groups in stream order up to the one that
filled the batch (with carried surplus, whole rounds: they are always scored whole). Formulas are TRL 1.16's
(`GRPOTrainer._generate_and_score_completions` and `_generate`, lengths in model tokens), over those rows;
`frac_reward_zero_std` is the share of groups without spread, as TRL logs it under per-group scaling (DAPO's).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from trl.trainer.utils import nanstd  # TRL's own: Bessel-corrected, NaN-ignoring

from .. import trl_seam

# TRL's per-pass metrics that `trained_batch_metrics` replaces (`rewards/<name>/mean|std` too).
REPLACED = (
    "reward",
    "reward_std",
    "frac_reward_zero_std",
    "completions/mean_length",
    "completions/min_length",
    "completions/max_length",
    "completions/clipped_ratio",
    "completions/mean_terminated_length",
    "completions/min_terminated_length",
    "completions/max_terminated_length",
)


def replaced(name: str) -> bool:
    return name in REPLACED or name.startswith("rewards/")


@contextlib.contextmanager
def per_pass_figures_dropped(pending: dict[str, list], which: Callable[[str], bool] = replaced) -> Iterator[None]:
    """TRL's per-pass figures (`which` names) that the block (a streamed wave's scoring pass) appends to `pending`
    (TRL's metrics) are dropped at its end: the step's own come from the rows it decided on (`trained_batch_metrics`),
    or from the training forwards (`which=old_logprobs.measured_in_training`)."""
    before = {name: len(values) for name, values in pending.items() if which(name)}
    yield
    for name, values in pending.items():
        if which(name):
            del values[before.get(name, 0) :]


def row_statistics(rewards_per_func: torch.Tensor, lengths: torch.Tensor, truncated: torch.Tensor) -> dict:
    """What the step's metrics need of each row (global rows, every process the same), kept on the CPU.

    Args:
        rewards_per_func: (rows, funcs) as TRL weighted them (NaN where a function did not apply).
        lengths: (rows,) completion lengths in tokens; truncated: (rows,) bool, no EOS at the end.
    """
    return {
        "rewards_per_func": rewards_per_func.detach().float().cpu(),
        "lengths": lengths.detach().float().cpu(),
        "truncated": truncated.detach().bool().cpu(),
    }


def decided_groups(group_kept: torch.Tensor, group_size: int, kept_rows: int, target_rows: int) -> int:
    """How many leading groups of a scored part are decided before the batch is full (`kept_rows` of `target_rows`
    kept before it): the ones a run with any other timing also scores for this batch."""
    decided = 0
    for kept in group_kept.tolist():
        if kept_rows >= target_rows:
            break
        decided += 1
        kept_rows += group_size * int(kept)
    return decided


def trained_batch_metrics(
    parts: list[dict], weights: torch.Tensor, names: list[str], group_size: int
) -> dict[str, float]:
    """TRL's reward and completion metrics over the rows of `parts` (`row_statistics`, stream order)."""
    if not parts:
        return {}
    rewards_per_func = torch.cat([part["rewards_per_func"] for part in parts])
    lengths = torch.cat([part["lengths"] for part in parts])
    truncated = torch.cat([part["truncated"] for part in parts])
    metrics: dict[str, float] = {}
    for column, name in enumerate(names[: rewards_per_func.size(1)]):
        metrics[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, column]).item()
        metrics[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, column]).item()
    rewards = (rewards_per_func * weights.float().cpu().unsqueeze(0)).nansum(dim=1)
    rewards[torch.isnan(rewards_per_func).all(dim=1)] = torch.nan  # unscorable rows: left out, as TRL does
    spread = nanstd(rewards.view(-1, group_size), dim=1) if group_size > 1 else None
    metrics["reward"] = torch.nanmean(rewards).item()
    metrics["reward_std"] = nanstd(rewards).item()
    no_spread = torch.ones(1) if spread is None else torch.isclose(spread, torch.zeros_like(spread)).float()
    metrics["frac_reward_zero_std"] = no_spread.mean().item()  # the share of groups (TRL's per-group scaling)
    metrics["completions/mean_length"] = lengths.mean().item()
    metrics["completions/min_length"] = lengths.min().item()
    metrics["completions/max_length"] = lengths.max().item()
    metrics["completions/clipped_ratio"] = truncated.float().mean().item()
    terminated = lengths[~truncated] if (~truncated).any() else torch.zeros(1)
    metrics["completions/mean_terminated_length"] = terminated.mean().item()
    metrics["completions/min_terminated_length"] = terminated.min().item()
    metrics["completions/max_terminated_length"] = terminated.max().item()
    return metrics


class DecidedGroups:
    """The groups a streamed step decided on before its batch filled, and the step's metrics over them: all the
    groups its waves scored with carried surplus (whose rounds are always scored whole), else those up to the one
    that filled the batch (`decided_groups`). Every other group of the step's rounds counts as cancelled."""

    def __init__(self, group_size: int, carry_surplus: bool):
        self.group_size, self.carry_surplus = group_size, carry_surplus
        self.planned = self.generated = self.kept = 0  # groups of the step's rounds; decided; decided and kept
        self._rows: list[dict[str, Any]] = []  # the decided groups' `row_stats`

    def record(self, row_stats: dict | None, group_kept: list[bool], kept_rows: int, target_rows: int) -> int:
        """Count the wave's decided groups and keep their rows' figures; how many of its leading groups are decided.
        `group_kept` are the sampler's keep decisions of the wave, `kept_rows` what the batch held before it."""
        size, kept = self.group_size, torch.tensor(group_kept, dtype=torch.bool)
        decided = len(kept) if self.carry_surplus else decided_groups(kept, size, kept_rows, target_rows)
        self.generated += decided
        self.kept += int(kept[:decided].sum())
        if row_stats is not None and decided:
            rows = {key: row_stats[key][: decided * size] for key in ("rewards_per_func", "lengths", "truncated")}
            self._rows.append({**rows, "names": row_stats["names"], "weights": row_stats["weights"]})
        return decided

    @property
    def keep_rate(self) -> float:
        """Kept over decided groups (0 before any)."""
        return self.kept / max(self.generated, 1)

    def metrics(self) -> dict[str, float]:
        """The step's reward and completion metrics (`trained_batch_metrics`) and keep counts over the decided
        groups."""
        metrics = {}
        if self._rows:
            last = self._rows[-1]
            metrics = trained_batch_metrics(self._rows, last["weights"], last["names"], self.group_size)
        metrics["dynamic_sampling/groups_cancelled"] = float(self.planned - self.generated)
        if not self.carry_surplus:  # with carried surplus the sampler's own counts over whole rounds stand
            metrics["dynamic_sampling/groups_generated"] = float(self.generated)
            metrics["dynamic_sampling/groups_kept"] = float(self.kept)
            metrics["dynamic_sampling/keep_rate"] = self.keep_rate
            metrics["dynamic_sampling/surplus_discarded_groups"] = 0.0
        return metrics


def streamed_row_statistics(trainer: Any, rewards_per_func: torch.Tensor, completion_ids_list: list, output: Any):
    """A streamed wave's per-row figures for the step's metrics (`row_statistics`), every process's: lengths as TRL
    counts them (tool results left out, from the generation `output`'s tool mask), truncation, reward columns."""
    from accelerate.utils import gather

    device = rewards_per_func.device
    ends = {*trainer.eos_token_ids, trl_seam.tokenizer(trainer).pad_token_id}
    tool_mask = None if output is None else output.tool_mask
    model_tokens = [sum(mask) for mask in tool_mask] if tool_mask else [len(ids) for ids in completion_ids_list]
    lengths = torch.tensor(model_tokens, device=device)
    truncated = torch.tensor([not ids or ids[-1] not in ends for ids in completion_ids_list], device=device)
    stats = row_statistics(rewards_per_func, gather(lengths), gather(truncated))
    return {**stats, "names": list(trainer.reward_func_names), "weights": trainer.reward_weights.detach().cpu()}
