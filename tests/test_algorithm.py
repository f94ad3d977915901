"""Pure DAPO math against independent references written from the paper."""

import math
import random

import pytest
import torch

from dapo_trl.algorithm import (
    LOG_RATIO_BOUND,
    clamp_log_ratio,
    dapo_objective,
    dapo_token_loss,
    ratio_anchor,
    soft_overlong_penalty,
    trl_items_for_exact_normalizer,
)


def eq13_reference(length: int, max_len: int, cache: int) -> float:
    """Paper Eq. 13, case by case."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return ((max_len - cache) - length) / cache
    return -1.0


@pytest.mark.parametrize("max_len,cache", [(20480, 4096), (64, 16), (10, 10), (7, 1)])
def test_soft_overlong_penalty_matches_eq13_on_random_lengths(max_len, cache):
    rng = random.Random(max_len + cache)
    lengths = [rng.randint(0, max_len + 5) for _ in range(500)]
    got = soft_overlong_penalty(torch.tensor(lengths), max_len, cache)
    expected = torch.tensor([eq13_reference(n, max_len, cache) for n in lengths])
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


def test_soft_overlong_penalty_boundaries():
    max_len, cache = 100, 20
    lengths = torch.tensor([0, 79, 80, 81, 90, 99, 100, 101])
    got = soft_overlong_penalty(lengths, max_len, cache).tolist()
    assert got[2] == 0.0  # |y| exactly L_max - L_cache: no penalty
    assert got[3] == pytest.approx(-1 / 20)  # first penalised length
    assert got[4] == pytest.approx(-0.5)
    assert got[6] == pytest.approx(-1.0)  # |y| exactly L_max: full penalty
    assert got[7] == -1.0 and got[0] == 0.0 and got[1] == 0.0


def test_soft_overlong_penalty_rejects_bad_buffer():
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), 10, 11)
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        soft_overlong_penalty(torch.tensor([1]), 10, 0)


@pytest.mark.parametrize("processes,accumulation,steps_per_generation", [(1, 4, 4), (2, 2, 2), (2, 2, 4), (4, 1, 3)])
def test_trl_normaliser_becomes_exact_window_count(processes, accumulation, steps_per_generation):
    """TRL's dapo normaliser is items / P * K / S; DDP averages P processes: the step divides by window_tokens."""
    window_tokens = torch.tensor(1234.0)
    items = trl_items_for_exact_normalizer(window_tokens, steps_per_generation, accumulation)
    per_process_normaliser = items / processes * accumulation / steps_per_generation
    effective = per_process_normaliser * processes  # DDP's mean over P of sum/normaliser
    assert effective.item() == pytest.approx(window_tokens.item())


# ------------------------------------------------------------------------------------------ log-ratio clamp
EXTREME_LOG_RATIOS = [-1000.0, -50.0, -20.5, -20.0, -3.0, 0.0, 0.1, 19.9, 20.0, 20.5, 50.0, 1000.0]


def ppo_token_loss(ratio, advantage, eps_low=0.2, eps_high=0.28, clip_ratio_c=None):
    """-min(r A, clip(r) A), capped at -A c for A < 0 (verl's dual-clip) when clip_ratio_c is set."""
    loss = -torch.minimum(ratio * advantage, torch.clamp(ratio, 1 - eps_low, 1 + eps_high) * advantage)
    if clip_ratio_c is not None:
        loss = torch.where(advantage < 0, torch.minimum(loss, -advantage * clip_ratio_c), loss)
    return loss


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_clamped_log_ratio_equals_verls_clamp(dtype):
    old = torch.linspace(-30.0, -0.01, len(EXTREME_LOG_RATIOS), dtype=dtype).repeat(2, 1)
    old[1] = -2.0
    new = (old + torch.tensor(EXTREME_LOG_RATIOS, dtype=dtype)).requires_grad_()
    ratio = torch.exp(clamp_log_ratio(new, old) - old)
    expected = torch.exp(torch.clamp(new.detach() - old, -LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    assert torch.isfinite(ratio).all()
    torch.testing.assert_close(ratio, expected, rtol=1e-5, atol=0)
    ratio.sum().backward()
    inside = (new.detach() - old).abs() <= LOG_RATIO_BOUND
    torch.testing.assert_close(new.grad[inside], ratio.detach()[inside])  # d exp(x - old) / dx = the ratio
    assert (new.grad[~inside] == 0).all()  # pinned at the bound, as verl's clamp: no gradient


def test_clamp_leaves_ordinary_log_probs_bit_identical():
    old = -torch.rand(4, 7) * 10
    new = old + torch.randn(4, 7)
    assert torch.equal(clamp_log_ratio(new, old), new)
    nan_old = old.clone()
    nan_old[0, 0] = float("nan")
    assert torch.equal(clamp_log_ratio(new, nan_old), new)  # NaN stays NaN-producing, as unclamped


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0, 10.0])
@pytest.mark.parametrize("advantage", [-1.5, 0.0, 2.0])
def test_extreme_log_ratios_give_a_finite_loss_equal_to_the_clamped_one(clip_ratio_c, advantage):
    old = torch.full((1, len(EXTREME_LOG_RATIOS)), -5.0)
    new = old + torch.tensor([EXTREME_LOG_RATIOS])
    advantages = torch.full((1, 1), advantage)
    unclamped = ppo_token_loss(torch.exp(new - old), advantages, clip_ratio_c=clip_ratio_c)
    loss = ppo_token_loss(torch.exp(clamp_log_ratio(new, old) - old), advantages, clip_ratio_c=clip_ratio_c)
    reference = ppo_token_loss(torch.exp(torch.clamp(new - old, -20, 20)), advantages, clip_ratio_c=clip_ratio_c)
    assert torch.isfinite(loss).all()
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-6)
    if clip_ratio_c is None and advantage <= 0:  # without the clamp: inf (A < 0) or NaN (inf * 0)
        assert not torch.isfinite(unclamped).all()


@pytest.mark.parametrize("loss_type,clamped", [("dapo", True), ("grpo", True), ("sapo", True), ("cispo", False)])
def test_the_loss_forward_is_clamped_against_the_old_log_probs_of_ratio_losses(loss_type, clamped):
    old = torch.zeros(1, 3) - 1.0
    assert (ratio_anchor(loss_type, {"old_per_token_logps": old}) is old) == clamped
    assert ratio_anchor(loss_type, {}) is None  # no old log-probs: the ratio is 1, nothing to clamp


def paper_token_loss(logp: float, old_logp: float, advantage: float, eps_low: float, eps_high: float, c) -> float:
    """One token of paper Eq. 10 (clip-higher), verl's dual-clip and its [-20, 20] log-ratio clamp, in plain floats."""
    ratio = math.exp(min(max(logp - old_logp, -20.0), 20.0))
    clipped = min(max(ratio, 1.0 - eps_low), 1.0 + eps_high)
    loss = -min(ratio * advantage, clipped * advantage)
    if c is not None and advantage < 0:
        loss = min(loss, -advantage * c)
    return loss


@pytest.mark.parametrize("clip_ratio_c", [None, 1.5, 10.0])
@pytest.mark.parametrize("seed", range(3))
def test_dapo_objective_equals_the_paper_token_by_token(seed, clip_ratio_c):
    generator = torch.Generator().manual_seed(seed)
    rows, tokens, eps_low, eps_high = 6, 9, 0.2, 0.28
    logps = -3 * torch.rand(rows, tokens, generator=generator, dtype=torch.float64)
    old = logps + torch.randn(rows, tokens, generator=generator, dtype=torch.float64)
    old[0, :3] = logps[0, :3] + torch.tensor([40.0, -40.0, 25.0], dtype=torch.float64)  # past the clamp
    advantages = torch.randn(rows, generator=generator, dtype=torch.float64)
    mask = (torch.rand(rows, tokens, generator=generator) < 0.7).long()
    per_token = dapo_token_loss(logps, old, advantages, eps_low, eps_high, clip_ratio_c)
    for n in range(rows):
        for t in range(tokens):
            expected = paper_token_loss(logps[n, t].item(), old[n, t].item(), advantages[n].item(), eps_low, eps_high,
                                        clip_ratio_c)  # fmt: skip
            assert per_token[n, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-9)
    # Eq. 11: one normaliser, every loss token of the step (here 1.5x this batch's, as if other micro-batches existed)
    step_tokens = 1.5 * float(mask.sum())
    expected = sum(
        paper_token_loss(logps[n, t].item(), old[n, t].item(), advantages[n].item(), eps_low, eps_high, clip_ratio_c)
        for n in range(rows) for t in range(tokens) if mask[n, t]
    ) / step_tokens  # fmt: skip
    assert dapo_objective(per_token, mask, step_tokens).item() == pytest.approx(expected, rel=1e-9)
    assert dapo_objective(per_token, mask).item() == pytest.approx(expected * 1.5, rel=1e-9)
