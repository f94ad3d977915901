"""Pure DAPO math (the overlong penalty, the exact step normaliser) against references written from the paper;
the policy losses are in test_losses.py."""

import random

import pytest
import torch

from dapo_trl.algorithm import soft_overlong_penalty, trl_items_for_exact_normalizer


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
