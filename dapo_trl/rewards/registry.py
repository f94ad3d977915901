"""The one registry of reward names (`--reward_funcs NAME`) and how to build each.

Every name is built the same way, `build_reward(name, options)`, so callers need no per-name case: a ready reward
function ignores the options, the LLM judge reads its endpoint from them. The judge is imported only when built, so
its HTTP client is loaded only by runs that use it (and this package never imports torch or TRL).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .dapo import dapo_boxed_reward, dapo_math_reward
from .math_verify import math_verify_reward
from .retool import retool_math_verify_reward, retool_reward
from .verl_default import VerlDefaultReward, verl_default_reward, verl_math_verify_reward

RewardFunction = Callable[..., list[Any]]


class MissingRewardOptions(ValueError):
    """A registered reward was asked for without options it cannot work without (the judge without an endpoint)."""

    def __init__(self, name: str, required: tuple[str, ...]) -> None:
        super().__init__(f"reward {name!r} needs the options {', '.join(required)}")
        self.name = name
        self.required = required


@dataclass(frozen=True)
class RewardBuilder:
    """How to build one named reward: `build(**values)` with the values of `options` that are set.

    `required` options must be set (truthy) or `build_reward` raises `MissingRewardOptions` naming all of them.
    """

    build: Callable[..., RewardFunction]
    options: tuple[str, ...] = ()
    required: tuple[str, ...] = ()

    @classmethod
    def ready(cls, reward: RewardFunction) -> RewardBuilder:
        """A builder for a reward that takes no options: it always returns that very function."""
        return cls(build=lambda: reward)


def _build_judge(judge_base_url: str, judge_model: str, judge_max_concurrency: int | None = None) -> RewardFunction:
    """The LLM-as-judge reward on an OpenAI-compatible endpoint (see `dapo_trl.rewards.judge`)."""
    from .judge import JudgeReward  # needs dapo_trl/rewards/judge.py; imported only when a judge is asked for

    extra = {} if judge_max_concurrency is None else {"max_concurrency": judge_max_concurrency}
    return JudgeReward(judge_base_url, judge_model, **extra)


def _build_verl_default(sandbox_url: str | None = None) -> RewardFunction:
    """verl's scorer per data source; with a SandboxFusion `sandbox_url` its code sources are scored too."""
    return VerlDefaultReward(sandbox_url=sandbox_url) if sandbox_url else verl_default_reward


REWARD_BUILDERS: dict[str, RewardBuilder] = {
    "dapo_math": RewardBuilder.ready(dapo_math_reward),
    "dapo_boxed": RewardBuilder.ready(dapo_boxed_reward),
    "math_verify": RewardBuilder.ready(math_verify_reward),
    "retool": RewardBuilder.ready(retool_reward),
    "retool_math_verify": RewardBuilder.ready(retool_math_verify_reward),
    "verl_default": RewardBuilder(_build_verl_default, options=("sandbox_url",)),
    "verl_math_verify": RewardBuilder.ready(verl_math_verify_reward),
    "judge": RewardBuilder(
        _build_judge,
        options=("judge_base_url", "judge_model", "judge_max_concurrency"),
        required=("judge_base_url", "judge_model"),
    ),
}

# The registered rewards that can be built without options, by name: what `dapo_trl.evaluate` and the help text list.
REWARD_FUNCTIONS: dict[str, RewardFunction] = {
    name: builder.build() for name, builder in REWARD_BUILDERS.items() if not builder.required
}


def _option(options: Mapping[str, Any] | object | None, name: str) -> Any:
    if isinstance(options, Mapping):
        return options.get(name)
    return getattr(options, name, None)


def build_reward(name: str, options: Mapping[str, Any] | object | None = None) -> RewardFunction:
    """The reward registered as `name`, built with the options its builder reads.

    `options` is a mapping, or an object whose attributes carry the options by name (the CLI's script arguments), or
    None. Unset (None) options are left to the builder's defaults. Raises KeyError for an unregistered name and
    `MissingRewardOptions` when a required option is unset.
    """
    builder = REWARD_BUILDERS[name]
    values = {option: value for option in builder.options if (value := _option(options, option)) is not None}
    if not all(values.get(option) for option in builder.required):
        raise MissingRewardOptions(name, builder.required)
    return builder.build(**values)
