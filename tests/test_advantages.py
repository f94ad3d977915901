"""Batch-level advantages over a dynamic-sampling batch against references written with numpy from TRL's formulas."""

import math

import numpy as np
import pytest
import torch

from dapo_trl.training.sampling.advantages import batch_level_rewards, batch_normalisation, batch_scaled_advantages

EPS = 1e-4


def reference_advantages(rewards: list[float], group: int, center: str) -> list[float]:
    """A_i = (R_i - centre) / (sample std of the batch's non-NaN rewards + 1e-4); NaN rewards -> 0."""
    values = np.array(rewards, dtype=np.float64)
    scored = values[~np.isnan(values)]
    std = scored.std(ddof=1) if scored.size > 1 else math.nan
    out = []
    for i, value in enumerate(values):
        members = values[(i // group) * group : (i // group + 1) * group]
        members = members[~np.isnan(members)]
        centre = (members.mean() if members.size else math.nan) if center == "group" else scored.mean()
        advantage = (value - centre) / (std + EPS)
        out.append(0.0 if math.isnan(advantage) else advantage)
    return out


def random_batch(rng: np.random.Generator, groups: int, group: int) -> list[float]:
    """Rewards of kept groups (varied), all-NaN filler groups and a few unscorable (NaN) rows."""
    rewards = []
    for _ in range(groups):
        kind = rng.choice(["kept", "kept", "filler", "unscorable"])
        values = rng.choice([-1.0, 1.0], size=group) + rng.uniform(-0.5, 0.0, size=group)
        if kind == "filler":
            values[:] = math.nan
        elif kind == "unscorable":
            values[rng.integers(group)] = math.nan
        rewards.extend(values.tolist())
    return rewards


@pytest.mark.parametrize("center", ["group", "batch"])
def test_batch_scaled_advantages_match_the_formula(center):
    rng = np.random.default_rng(0)
    for _ in range(200):
        group = int(rng.choice([2, 4, 8]))
        rewards = random_batch(rng, int(rng.integers(1, 6)), group)
        got = batch_scaled_advantages(torch.tensor(rewards, dtype=torch.float32), group, center)
        assert got.tolist() == pytest.approx(reference_advantages(rewards, group, center), rel=1e-5, abs=1e-5)


def test_filler_groups_do_not_change_the_trained_rows():
    """Filler (NaN) groups take no part in the statistics: the trained rows get what they get without them."""
    trained = [1.0, -1.0, 0.5, -0.8, 0.9, 1.0, -1.0, -1.0]
    with_filler = torch.tensor(trained + [math.nan] * 8)
    alone = batch_scaled_advantages(torch.tensor(trained), 4)
    mixed = batch_scaled_advantages(with_filler, 4)
    assert torch.equal(mixed[:8], alone) and not mixed[8:].any()


def reference_batch_rewards(rewards_per_func: list[list[float]], weights: list[float], group: int, mode: str):
    table = np.array(rewards_per_func, dtype=np.float64)
    if mode == "normalize_then_sum":
        for start in range(0, len(table), group):
            block = table[start : start + group]
            for column in range(table.shape[1]):
                values = block[:, column]
                scored = values[~np.isnan(values)]
                std = scored.std(ddof=1) if scored.size > 1 else math.nan
                block[:, column] = (values - (scored.mean() if scored.size else math.nan)) / (std + EPS)
    out = []
    for row in table:
        present = ~np.isnan(row)
        out.append(float(np.sum(row[present] * np.array(weights)[present])) if present.any() else math.nan)
    return out


@pytest.mark.parametrize("mode", ["sum_then_normalize", "normalize_then_sum"])
def test_batch_level_rewards_match_the_formula(mode):
    rng = np.random.default_rng(1)
    for _ in range(100):
        group, columns = 4, int(rng.integers(1, 4))
        table = rng.uniform(-1, 1, size=(group * 3, columns))
        table[rng.uniform(size=table.shape) < 0.15] = math.nan
        table[0] = math.nan  # an unscorable row
        weights = rng.uniform(0.1, 2.0, size=columns).tolist()
        got = batch_level_rewards(torch.tensor(table, dtype=torch.float32), torch.tensor(weights), group, mode)
        expected = reference_batch_rewards(table.tolist(), weights, group, mode)
        assert np.allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_which_configs_need_batch_statistics():
    class Args:
        scale_rewards, multi_objective_aggregation = "group", "sum_then_normalize"

    assert batch_normalisation(Args()) is None
    Args.scale_rewards = "batch"
    assert batch_normalisation(Args()) == "group"
    Args.multi_objective_aggregation = "normalize_then_sum"
    assert batch_normalisation(Args()) == "batch"
