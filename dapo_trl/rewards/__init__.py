"""Math correctness rewards with TRL's reward-function signature, returning DAPO's +1 / -1.

Scorers selectable by name (`REWARD_FUNCTIONS`, `--reward_funcs NAME`; `registry` also builds the LLM judge):

- `dapo_math` (`dapo_math_reward`): DAPO's own scorer, kept faithful to the paper: the last "Answer: ..." line in the
  last 300 characters, Minerva normalisation, exact string comparison. Exact for DAPO-Math-17k's integer answers, but
  it marks boxed-only responses and equivalent forms (0.5 vs 1/2) wrong.
- `dapo_boxed` (`dapo_boxed_reward`): the same with the last brace-balanced `\\boxed{...}` in the tail instead.
- `math_verify` (`math_verify_reward`): symbolic equivalence with math-verify, on the answer the response commits to
  (its LAST `\\boxed{}` or "Answer:" line, whichever comes last), after normalising forms math-verify misses. Every
  response is scored in a worker process under a hard deadline (`dapo_trl.utils.killable_pool`), so no input can stall
  training.
- `retool`, `retool_math_verify`: those scorers with ReTool's tool-turn shaping of wrong answers (`retool`).
- `verl_default` (`verl_default_reward`): verl's rewards by data source, the scorer verl's `default_compute_score`
  picks for each row's `data_source` (GSM8K's `#### N`, Hendrycks' MATH, DAPO's); `verl_math_verify` scores the
  MATH sets with verl's math-verify scorer instead.

TRL calls reward functions as `f(prompts=..., completions=..., completion_ids=..., log_metric=..., **columns)`; the
ground truth is the `solution` column. Inputs that cannot be read (None, a 1 MB line, an unclosed box) score -1 and
are counted through `log_metric` as `rewards/<function name>/{timeouts,unparseable,no_answer}`, one value per batch.

Modules: `answers` (extraction, normalisation, verdicts), `dapo`, `math_verify`, `retool`, `verl_default`,
`verl_compat` (verl-style `compute_score` functions as TRL rewards), `registry`, and
`overlong` (the soft overlong penalty column; it needs torch, so it is not imported here: math-verify workers import
this package).
"""

from .answers import (
    CORRECT_REWARD,
    DAPO_TAIL_CHARS,
    INCORRECT_REWARD,
    MAX_ANSWER_CHARS,
    MAX_RESPONSE_CHARS,
    Verdict,
    completion_text,
    extract_boxed_answer,
    extract_committed_answer,
    extract_dapo_answer,
    last_boxed,
    normalize_final_answer,
    normalize_math_text,
)
from .dapo import dapo_answer_is_correct, dapo_boxed_reward, dapo_math_reward
from .math_verify import (
    ScoredResponse,
    make_math_verify_reward,
    math_verify_pool,
    math_verify_reward,
    score_math_verify,
    verify_answer,
    warm_up_worker,
)
from .registry import REWARD_BUILDERS, REWARD_FUNCTIONS, MissingRewardOptions, RewardBuilder, build_reward
from .retool import (
    RETOOL_BONUS_PER_TOOL_ROUND,
    RETOOL_WRONG_CAP,
    make_tool_aware_reward,
    retool_math_verify_reward,
    retool_reward,
    retool_shaped_score,
    tool_turns,
)
from .verl_default import UnsupportedDataSource, VerlDefaultReward, verl_default_reward, verl_math_verify_reward

__all__ = [
    "CORRECT_REWARD",
    "DAPO_TAIL_CHARS",
    "INCORRECT_REWARD",
    "MAX_ANSWER_CHARS",
    "MAX_RESPONSE_CHARS",
    "RETOOL_BONUS_PER_TOOL_ROUND",
    "RETOOL_WRONG_CAP",
    "REWARD_BUILDERS",
    "REWARD_FUNCTIONS",
    "MissingRewardOptions",
    "RewardBuilder",
    "ScoredResponse",
    "Verdict",
    "build_reward",
    "completion_text",
    "dapo_answer_is_correct",
    "dapo_boxed_reward",
    "dapo_math_reward",
    "extract_boxed_answer",
    "extract_committed_answer",
    "extract_dapo_answer",
    "last_boxed",
    "make_math_verify_reward",
    "make_tool_aware_reward",
    "math_verify_pool",
    "math_verify_reward",
    "normalize_final_answer",
    "normalize_math_text",
    "retool_math_verify_reward",
    "retool_reward",
    "retool_shaped_score",
    "score_math_verify",
    "tool_turns",
    "UnsupportedDataSource",
    "VerlDefaultReward",
    "verl_default_reward",
    "verl_math_verify_reward",
    "verify_answer",
    "warm_up_worker",
]
