"""What one dynamic-sampling round (or streamed wave) hands between DAPOTrainer's overrides while TRL scores it.

TRL's `_generate_and_score_completions` calls back into the trainer (`_generate_single_turn`, `_calculate_rewards`)
with no room for the round's own inputs and outputs; the trainer keeps one `RoundScoring` for the round being scored
instead of a field per item.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import trl_seam
from ..step.replayed_routing import record_replay_metrics
from .dynamic_sampling import check_regroupable


@dataclass
class RoundScoring:
    """One round's hand-offs: what goes into TRL's scoring, and what comes out of it."""

    prepared: dict[str, list] | None = None  # a streamed wave's sampled completions: TRL's first turn returns them
    next_turns: Callable[[list[list[int]]], Any] | None = None  # colocated streaming: a tool loop's next turns
    streamed: bool = False  # a streamed wave: its rows' statistics are kept for the trained-batch metrics
    rewards_per_func: torch.Tensor | None = None  # TRL's gathered rewards, (rows, funcs), shaping columns included
    row_stats: dict[str, Any] | None = None  # `batch_metrics.row_statistics` of a streamed wave
    routed_experts: list[Any] | None = None  # a streamed wave's engine routings, per local row (routing replay)
    engine_logprobs: list[list[float]] | None = None  # a streamed wave's sampled tokens' engine log-probs
    engine_versions: list[Any] | None = None  # a streamed wave's weights version of each sampled token, per row

    @classmethod
    def of_wave(cls, prepared: dict[str, list], next_turns: Callable[[list[list[int]]], Any] | None) -> RoundScoring:
        """A streamed wave's hand-offs: its sampled completions for TRL's first turn, and what the engine sent
        beside them (routings, log-probs, each token's weights version)."""
        scoring = cls(prepared, next_turns, streamed=True, routed_experts=prepared.pop("routed_experts", None))
        scoring.engine_logprobs, scoring.engine_versions = prepared["logprobs"], prepared.pop("versions", None)
        return scoring

    def sampled_turn(self, prompt_ids: list[list[int]]) -> tuple[list, list] | None:
        """A turn TRL's generation need not sample: a streamed wave's first turn (the engine sampled it), or with
        colocated streaming a tool loop's later turns (sampled on the engine's thread); None otherwise."""
        prepared = self.take_prepared()
        if prepared is not None:
            if len(prepared["completion_ids"]) != len(prompt_ids):
                raise RuntimeError(
                    f"streaming rollout prepared {len(prepared['completion_ids'])} completions for "
                    f"{len(prompt_ids)} prompts"
                )
            return prepared["completion_ids"], prepared["logprobs"]
        return None if self.next_turns is None else self.next_turns(prompt_ids)

    def take_prepared(self) -> dict[str, list] | None:
        """The prepared completions, once: a tool loop's later turns are sampled afresh."""
        prepared, self.prepared = self.prepared, None
        return prepared


def complete_round_rows(trainer: Any, output: dict[str, Any], scoring: RoundScoring, replayed: Any) -> None:
    """What a scored round's rows need beyond TRL's scoring: the behaviour policy's log-probs when carried surplus
    may train them a step later, with routing replay their routing and its metrics (from the trainer's forward), and
    last pi_old from the engine where `old_logprobs_source` says so."""
    if replayed is not None:
        output.update(replayed.shelve(output))
    check_regroupable(output)  # before any forward of the rows
    from_trainer = trainer.args.old_logprobs_source == "trainer"  # else pi_old is the engine's (`old_logprobs`)
    if trainer.args.filter_groups_carry_surplus and from_trainer and output.get("old_per_token_logps") is None:
        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        with torch.no_grad():
            keep = output["completion_ids"].size(1)
            output["old_per_token_logps"] = trl_seam.per_token_log_probs(
                trainer, trainer.model, input_ids, attention_mask, keep
            )
    if replayed is not None:
        record_replay_metrics(trainer, output, scoring)
    trainer._old_logprobs.complete(trainer, output, scoring.engine_versions)
