"""`training.sampling.batch_metrics`: a streamed step's reward and length metrics over the groups decided for its batch,
against TRL 1.16's formulas written out here, and which groups count."""

import math

import torch

from dapo_trl.training.sampling.batch_metrics import decided_groups, replaced, row_statistics, trained_batch_metrics


def test_groups_count_until_the_one_that_fills_the_batch():
    kept = torch.tensor([False, True, False, True, True])
    assert decided_groups(kept, 4, kept_rows=0, target_rows=8) == 4  # the fourth group fills it
    assert decided_groups(kept, 4, kept_rows=4, target_rows=8) == 2
    assert decided_groups(kept, 4, kept_rows=8, target_rows=8) == 0  # carried groups filled it already
    assert decided_groups(kept, 4, kept_rows=0, target_rows=40) == 5


def reference(rewards_per_func, weights, lengths, truncated, group):
    """TRL's `_generate_and_score_completions` / `_generate` metrics over one pass holding exactly these rows."""

    def nanstd(x):
        x = x[~torch.isnan(x)]
        mean = x.mean()
        return math.sqrt(((x - mean) ** 2).sum().item() / (len(x) - 1))

    out = {}
    for i, name in enumerate(["acc", "fmt"]):
        out[f"rewards/{name}/mean"] = torch.nanmean(rewards_per_func[:, i]).item()
        out[f"rewards/{name}/std"] = nanstd(rewards_per_func[:, i])
    rewards = (rewards_per_func * weights).nansum(dim=1)
    out["reward"], out["reward_std"] = rewards.mean().item(), nanstd(rewards)
    out["frac_reward_zero_std"] = (rewards.view(-1, group).std(dim=1) == 0).float().mean().item()
    lengths = lengths.float()
    out.update(
        {
            "completions/mean_length": lengths.mean().item(),
            "completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(),
            "completions/clipped_ratio": truncated.float().mean().item(),
        }
    )
    ended = lengths[~truncated]
    out.update(
        {
            "completions/mean_terminated_length": ended.mean().item(),
            "completions/min_terminated_length": ended.min().item(),
            "completions/max_terminated_length": ended.max().item(),
        }
    )
    return out


def test_metrics_over_several_waves_equal_one_pass_over_their_rows():
    generator = torch.Generator().manual_seed(0)
    rows, group = 12, 4
    rewards = torch.randint(0, 2, (rows, 2), generator=generator).float() * 2 - 1
    rewards[4:8, 0] = 1.0  # a group without spread
    rewards[2, 1] = torch.nan  # a function that did not apply
    lengths = torch.randint(1, 50, (rows,), generator=generator)
    truncated = torch.rand(rows, generator=generator) < 0.3
    truncated[0] = False
    weights = torch.tensor([1.0, 0.5])
    waves = [slice(0, 4), slice(4, 12)]
    parts = [row_statistics(rewards[w], lengths[w], truncated[w]) for w in waves]
    metrics = trained_batch_metrics(parts, weights, ["acc", "fmt"], group)
    expected = reference(rewards, weights, lengths, truncated, group)
    assert metrics.keys() == expected.keys()
    for name, value in expected.items():
        assert math.isclose(metrics[name], value, rel_tol=1e-6, abs_tol=1e-7), name
    assert all(replaced(name) for name in metrics)
