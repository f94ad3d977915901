"""Rollout rejection (`dapo_trl.algorithm.rollout_correction`, verl's `algorithm.rollout_correction.rollout_rs`):
the keep mask against independent references written from verl's formulas (0.7's `token` / `sequence` /
`geometric` ratio bands, and later verl's `*_k1` bands on -log r), DAPOConfig's checks, and the trainer's loss with
the rejection in it (rejected tokens carry no loss, their share is logged)."""

import math
from pathlib import Path

import pytest
import torch
from datasets import Dataset

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.algorithm.rollout_correction import REJECTION_LEVELS, rejection_bounds, rejection_mask
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.rewards import dapo_math_reward
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs
from dapo_trl.verl_import.reader import read_verl_input
from dapo_trl.verl_import.translate import translate

from .helpers import ROWS, fixed_batch, token_logps

VERL_SCRIPT = Path(__file__).resolve().parent / "data" / "verl" / "grpo_kl.sh"
CORRECTION = "algorithm.rollout_correction."
BOUND = 20.0  # verl's SAFETY_BOUND


# ------------------------------------------------------------------------------------ references from verl's formulas
def verl_ratio_band_keep(log_ratio, mask, level, lower, upper):
    """verl 0.7 (`compute_rollout_rejection_mask`): the weight exp(clamp(s, -20, 20)) of s = the token's log-ratio,
    the row's masked sum of them, or their masked mean (sum / (tokens + 1e-8)), kept when lower <= weight <= upper."""
    if level == "token":
        weight = torch.exp(log_ratio.clamp(-BOUND, BOUND))
    else:
        s = (log_ratio * mask).sum(-1, keepdim=True)
        if level == "geometric":
            s = s / (mask.sum(-1, keepdim=True) + 1e-8)
        weight = torch.exp(s.clamp(-BOUND, BOUND)).expand_as(log_ratio)
    return ((weight >= lower) & (weight <= upper)).to(log_ratio.dtype)


def verl_k1_keep(log_ratio, mask, option, low, high):
    """Later verl: k1 = -clamp(log-ratio, -20, 20) per token; `token_k1` tests it, `seq_sum_k1` / `seq_mean_k1` the
    row's masked sum / mean of it, kept when log(low) <= statistic <= log(high) ("low_high" of rollout_rs_threshold)."""
    k1 = -log_ratio.clamp(-BOUND, BOUND)
    if option == "token_k1":
        statistic = k1
    else:
        statistic = (k1 * mask).sum(-1, keepdim=True)
        if option == "seq_mean_k1":
            statistic = statistic / (mask.sum(-1, keepdim=True) + 1e-8)
        statistic = statistic.expand_as(log_ratio)
    return ((statistic >= math.log(low)) & (statistic <= math.log(high))).to(log_ratio.dtype)


def random_rows(seed: int, rows: int = 64, tokens: int = 12, spread: float = 0.3):
    """log pi_old - log pi_rollout per token (float64) and a loss mask of rows of 1..tokens tokens, plus a row
    without any."""
    generator = torch.Generator().manual_seed(seed)
    scale = spread * torch.rand(rows, 1, generator=generator) * 2  # rows near and far from on-policy
    log_ratio = scale * torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    lengths = torch.randint(1, tokens + 1, (rows,), generator=generator)
    lengths[-1] = 0
    mask = (torch.arange(tokens)[None, :] < lengths[:, None]).double()
    return log_ratio, mask


BANDS = {"token": (0.7, 1.4), "sequence": (0.5, 2.0), "geometric": (0.95, 1.08)}


@pytest.mark.parametrize("level", REJECTION_LEVELS)
def test_each_level_keeps_what_verls_ratio_band_keeps(level):
    log_ratio, mask = random_rows(seed=1)
    lower, upper = BANDS[level]
    got = rejection_mask(log_ratio, mask, level, lower, upper)
    expected = verl_ratio_band_keep(log_ratio, mask, level, lower, upper)
    on = mask.bool()
    assert torch.equal(got[on], expected[on])
    assert 0 < got[on].sum() < on.sum()  # some tokens kept, some rejected
    if level != "token":  # a row-level decision covers the row
        assert torch.equal(got, got[:, :1].expand_as(got))
        assert got[-1].eq(1).all()  # no loss token: ratio 1, kept


@pytest.mark.parametrize(
    ("option", "level"), [("token_k1", "token"), ("seq_sum_k1", "sequence"), ("seq_mean_k1", "geometric")]
)
def test_later_verls_k1_bands_are_the_inverted_ratio_band(option, level):
    """rollout_rs=<option> with rollout_rs_threshold "low_high" bounds -log(pi_old / pi_rollout): the translator
    writes [1 / high, 1 / low] as the ratio band, which keeps exactly what verl keeps (asymmetric bounds)."""
    low, high = {"token_k1": (0.6, 1.3), "seq_sum_k1": (0.4, 1.8), "seq_mean_k1": (0.93, 1.04)}[option]
    t = translate(
        read_verl_input(
            VERL_SCRIPT,
            {"HOME": "/home/user"},
            [f"{CORRECTION}rollout_rs={option}", f"{CORRECTION}rollout_rs_threshold={low}_{high}"],
        )
    )
    r = t.recipe
    assert not t.blocking and r["rollout_rejection"] == level
    assert (r["rollout_rejection_lower"], r["rollout_rejection_upper"]) == pytest.approx((1 / high, 1 / low))
    log_ratio, mask = random_rows(seed=2)
    got = rejection_mask(log_ratio, mask, level, r["rollout_rejection_lower"], r["rollout_rejection_upper"])
    expected = verl_k1_keep(log_ratio, mask, option, low, high)
    on = mask.bool()
    assert torch.equal(got[on], expected[on]) and 0 < got[on].sum() < on.sum()


def test_each_token_is_clamped_before_the_row_sums_as_later_verl_does():
    """One token beyond e^20 counts as e^20 (later verl; verl 0.7 clamps the row's sum instead): [30, -25] sums to
    0 here, ratio 1, kept; verl 0.7 would see 5 and reject. The only place the two differ."""
    log_ratio = torch.tensor([[30.0, -25.0]], dtype=torch.float64)
    mask = torch.ones_like(log_ratio)
    assert rejection_mask(log_ratio, mask, "sequence", 0.5, 2.0).eq(1).all()
    assert verl_k1_keep(log_ratio, mask, "seq_sum_k1", 0.5, 2.0).eq(1).all()
    assert verl_ratio_band_keep(log_ratio, mask, "sequence", 0.5, 2.0).eq(0).all()


def test_a_token_without_an_engine_log_prob_has_ratio_one():
    """NaN (the engine sent none, as TRL records it): a zero log-ratio, kept on its own and adding 0 to its row."""
    log_ratio = torch.tensor([[float("nan"), 0.05, 0.05], [float("nan"), 0.3, 0.3]])
    mask = torch.ones_like(log_ratio)
    assert rejection_mask(log_ratio, mask, "token", 0.9, 1.1)[:, 0].eq(1).all()
    assert rejection_mask(log_ratio, mask, "sequence", 0.9, 1.2).tolist() == [[1.0] * 3, [0.0] * 3]  # 0.1 vs 0.6


def test_bounds_are_inclusive_and_the_lower_defaults_to_the_reciprocal():
    assert rejection_bounds(2.0) == (0.5, 2.0) and rejection_bounds(2.0, 0.8) == (0.8, 2.0)
    log_ratio = torch.tensor([[0.0, 1e-6, -1e-6]], dtype=torch.float64)
    assert rejection_mask(log_ratio, torch.ones_like(log_ratio), "token", 1.0, 1.0).tolist() == [[1.0, 0.0, 0.0]]
    for lower, upper in ((0.0, 2.0), (2.0, 1.0), (-1.0, 1.0)):
        with pytest.raises(ValueError, match="0 < lower <= upper"):
            rejection_mask(log_ratio, torch.ones_like(log_ratio), "token", lower, upper)
    with pytest.raises(ValueError, match="token, sequence, geometric"):
        rejection_mask(log_ratio, torch.ones_like(log_ratio), "median", 0.5, 2.0)


def test_no_gradient_flows_through_the_mask():
    log_ratio = torch.randn(3, 4, requires_grad=True)
    kept = rejection_mask(log_ratio, torch.ones(3, 4), "geometric", 0.9, 1.1)
    assert not kept.requires_grad


# ------------------------------------------------------------------------------------------------ DAPOConfig
@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"rollout_rejection": "geometric", "rollout_rejection_upper": 1.001},
            r"rollout_rejection='geometric'.*--use_vllm true",
        ),
        ({"rollout_rejection": "token", "use_vllm": True}, "needs rollout_rejection_upper"),
        (
            {"rollout_rejection": "median", "use_vllm": True, "rollout_rejection_upper": 2.0},
            "token, sequence, geometric",
        ),
        ({"rollout_rejection": "token", "use_vllm": True, "rollout_rejection_upper": 0.5}, "upper must then be >= 1"),
        (
            {
                "rollout_rejection": "token",
                "use_vllm": True,
                "rollout_rejection_upper": 2.0,
                "rollout_rejection_lower": 3.0,
            },
            "0 < lower <= upper",
        ),
        ({"rollout_rejection_upper": 2.0}, "rollout_rejection is None"),
    ],
)
def test_bad_rejection_settings_name_the_field_and_the_fix(tmp_path, fields, message):
    with pytest.raises(ValueError, match=message):
        DAPOConfig(output_dir=str(tmp_path), report_to="none", **fields)


def test_rejection_settings_are_accepted_with_an_engine(tmp_path):
    config = DAPOConfig(
        output_dir=str(tmp_path),
        report_to="none",
        use_vllm=True,
        rollout_rejection="geometric",
        rollout_rejection_upper=1.001,
    )
    assert (config.rollout_rejection, config.rollout_rejection_lower, config.rollout_rejection_upper) == (
        "geometric",
        None,
        1.001,
    )
    assert DAPOConfig(output_dir=str(tmp_path), report_to="none").rollout_rejection is None  # off by default


# ------------------------------------------------------------------------------------------------ the trainer's loss


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    """A DAPOTrainer on the tiny model whose batches are made here; the rejection settings are set on its args per
    test (DAPOConfig's engine check is the config test's: this trainer has no engine, the batch carries its
    log-probs)."""
    folder = tmp_path_factory.mktemp("rejection")
    config = DAPOConfig(
        output_dir=str(folder),
        per_device_train_batch_size=ROWS,
        num_generations=4,
        max_completion_length=16,
        report_to="none",
        **activation_checkpointing_kwargs(False),
        bf16=False,
        use_cpu=True,
    )
    dataset = Dataset.from_list([{"prompt": "What is 1 + 1?", "solution": "2"}] * 8)
    model = str(build_tiny_model(folder / "tiny"))
    trainer = DAPOTrainer(model=model, reward_funcs=dapo_math_reward, args=config, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def engine_batch(model) -> dict:
    """A scored batch: pi_old 0.3 nats of noise from the model's log-probs and the engine's a further 0.25 away, so
    ratios both ways and both sides of the clip occur."""
    return fixed_batch(model.config.vocab_size, model, ratio_noise=0.3, sampling_noise=0.25)


@pytest.mark.parametrize("case", ["token", "sequence", "geometric", "bypass"])
def test_the_loss_drops_rejected_tokens_and_logs_their_share(trainer, case):
    """dapo's loss with rollout_rejection: the clipped surrogate of each kept token, 0 for a rejected one, over every
    loss token (rejected ones stay in the denominator); sampling/rollout_rejected_fraction is the rejected share of
    the loss tokens. The band is tested on log pi_old - log pi_rollout, or with old_logprobs_source='engine' (verl's
    bypass mode) on log pi_theta - log pi_rollout."""
    level = "sequence" if case == "bypass" else case
    lower, upper = {"token": (0.75, 1.3), "sequence": (0.45, 1.25), "geometric": (0.94, 1.25)}[level]
    batch = engine_batch(trainer.model)
    old = batch["old_per_token_logps"]
    args = trainer.args
    args.rollout_rejection, args.rollout_rejection_lower, args.rollout_rejection_upper = level, lower, upper
    args.old_logprobs_source = "engine" if case == "bypass" else "trainer"
    try:
        got = trainer.compute_loss(trainer.model, dict(batch))
        logged = trainer._metrics["train"]["sampling/rollout_rejected_fraction"][-1]
    finally:
        args.rollout_rejection = args.rollout_rejection_lower = args.rollout_rejection_upper = None
        args.old_logprobs_source = "trainer"
    with torch.no_grad():
        current = token_logps(trainer.model, batch)
    mask = batch["completion_mask"].double()
    tested = (current if case == "bypass" else old) - batch["sampling_per_token_logps"]
    kept = verl_ratio_band_keep(tested.double(), mask, level, lower, upper)
    ratio = torch.exp(current - old).double()
    advantage = batch["advantages"][:, None].double()
    surrogate = -torch.minimum(ratio * advantage, ratio.clamp(0.8, 1.28) * advantage)
    on = mask.bool()
    expected = (surrogate * kept)[on].sum() / on.sum()
    torch.testing.assert_close(got.detach().double(), expected, atol=1e-6, rtol=1e-6)
    assert 0 < kept[on].sum() < on.sum()  # the band both keeps and rejects here
    assert logged == pytest.approx(1 - kept[on].mean().item(), abs=1e-6)
