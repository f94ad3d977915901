"""Where pi_old comes from (`old_logprobs_source`): the interpolation against AReaL's formula written with explicit
versions, the importance weight against TRL's documented modes, the config's refusals, and the trainer on the fake
streaming engine: `engine` trains pi_old = the engine's log-probs with no scoring forward, `interpolated` places
each stale token between its sampler and the weights being trained."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from dapo_trl import DAPOConfig
from dapo_trl.algorithm.proximal import importance_weight, interpolation_weight, proximal_log_probs
from dapo_trl.training import trl_seam

from .helpers import SCRIPTS, python_command, read_jsonl, run_command


# --------------------------------------------------------------------------------------------------- the math
def areal_alpha(v_prox: float, v_behave: float, v_theta: float) -> float:
    """AReaL's docs/algorithms/prox_approx.md: alpha = (v_prox - v_behave) / (v_theta - v_behave), 0 when the
    token's sampler is the policy being trained."""
    return 0.0 if v_theta == v_behave else (v_prox - v_behave) / (v_theta - v_behave)


@pytest.mark.parametrize(
    "v_behave, v_prox, v_theta",
    [(0, 0, 0), (0, 0, 5), (0, 4, 4), (0, 4, 5), (2, 4, 9), (3, 3, 3), (1, 17, 31)],
)
def test_interpolation_weight_is_areals_alpha(v_behave, v_prox, v_theta):
    lag, since = torch.tensor([[float(v_prox - v_behave)]]), torch.tensor([[float(v_theta - v_prox)]])
    assert interpolation_weight(lag, since).item() == pytest.approx(areal_alpha(v_prox, v_behave, v_theta))


def test_proximal_log_probs_is_log_linear_and_carries_no_gradient():
    behaviour = torch.tensor([[-1.0, -2.0, -0.5]])
    current = torch.tensor([[-0.5, -3.0, -0.5]], requires_grad=True)
    weight = torch.tensor([[0.0, 0.5, 1.0]])
    proximal = proximal_log_probs(behaviour, current, weight)
    assert proximal.tolist() == [[-1.0, -2.5, -0.5]]  # pi_behave, the log-space midpoint, pi_theta
    assert not proximal.requires_grad


def trl_weight(log_ratio, mask, mode, low, high):
    """TRL 1.16's vllm_importance_sampling_mode, written from its GRPOConfig docs, row by row."""
    rows = []
    for ratios, row_mask in zip(log_ratio.tolist(), mask.tolist(), strict=True):
        logs = [value if keep else 0.0 for value, keep in zip(ratios, row_mask, strict=True)]
        values = [math.exp(sum(logs))] if mode.startswith("sequence") else [math.exp(value) for value in logs]
        if mode.endswith("truncate"):
            values = [min(max(v, low if low is not None else -math.inf), high) for v in values]
        else:
            values = [0.0 if v < (low or -math.inf) or v > high else v for v in values]
        rows.append(values)
    return rows


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_importance_weight_follows_trls_modes(mode):
    log_ratio = torch.tensor([[0.1, -2.0, 1.5, 0.0], [0.3, 0.2, 9.0, -0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    weight = importance_weight(log_ratio, mask, mode, 0.5, 3.0)
    torch.testing.assert_close(weight, torch.tensor(trl_weight(log_ratio, mask, mode, 0.5, 3.0)))


def test_importance_weight_treats_a_missing_engine_log_prob_as_ratio_one():
    weight = importance_weight(torch.tensor([[float("nan"), 0.2]]), torch.ones(1, 2), "token_truncate", None, 3.0)
    torch.testing.assert_close(weight, torch.tensor([[1.0, math.exp(0.2)]]))


# ---------------------------------------------------------------------------------------------- the config
@pytest.mark.parametrize(
    "settings, message",
    [
        ({"old_logprobs_source": "rollout"}, "choose one of trainer, engine, interpolated"),
        ({"old_logprobs_source": "engine"}, "transformers' generate sends none: pass --use_vllm true"),
        ({"old_logprobs_source": "interpolated"}, "old_logprobs_source='interpolated' takes pi_old"),
    ],
)
def test_config_refuses_a_source_it_cannot_serve(tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        DAPOConfig(output_dir=str(tmp_path), **settings)


def test_the_scoring_forward_runs_where_trl_runs_it():
    """TRL 1.16 scores pi_old when generation and optimizer steps are misaligned, or to correct vLLM's sampling."""

    def trainer(accumulation, per_generation, iterations=1, vllm=False, correction=True):
        args = SimpleNamespace(gradient_accumulation_steps=accumulation, steps_per_generation=per_generation)
        return SimpleNamespace(
            args=args, num_iterations=iterations, use_vllm=vllm, vllm_importance_sampling_correction=correction
        )

    assert not trl_seam.scores_old_log_probs(trainer(4, 4))
    assert trl_seam.scores_old_log_probs(trainer(1, 2))
    assert trl_seam.scores_old_log_probs(trainer(4, 4, iterations=2))
    assert trl_seam.scores_old_log_probs(trainer(4, 4, vllm=True))
    assert not trl_seam.scores_old_log_probs(trainer(4, 4, vllm=True, correction=False))


# ------------------------------------------------------------------------------------------------ end to end
def train(out, steps: int, *overrides: str, processes: int = 1, per_device: int = 8) -> None:
    # Two updates per generation batch: TRL scores pi_old (misaligned), so `trainer` runs a forward to skip.
    schedule = ("rollout_streaming=true", "steps_per_generation=2", "gradient_accumulation_steps=1")
    script = str(SCRIPTS / "streaming_run.py")
    run_command(
        python_command(script, str(out), str(per_device), str(steps), *schedule, *overrides, num_processes=processes)
    )


def scoring_forwards(out, processes: int = 1) -> int:
    return sum(
        record["forwards"] for rank in range(processes) for record in read_jsonl(out / f"forwards_rank{rank}.jsonl")
    )


def trained(out, processes: int = 1) -> list[dict]:
    return [record for rank in range(processes) for record in read_jsonl(out / f"trained_rank{rank}.jsonl")]


@pytest.mark.e2e
def test_engine_and_interpolated_pi_old_skip_the_scoring_forward(tmp_path):
    """`trainer` scores pi_old with a forward; `engine` (two processes) trains with pi_old = the engine's log-probs
    on every token and runs none; `interpolated` at one version of staleness gives each stale token its lag (two
    updates per version) and trains alpha = 1 at the first update after scoring, 2/3 at the second (AReaL's alpha
    with lag 2 and 0 or 1 updates since)."""
    train(tmp_path / "trainer", 2)
    assert scoring_forwards(tmp_path / "trainer") > 0
    for record in trained(tmp_path / "trainer"):
        assert record["old_per_token_logps"] != record["sampling_per_token_logps"]  # the policy's, not the fake's

    train(tmp_path / "engine", 2, "old_logprobs_source=engine", processes=2, per_device=4)
    assert scoring_forwards(tmp_path / "engine", processes=2) == 0
    records = trained(tmp_path / "engine", processes=2)
    assert records and all(r["old_per_token_logps"] == r["sampling_per_token_logps"] for r in records)
    assert all(any(row) for r in records for row in r["old_per_token_logps"])

    out = tmp_path / "interpolated"
    train(out, 4, "old_logprobs_source=interpolated", "rollout_max_staleness=1")
    assert scoring_forwards(out) == 0
    for record in trained(out):
        stale = record["step"] >= 2  # the second generation batch, sampled by version 0 and scored at version 1
        assert {lag for row in record["dapo_proximal_lag"] for lag in row} == ({2.0} if stale else {0.0})
        assert set(record["dapo_scored_at_step"]) == ({2.0} if stale else {0.0})
    history = json.loads((out / "log_history.json").read_text())
    weights = [entry["sampling/proximal_weight/mean"] for entry in history if "sampling/proximal_weight/mean" in entry]
    assert weights == pytest.approx([0.0, 0.0, 1.0, 2 / 3])


def test_the_loss_centres_the_clip_on_the_interpolated_pi_old_and_reweights_by_it():
    """PolicyLossStep with `interpolated` rows: pi_old = engine + alpha (pi_theta - engine), alpha from each token's
    lag and the steps since scoring, and the importance weight min(pi_old / pi_engine, C) recomputed from that pi_old
    (token_truncate, C = 2); a token without an engine log-prob gets pi_theta's."""
    from dapo_trl.training.sampling.old_logprobs import PROXIMAL_LAG, SCORED_AT
    from dapo_trl.training.step.policy_loss import PolicyLossStep

    args = SimpleNamespace(
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_min=None,
        vllm_importance_sampling_clip_max=2.0,
    )
    step = PolicyLossStep.__new__(PolicyLossStep)
    step.trainer = SimpleNamespace(args=args, state=SimpleNamespace(global_step=7))
    current = torch.tensor([[-0.2, -1.0, -0.5], [-2.0, -0.1, -0.3]])
    engine = torch.tensor([[-1.2, -1.0, float("nan")], [-0.5, -0.9, -0.3]])
    inputs = {PROXIMAL_LAG: torch.tensor([[4.0, 4.0, 4.0], [0.0, 2.0, 2.0]]), SCORED_AT: torch.tensor([5.0, 7.0])}
    mask = torch.ones(2, 3)
    old, weight, terms = step._old_from_engine(current, engine, torch.ones(2, 3), inputs, mask)
    alpha = [[4 / 6, 4 / 6, 4 / 6], [0.0, 1.0, 1.0]]  # lag / (lag + since): since 2 and 0
    filled = [[-1.2, -1.0, -0.5], [-0.5, -0.9, -0.3]]
    expected = [
        [e + a * (c - e) for e, a, c in zip(er, ar, cr, strict=True)]
        for er, ar, cr in zip(filled, alpha, current.tolist(), strict=True)
    ]
    torch.testing.assert_close(old, torch.tensor(expected))
    ratios = [
        [min(math.exp(o - e), 2.0) for o, e in zip(orow, erow, strict=True)]
        for orow, erow in zip(expected, filled, strict=True)
    ]
    torch.testing.assert_close(weight, torch.tensor(ratios))
    torch.testing.assert_close(terms["sampling/proximal_weight/mean"], torch.tensor(alpha))
