"""ReTool's reward shaping for multi-turn tool use: a wrong answer that used more tool rounds is penalised less."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .dapo import dapo_boxed_reward
from .math_verify import math_verify_reward

RETOOL_WRONG_CAP = -0.6
RETOOL_BONUS_PER_TOOL_ROUND = 0.1


def tool_turns(completion: Any) -> int:
    """ReTool's (verl's) `num_turns`: the prompt, each assistant message and each round of tool replies.

    A response with no tool call has 2 turns; each tool round adds 2 (the tool's reply and the assistant's next
    message). Parallel calls answered in one round count once, as in verl's agent loop.
    """
    if not isinstance(completion, Sequence) or isinstance(completion, str | bytes | bytearray):
        return 2
    turns, previous_role = 1, None
    for message in completion:
        role = message.get("role") if isinstance(message, Mapping) else None
        if role == "assistant" or (role == "tool" and previous_role != "tool"):
            turns += 1
        previous_role = role
    return max(turns, 2)


def retool_shaped_score(score: float, num_turns: int) -> float:
    """ReTool's rule: a wrong answer (score < 0) that used more tool turns is penalised less, never above -0.6."""
    if score >= 0:
        return score
    return min(RETOOL_WRONG_CAP, score + (num_turns - 2) / 2 * RETOOL_BONUS_PER_TOOL_ROUND)


def make_tool_aware_reward(base: Callable[..., list[float]], name: str) -> Callable[..., list[float]]:
    """Wrap a correctness reward with ReTool's tool-turn rule; the answer is read from the assistant's text only.

    verl scores the decoded response with tool replies in it, so a program that prints "\\boxed{42}" can answer
    for the model; here only what the model itself wrote is scored.
    """

    def reward(completions: list, log_metric: Callable[[str, float], None] | None = None, **kwargs: Any) -> list[float]:
        scores = base(completions=completions, log_metric=log_metric, **kwargs)
        turns = [tool_turns(completion) for completion in completions]
        if log_metric is not None and turns:
            log_metric(f"rewards/{name}/tool_rounds_mean", sum((t - 2) / 2 for t in turns) / len(turns))
        return [
            None if score is None else retool_shaped_score(score, turn)
            for score, turn in zip(scores, turns, strict=True)
        ]

    reward.__name__ = name
    reward.__doc__ = f"{base.__name__} with ReTool's tool-turn rule for wrong answers."
    return reward


retool_reward = make_tool_aware_reward(dapo_boxed_reward, "retool_reward")
retool_math_verify_reward = make_tool_aware_reward(math_verify_reward, "retool_math_verify_reward")
