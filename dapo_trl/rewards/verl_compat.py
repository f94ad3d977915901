"""verl's custom reward functions (`custom_reward_function.path` / `.name`) as TRL reward functions.

verl scores one response at a time: `compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)`
returns a float or a dict with a "score" (and extra fields such as "acc" and "pred"). TRL calls a reward function
once per batch with the completions and the dataset columns. `from_verl_compute_score` adapts the first to the
second; the CLI applies it to any `--reward_funcs module:function` / `file.py:function` whose signature has verl's
`solution_str` parameter.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from .answers import completion_text
from .retool import tool_turns


def is_verl_compute_score(function: Any) -> bool:
    """Whether `function` has verl's per-response reward signature (a `solution_str` parameter)."""
    try:
        return callable(function) and "solution_str" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return False


def _column(values: Sequence[Any] | None, index: int, default: Any = None) -> Any:
    return values[index] if values is not None and index < len(values) else default


def from_verl_compute_score(compute_score: Callable[..., Any], name: str | None = None) -> Callable[..., list[float]]:
    """A TRL reward function that calls verl's `compute_score` once per completion.

    Arguments passed: `data_source` (the row's `data_source` column), `solution_str` (the assistant's own text; verl
    decodes the whole response, tool replies included), `ground_truth` (the `solution` column) and `extra_info` (the
    row's `extra_info` column if any, plus `num_turns` counted as verl's agent loop does). A dict result gives its
    "score"; a None score stays None (TRL's "no reward for this row").
    """

    def reward(
        completions: list[Any],
        solution: Sequence[Any] | None = None,
        data_source: Sequence[Any] | None = None,
        extra_info: Sequence[Any] | None = None,
        **kwargs: Any,
    ) -> list[float | None]:
        scores: list[float | None] = []
        for index, completion in enumerate(completions):
            info = _column(extra_info, index)
            info = dict(info) if isinstance(info, dict) else {}
            info.setdefault("num_turns", tool_turns(completion))
            result = compute_score(
                data_source=_column(data_source, index, ""),
                solution_str=completion_text(completion),
                ground_truth=_column(solution, index),
                extra_info=info,
            )
            score = result.get("score") if isinstance(result, dict) else result
            scores.append(None if score is None else float(score))
        return scores

    reward.__name__ = name or getattr(compute_score, "__name__", "verl_compute_score")
    reward.__doc__ = f"verl reward {reward.__name__} adapted to TRL's batched reward signature."
    return reward
