"""Prompt triage: skip, before generating, the prompts whose groups will most likely be thrown away.

Dynamic sampling drops every group whose responses all agree (all right or all wrong), after paying for all of them;
at DAPO's keep rate of about one half, half of what the engine generates is never trained. GRESO (Zheng et al.,
"Act Only When It Pays", arXiv 2506.02177) observed that such prompts stay so: a prompt whose group agreed the last
times it was sampled most likely agrees again. So each prompt keeps its outcome history, and a prompt with a streak
of k zero-variance samplings in a row is skipped before generation with probability

    P(skip) = 1 - max(p_kind ** k, floor)

where kind is "easy" (its groups were all right: accuracy > 0 for every response) or "hard" (all wrong), p_kind is
the kind's exploration probability and `floor` (`prompt_triage_exploration_floor`, 0.01) keeps every prompt
reachable. A prompt without a streak (new, or whose last group had spread) is never skipped; one whose group has
spread again loses its streak. After each step p_kind moves by `P_STEP` within [`P_MIN`, `P_MAX`]: down (skip more)
while the *avoidable* zero-variance groups of the kind (prompts with a streak, generated anyway, that agreed again:
what a skip would have saved) make at least the kind's target share of the step's generated groups, up (explore
more) below it. The target is `prompt_triage_target_zero_variance` (0.25), split 1:2 between easy and hard prompts as
GRESO does (hard prompts are more likely to become solvable). GRESO steers the share of *all* zero-variance groups
instead; where prompts without a streak already exceed the target (a small model on hard data) no skip can reach
it, p falls to its bound, prompts that became solvable are skipped with the rest, and on the demo's run
(`benchmarks/prompt_triage.py`) the final accuracy fell from 0.64 to 0.40; steering by the avoidable share keeps
exploring where streaks break. It adapts only while some prompt had a streak. A skipped prompt is not lost: it is
drawn again in the next pass over the data, with its streak unchanged, and skipped again only with the same
probability.

A streak is only acted on once this run has shown that streaks like it last: for each kind and length (lengths of
`STREAK_CAP` and more pooled) the history counts how often a prompt generated with such a streak agreed again, and
a prompt is skipped only while that record, by Laplace's rule of succession ((agreed + 1) / (observed + 2)), is at
least `prompt_triage_min_agreement` (0.9). GRESO's data (Qwen2.5-Math at DAPO-Math's scale) had streaks that last;
a small model learning fast does not: on the demo's run a prompt all right once was all right again about half the
time, and one all wrong once two times in three, so GRESO's rule skipped prompts about to teach something and cost
accuracy (0.64 -> 0.56 with the avoidable share). A record that falls below the bar (the model starts solving
prompts it failed) stops the skips of its streaks until it recovers; 0 acts on every streak, as GRESO does.

Decisions are the same on every process and in a resumed run: each is a pure function of the run's seed, the step,
the prompt (its text) and the history as it stood when the step began (`begin_step` freezes it; outcomes recorded
during the step count from the next one). The history and the exploration probabilities are run state, saved with
checkpoints.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

P_INITIAL, P_MIN, P_MAX, P_STEP = 0.5, 0.05, 0.95, 0.01  # GRESO's exploration probabilities and their adaptation
EASY, HARD = "easy", "hard"
TARGET_SHARES = {EASY: 1 / 3, HARD: 2 / 3}  # of the zero-variance target, per kind (GRESO's split)
STREAK_CAP = 6  # streaks this long or longer share one agreement record


def prompt_key(prompt: Any) -> str:
    """A prompt's identity in the history: a digest of its text (or chat messages), the same on every process and
    in every run, whether it came from the dataloader or the sampler's own stream."""
    text = prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True, default=str)
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def skip_probability(streak: int, p: float, floor: float) -> float:
    """GRESO's probability of skipping a prompt with `streak` zero-variance samplings in a row."""
    if streak <= 0:
        return 0.0
    return 1.0 - max(p**streak, floor)


def trusted(agreed: int, observed: int, min_agreement: float) -> bool:
    """Whether streaks whose prompts agreed again `agreed` times out of `observed` are to be acted on: Laplace's rule
    of succession, (agreed + 1) / (observed + 2), at least `min_agreement` (a record with no observation: 1/2)."""
    return (agreed + 1) / (observed + 2) >= min_agreement


def streak_record(streak: Streak) -> tuple[str, int]:
    """The agreement record a streak belongs to: its kind and length (`STREAK_CAP` and more pooled)."""
    return streak.kind, min(streak.length, STREAK_CAP)


def uniform(seed: int, step: int, key: str, draw: str) -> float:
    """A uniform number in [0, 1) that only (seed, step, prompt, the draw that offers it) decide: every process, and a
    resumed run, draws the same."""
    digest = hashlib.sha256(f"{seed}/{step}/{key}/{draw}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


@dataclass
class Streak:
    """A prompt's zero-variance samplings in a row (at least one: a prompt without a streak has no entry), and
    whether they were all right or all wrong."""

    length: int
    kind: str


@dataclass
class PromptTriage:
    """The outcome history of every prompt sampled so far, and the skip decisions made from it (module docstring)."""

    seed: int
    target_zero_variance: float = 0.25
    floor: float = 0.01
    min_agreement: float = 0.9
    history: dict[str, Streak] = field(default_factory=dict)
    p: dict[str, float] = field(default_factory=lambda: {EASY: P_INITIAL, HARD: P_INITIAL})
    agreement: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)  # record -> (agreed, observed)
    step: int = 0
    _frozen: dict[str, Streak] = field(default_factory=dict)
    _frozen_p: dict[str, float] = field(default_factory=dict)
    _frozen_agreement: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    _counts: Counter = field(default_factory=Counter)

    # ------------------------------------------------------------------------------------------ a step's decisions
    def begin_step(self) -> None:
        """Freeze the history the step's decisions read; count the step's skips and outcomes from zero."""
        self._frozen = dict(self.history)  # `record` replaces a prompt's Streak, never changes one in place
        self._frozen_p, self._frozen_agreement = dict(self.p), dict(self.agreement)
        self._counts = Counter()

    def acts_on(self, streak: Streak) -> bool:
        """Whether streaks like this one have lasted often enough in this run to skip on (module docstring)."""
        agreed, observed = self._frozen_agreement.get(streak_record(streak), (0, 0))
        return trusted(agreed, observed, self.min_agreement)

    def skips(self, prompt: Any, draw: str, counted: bool = True, any_step: bool = False) -> bool:
        """Whether to skip `prompt`, offered by `draw` (its place in the step's draws: the same place gets the same
        answer, another place a fresh one); counted as skipped when it is and `counted`. `any_step`: the draw's
        number does not depend on the step (the streaming rollout's draws are its stream positions: predicted while
        a batch ahead is planned, decided when the batch takes them, with the history as it then stands)."""
        key = prompt_key(prompt)
        streak = self._frozen.get(key)
        if streak is None or not self.acts_on(streak):
            return False
        chance = skip_probability(streak.length, self._frozen_p[streak.kind], self.floor)
        skipped = uniform(self.seed, -1 if any_step else self.step, key, draw) < chance
        self._counts["skipped"] += skipped and counted
        return skipped

    def record(self, prompts: list[Any], zero_variance: list[bool], accuracy: list[float]) -> None:
        """The outcome of each generated group: its prompt, whether its responses all agreed, and their common
        accuracy (> 0: all right, "easy"; else all wrong, "hard")."""
        for prompt, agreed, value in zip(prompts, zero_variance, accuracy, strict=True):
            key = prompt_key(prompt)
            predicted = self._frozen.get(key)  # its streak as the step began, if it had one
            kind = EASY if value > 0 else HARD  # meaningful only where the group agreed
            self._counts["generated"] += 1
            self._counts["predicted"] += predicted is not None
            if predicted is not None:  # a prompt generated with a streak: did the streak last?
                record = streak_record(predicted)
                agreed_before, observed = self.agreement.get(record, (0, 0))
                self.agreement[record] = (agreed_before + (agreed and kind == predicted.kind), observed + 1)
            if not agreed:
                self.history.pop(key, None)  # spread again: no streak (and nothing to keep)
                continue
            self._counts[kind] += 1
            if predicted is not None:  # generated anyway, and agreed again: what a skip would have saved
                self._counts[f"avoidable_{kind}"] += 1
            streak = self.history.get(key)
            length = streak.length + 1 if streak is not None and streak.kind == kind else 1
            self.history[key] = Streak(length, kind)

    def end_step(self) -> dict[str, float]:
        """Adapt the exploration probabilities to the step's zero-variance shares; the step's metrics."""
        counts = self._counts
        generated = max(counts["generated"], 1)
        metrics = {
            "prompt_triage/skipped": float(counts["skipped"]),
            "prompt_triage/predicted_zero_variance": counts["predicted"] / generated,
            "prompt_triage/zero_variance": (counts[EASY] + counts[HARD]) / generated,
            "prompt_triage/avoidable_zero_variance": (counts[f"avoidable_{EASY}"] + counts[f"avoidable_{HARD}"])
            / generated,
            "prompt_triage/prompts_with_streak": float(len(self.history)),
            "prompt_triage/prompts_acted_on": float(sum(self.acts_on(streak) for streak in self._frozen.values())),
        }
        if counts["predicted"]:  # some prompt could be skipped: adapt
            for kind, share in TARGET_SHARES.items():
                target = self.target_zero_variance * share
                avoidable = counts[f"avoidable_{kind}"] / generated
                step = -P_STEP if avoidable >= target else P_STEP
                self.p[kind] = min(P_MAX, max(P_MIN, self.p[kind] + step))
        metrics["prompt_triage/p_easy"], metrics["prompt_triage/p_hard"] = self.p[EASY], self.p[HARD]
        self.step += 1
        # What the next `begin_step` freezes (nothing is recorded in between): the streaming rollout, planning the
        # next batch before it begins, predicts the decisions that batch will take.
        self._frozen, self._frozen_p, self._frozen_agreement = dict(self.history), dict(self.p), dict(self.agreement)
        return metrics

    # ------------------------------------------------------------------------------------------------ run state
    def state_dict(self) -> dict[str, Any]:
        return {
            "history": {key: (s.length, s.kind) for key, s in self.history.items()},
            "p": dict(self.p),
            "agreement": [(kind, length, *counts) for (kind, length), counts in self.agreement.items()],
            "step": self.step,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = {key: Streak(length, kind) for key, (length, kind) in state["history"].items()}
        self.p = dict(state["p"])
        self.agreement = {  # absent: saved before the records were kept; they start empty
            (kind, length): (agreed, observed) for kind, length, agreed, observed in state.get("agreement", [])
        }
        self.step = int(state["step"])
