"""The loss table (`dapo_trl.algorithm.losses`): every registered loss, aggregated as its row says, against an
independent reference (verl's formulas, or TRL's where verl has no such loss), loss and gradient, in float64."""

import math

import pytest
import torch
from trl import GRPOTrainer

from dapo_trl.algorithm.losses import (
    LOG_RATIO_BOUND,
    POLICY_LOSSES,
    Aggregation,
    LossInputs,
    LossSettings,
    aggregate,
    clamped_log_ratio,
    policy_loss,
    ratio_log,
    register_policy_loss,
)

from . import reference_losses as ref

ROWS, TOKENS = 6, 9
SETTINGS = LossSettings(epsilon_low=0.2, epsilon_high=0.28, max_completion_length=TOKENS)


def random_batch(seed: int, spread: float = 0.5):
    generator = torch.Generator().manual_seed(seed)
    logps = (-3 * torch.rand(ROWS, TOKENS, generator=generator, dtype=torch.float64)).requires_grad_()
    old = logps.detach() + spread * torch.randn(ROWS, TOKENS, generator=generator, dtype=torch.float64)
    advantages = torch.randn(ROWS, generator=generator, dtype=torch.float64)
    advantages[0] = 0.0  # a zero advantage (an all-equal group) must give no loss and no NaN
    mask = (torch.rand(ROWS, TOKENS, generator=generator) < 0.7).double()
    mask[:, 0] = 1.0  # every row has a loss token (verl and TRL differ only on empty rows)
    return logps, old, advantages, mask


def library_loss(name: str, logps, old, advantages, mask, settings=SETTINGS, sampling_ratio=None) -> torch.Tensor:
    loss = policy_loss(name)
    log_ratio = ratio_log(clamped_log_ratio(logps, old), mask, settings.ratio_level)
    terms = loss.function(LossInputs(logps, log_ratio, advantages[:, None], mask, sampling_ratio), settings)
    per_token = (
        terms.per_token if sampling_ratio is None or loss.corrects_sampling else terms.per_token * sampling_ratio
    )
    return aggregate(per_token, mask, loss.aggregation, step_tokens=mask.sum(), max_completion_length=TOKENS)


def assert_same_loss_and_gradient(name: str, expected_fn, seed: int, settings=SETTINGS, spread=0.5, **kwargs):
    logps, old, advantages, mask = random_batch(seed, spread)
    got = library_loss(name, logps, old, advantages, mask, settings, **kwargs)
    (got_grad,) = torch.autograd.grad(got, logps)
    expected = expected_fn(logps, old, advantages, mask)
    (expected_grad,) = torch.autograd.grad(expected, logps)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_grad, expected_grad, atol=1e-6, rtol=1e-6)
    assert got_grad.abs().sum() > 0  # the loss trains something


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("clip_ratio_c", [None, 1.5, 3.0])
def test_dapo_is_verls_vanilla_loss_with_token_mean(seed, clip_ratio_c):
    settings = LossSettings(epsilon_low=0.2, epsilon_high=0.28, delta=clip_ratio_c)

    def expected(logps, old, advantages, mask):
        return ref.token_mean(ref.verl_vanilla(logps, old, advantages, 0.2, 0.28, clip_ratio_c), mask)

    assert_same_loss_and_gradient("dapo", expected, seed, settings, spread=0.8)


def test_dual_clip_binds_and_extreme_log_ratios_stay_finite():
    logps, old, advantages, mask = random_batch(0)
    with torch.no_grad():
        old[1, :4] = logps[1, :4] + torch.tensor([40.0, -40.0, 25.0, -1000.0], dtype=torch.float64)  # past the clamp
    advantages[1] = -1.0
    capped = library_loss("dapo", logps, old, advantages, mask, LossSettings(delta=1.5))
    uncapped = library_loss("dapo", logps, old, advantages, mask, LossSettings())
    expected = ref.token_mean(ref.verl_vanilla(logps, old, advantages, 0.2, 0.28, 1.5), mask)
    assert torch.isfinite(capped) and torch.isfinite(uncapped) and capped < uncapped
    torch.testing.assert_close(capped, expected, atol=1e-6, rtol=1e-6)
    (gradient,) = torch.autograd.grad(capped, logps)
    assert torch.isfinite(gradient).all() and (gradient[1, :4] == 0).all()  # pinned at the bound: no gradient


def test_the_log_ratio_clamp_is_verls():
    logps = torch.zeros(1, 6, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-1000.0, -20.5, -20.0, 0.3, 20.5, 1000.0]], dtype=torch.float64)
    clamped = clamped_log_ratio(logps, old)
    assert clamped.tolist() == [[LOG_RATIO_BOUND, 20.0, 20.0, -0.3, -20.0, -20.0]]
    (gradient,) = torch.autograd.grad(clamped.sum(), logps)
    assert gradient.tolist() == [[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]]


@pytest.mark.parametrize("seed", range(3))
def test_grpo_is_vanilla_with_seq_mean_token_mean(seed):
    def expected(logps, old, advantages, mask):
        return ref.seq_mean_token_mean(ref.verl_vanilla(logps, old, advantages, 0.2, 0.28, None), mask)

    assert_same_loss_and_gradient("grpo", expected, seed)


@pytest.mark.parametrize("seed", range(3))
def test_grpo_at_sequence_level_is_verls_gspo(seed):
    settings = LossSettings(epsilon_low=0.05, epsilon_high=0.08, ratio_level="sequence")

    def expected(logps, old, advantages, mask):
        return ref.seq_mean_token_mean(ref.verl_gspo(logps, old, advantages, mask, 0.05, 0.08), mask)

    assert_same_loss_and_gradient("grpo", expected, seed, settings, spread=0.1)


@pytest.mark.parametrize("seed", range(3))
def test_luspo_is_gspo_summed_over_each_sequence(seed):
    settings = LossSettings(epsilon_low=0.05, epsilon_high=0.08, ratio_level="sequence")

    def expected(logps, old, advantages, mask):
        return ref.seq_mean_token_sum(ref.verl_gspo(logps, old, advantages, mask, 0.05, 0.08), mask)

    assert_same_loss_and_gradient("luspo", expected, seed, settings, spread=0.1)


@pytest.mark.parametrize("seed", range(2))
def test_dr_grpo_is_vanilla_with_seq_mean_token_sum_norm(seed):
    def expected(logps, old, advantages, mask):
        return ref.seq_mean_token_sum_norm(ref.verl_vanilla(logps, old, advantages, 0.2, 0.28, None), mask, TOKENS)

    assert_same_loss_and_gradient("dr_grpo", expected, seed)


@pytest.mark.parametrize("seed", range(2))
def test_bnpo_is_vanilla_with_the_micro_batch_token_mean(seed):
    def expected(logps, old, advantages, mask):
        return ref.token_mean(ref.verl_vanilla(logps, old, advantages, 0.2, 0.28, None), mask)

    assert_same_loss_and_gradient("bnpo", expected, seed)


@pytest.mark.parametrize("seed", range(3))
def test_sapo_is_verls_sapo(seed):
    settings = LossSettings(sapo_temperature_pos=1.0, sapo_temperature_neg=1.05)

    def expected(logps, old, advantages, mask):
        return ref.seq_mean_token_mean(ref.verl_sapo(logps, old, advantages, 1.0, 1.05), mask)

    assert_same_loss_and_gradient("sapo", expected, seed, settings)


@pytest.mark.parametrize("seed", range(2))
def test_cispo_is_trls_cispo(seed):
    settings = LossSettings(epsilon_high=1.3)

    def expected(logps, old, advantages, mask):
        return ref.token_mean(ref.trl_cispo(logps, old, advantages, 1.3), mask)

    assert_same_loss_and_gradient("cispo", expected, seed, settings)


@pytest.mark.parametrize("with_sampling_ratio", [False, True])
def test_vespo_weights_are_trls_gamma_weights(with_sampling_ratio):
    logps, old, advantages, mask = random_batch(4, spread=0.05)
    generator = torch.Generator().manual_seed(5)
    sampling = torch.rand(ROWS, TOKENS, generator=generator, dtype=torch.float64) + 0.5 if with_sampling_ratio else None
    phi = GRPOTrainer.get_gamma_weights(advantages[:, None], (logps - old).detach(), mask, sampling)

    def expected(logps, old, advantages, mask):
        return ref.token_mean(-phi * advantages[:, None] * logps, mask)

    got = library_loss("vespo", logps, old, advantages, mask, LossSettings(), sampling_ratio=sampling)
    torch.testing.assert_close(got, expected(logps, old, advantages, mask), atol=1e-6, rtol=1e-6)
    assert (phi > 0).any() and (phi < 1).any()


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_rollout_weights", [False, True])
def test_gmpo_is_verls_geo_mean(seed, with_rollout_weights):
    settings = LossSettings(epsilon_low=0.4, epsilon_high=0.4)
    generator = torch.Generator().manual_seed(seed + 10)
    weights = torch.rand(ROWS, TOKENS, generator=generator, dtype=torch.float64) + 0.3 if with_rollout_weights else None

    def expected(logps, old, advantages, mask):
        return ref.verl_geo_mean(logps, old, advantages, mask, 0.4, 0.4, weights).mean()

    assert_same_loss_and_gradient("gmpo", expected, seed, settings, spread=0.6, sampling_ratio=weights)
    logps, old, _, mask = random_batch(seed, 0.6)
    assert ((logps - old).abs() > 0.4).any()  # the log-space clip binds in these batches


def test_gmpo_returns_one_loss_per_sequence_and_its_clip_fractions():
    logps, old, advantages, mask = random_batch(1, 0.6)
    settings = LossSettings(epsilon_low=0.4, epsilon_high=0.4)
    terms = policy_loss("gmpo").function(LossInputs(logps, logps - old, advantages[:, None], mask, None), settings)
    assert terms.per_token.shape == (ROWS, 1)
    clipped = ((logps - old).abs() > 0.4).double()
    torch.testing.assert_close(terms.diagnostics["clip_ratio/high_mean"].double(), clipped * (advantages[:, None] > 0))
    torch.testing.assert_close(terms.diagnostics["clip_ratio/low_mean"].double(), clipped * (advantages[:, None] < 0))


def test_every_registered_loss_has_a_reference_here():
    tested = {"dapo", "grpo", "luspo", "dr_grpo", "bnpo", "sapo", "cispo", "vespo", "gmpo"}
    assert set(POLICY_LOSSES) == tested


def test_the_table_is_what_the_trainer_reads():
    assert [name for name, row in POLICY_LOSSES.items() if row.aggregation is Aggregation.STEP_TOKENS] == [
        "dapo",
        "cispo",
        "vespo",
    ]
    assert {name for name, row in POLICY_LOSSES.items() if row.dual_clip} == {
        "dapo",
        "grpo",
        "dr_grpo",
        "bnpo",
        "luspo",
    }
    assert POLICY_LOSSES["gmpo"].verl_name == "geo_mean" and POLICY_LOSSES["gmpo"].ratio_levels == ("token",)
    assert POLICY_LOSSES["bnpo"].aggregation.split_weight == "tokens"
    assert POLICY_LOSSES["grpo"].aggregation.split_weight == "rows"
    with pytest.raises(ValueError, match="choose one of"):
        policy_loss("ppo")
    with pytest.raises(ValueError, match="already registered"):
        register_policy_loss("dapo", Aggregation.STEP_TOKENS)(lambda inputs, settings: None)


def test_a_sequence_level_ratio_is_the_mean_log_ratio():
    log_ratio = torch.tensor([[0.1, 0.3, 5.0], [0.2, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(ratio_log(log_ratio, mask, "sequence"), torch.tensor([[0.2], [0.2]]))
    assert math.isclose(torch.exp(ratio_log(log_ratio, mask, "sequence"))[0, 0].item(), math.exp(0.2), rel_tol=1e-6)
    with pytest.raises(ValueError, match="importance_sampling_level"):
        ratio_log(log_ratio, mask, "group")
