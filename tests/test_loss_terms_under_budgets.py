"""The loss terms beside the policy loss under a token budget: a micro-batch cut into backward passes
(`max_tokens_per_microbatch`) trains the gradient of the micro-batch run whole with an entropy bonus and with a
mixture-of-experts router's auxiliary loss, for every registered loss; the adaptive entropy controller steps once per
optimizer step, from the step's mean entropy, over micro-batches of gradient accumulation.

In-process trainer calls on the tiny models (one process: the two-process split is `test_loss.py`'s
`test_loss_on_two_processes_is_the_library_objective`, which also runs an entropy bonus under a budget)."""

import pytest
import torch
from datasets import Dataset

from dapo_trl import DAPOTrainer
from dapo_trl.algorithm.losses import POLICY_LOSSES
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.training.step.batching import FILLER_ROWS
from dapo_trl.training.step.policy_loss import PolicyLossStep

from .helpers import tiny_config

ROWS, PROMPT_LEN, COMPLETION_LEN = 8, 5, 10
BUDGET = 12  # real tokens per pass: one or two rows each, so a micro-batch of 8 rows runs as 6 passes
LOSS_SETTINGS = {"luspo": {"importance_sampling_level": "sequence"}}  # luspo is defined per sequence


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("dense") / "model"))


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("moe") / "model", architecture="moe"))


def trainer_for(out, model_dir: str, budget: int | None, **settings) -> DAPOTrainer:
    """A trainer in training mode over `model_dir`, its token budget `budget` (None: none)."""
    config = tiny_config(
        out,
        per_device_train_batch_size=ROWS,
        num_generations=4,
        max_completion_length=COMPLETION_LEN,
        use_cpu=True,
        bf16=False,
        max_tokens_per_microbatch=budget,
        **settings,
    )
    prompts = Dataset.from_list([{"prompt": "What is 1 + 1?", "solution": "2"}] * ROWS)
    trainer = DAPOTrainer(model=model_dir, args=config, train_dataset=prompts)
    trainer.model.train()
    return trainer


def fixed_batch(model) -> dict:
    """Rows of different lengths whose old log-probs are the current ones plus noise (the clips bind)."""
    generator = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, COMPLETION_LEN + 1, (ROWS,), generator=generator)
    prompt_lengths = torch.randint(1, PROMPT_LEN + 1, (ROWS,), generator=generator)
    batch = {
        "prompt_ids": torch.randint(3, model.config.vocab_size, (ROWS, PROMPT_LEN), generator=generator),
        "prompt_mask": (torch.arange(PROMPT_LEN)[None, :] >= PROMPT_LEN - prompt_lengths[:, None]).long(),
        "completion_ids": torch.randint(3, model.config.vocab_size, (ROWS, COMPLETION_LEN), generator=generator),
        "completion_mask": (torch.arange(COMPLETION_LEN)[None, :] < lengths[:, None]).long(),
        "advantages": torch.randn(ROWS, generator=generator),
    }
    batch["num_items_in_batch"] = batch["completion_mask"].sum()
    noise = 0.4 * torch.randn(ROWS, COMPLETION_LEN, generator=generator)
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, PROMPT_LEN - 1 : -1]
        logps = torch.log_softmax(logits.float(), -1).gather(-1, batch["completion_ids"].unsqueeze(-1)).squeeze(-1)
    batch["old_per_token_logps"] = logps + noise
    return batch


def optimizer_step(trainer: DAPOTrainer, planned: list[dict]) -> tuple[float, dict[str, torch.Tensor]]:
    """One optimizer step over its planned micro-batches as `Trainer.training_step` runs them (gradients synced on
    the last micro-batch only): the summed loss and the accumulated gradient."""
    trainer.current_gradient_accumulation_steps = len(planned)
    state = trainer.accelerator.gradient_state
    total = 0.0
    for index, batch in enumerate(planned):
        state._set_sync_gradients(index == len(planned) - 1)
        loss = trainer.compute_loss(trainer.model, batch)
        loss.backward()
        total += loss.item()
    state._set_sync_gradients(True)
    gradients = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    return total, gradients


def split_and_whole(tmp_path, model_dir: str, **settings) -> list[tuple[DAPOTrainer, float, dict]]:
    """The same micro-batch trained whole and under the budget: [(trainer, loss, gradient)] for each."""
    return [budget_run(tmp_path, model_dir, budget, **settings) for budget in (None, BUDGET)]


def budget_run(
    tmp_path, model_dir: str, budget: int | None, fillers: int = 0, **settings
) -> tuple[DAPOTrainer, float, dict]:
    """One optimizer step on `fixed_batch`; `fillers`: as many more passes than the budget needs, each a masked row
    (what a process runs when another needs more passes: `batching.split_for_budget`)."""
    trainer = trainer_for(tmp_path / f"{budget}-{fillers}", model_dir, budget, **settings)
    batch = fixed_batch(trainer.model)
    (planned,) = trainer._planner.plan([dict(batch)])
    assert (planned.get("backward_passes", 1) > 2) == (budget is not None)  # the budget really splits
    if fillers:
        planned["backward_passes"] = ROWS + fillers  # every row alone, then the fillers
        assert sum(FILLER_ROWS in part for part in trainer._planner.parts(planned)) == fillers
    return (trainer, *optimizer_step(trainer, [planned]))


def assert_same_update(runs) -> None:
    (_, whole_loss, whole), (_, split_loss, split) = runs
    assert split.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-6, rtol=1e-5, msg=name)
    assert split_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("loss_type", sorted(POLICY_LOSSES))
def test_entropy_bonus_under_a_budget_trains_the_unsplit_gradient(tmp_path, dense_dir, loss_type):
    """coef x the mean entropy of the micro-batch's loss tokens: each pass's mean weighs its share of them."""
    settings = {"loss_type": loss_type, "entropy_coef": 0.5, **LOSS_SETTINGS.get(loss_type, {})}
    assert_same_update(split_and_whole(tmp_path, dense_dir, **settings))


@pytest.mark.parametrize("loss_type", sorted(POLICY_LOSSES))
def test_router_aux_loss_under_a_budget_trains_the_unsplit_gradient(tmp_path, moe_dir, loss_type):
    """A MoE router's load-balancing loss of the micro-batch (its tokens' loads, `algorithm.router_aux`), with an
    entropy bonus: each pass trains its part of the micro-batch's loss, and the metric logs the micro-batch's loss."""
    settings = {"loss_type": loss_type, "router_aux_loss_coef": 1.0, "entropy_coef": 0.5}
    runs = split_and_whole(tmp_path, moe_dir, **settings, **LOSS_SETTINGS.get(loss_type, {}))
    assert all(trainer.aux_loss_enabled and trainer._forwards.router_loads for trainer, _, _ in runs)
    assert_same_update(runs)
    (whole_metric,), (split_metric,) = (trainer._metrics["train"]["aux_loss"] for trainer, _, _ in runs)
    assert split_metric == pytest.approx(whole_metric, rel=1e-5)


def test_filler_rows_add_nothing_to_the_router_loss(tmp_path, moe_dir):
    """A pass of filler rows (a process needing fewer passes than another; under sequence parallelism, a process
    without a row in the group's pass) feeds a token no router load counts: the micro-batch's router loss is
    unchanged."""
    settings = {"router_aux_loss_coef": 1.0, "entropy_coef": 0.5}
    runs = [budget_run(tmp_path, moe_dir, budget, fillers, **settings) for budget, fillers in ((None, 0), (BUDGET, 2))]
    assert_same_update(runs)


def test_the_passes_own_router_losses_are_not_the_micro_batchs(tmp_path, moe_dir, monkeypatch):
    """Why each pass needs the micro-batch's router load: the passes' own load-balancing losses, even weighted by
    their share of the tokens, train the routers another gradient (and this file's aux tests can fail)."""
    settings = {"router_aux_loss_coef": 1.0}
    _, _, whole = budget_run(tmp_path, moe_dir, None, **settings)
    measure = PolicyLossStep.begin_micro_batch  # as if one pass: the micro-batch's load is not measured
    monkeypatch.setattr(PolicyLossStep, "begin_micro_batch", lambda self, model, parts: measure(self, model, parts[:1]))
    _, _, split = budget_run(tmp_path, moe_dir, BUDGET, **settings)
    differs = [name for name in whole if not torch.allclose(split[name], whole[name], atol=1e-6, rtol=1e-5)]
    assert any("mlp.gate" in name for name in differs), differs  # the routers' (and what feeds them)


def test_adaptive_entropy_controller_steps_once_per_optimizer_step_under_a_budget(tmp_path, dense_dir):
    """Two optimizer steps of two micro-batches each (gradient accumulation), whole and under the budget: the same
    gradients and the same controller moves, one per optimizer step, from each step's exact mean entropy."""
    delta, start = 0.01, 0.05
    settings = {"use_adaptive_entropy": True, "entropy_coef": start, "entropy_coef_delta": delta}
    settings |= {"entropy_target": 100.0, "gradient_accumulation_steps": 2}  # the tiny model is below: coef rises
    runs = []
    for budget in (None, BUDGET):
        trainer = trainer_for(tmp_path / str(budget), dense_dir, budget, **settings)
        batch = fixed_batch(trainer.model)
        halves = [
            {key: value[rows] for key, value in batch.items() if value.dim()} for rows in (slice(0, 4), slice(4, 8))
        ]
        for half in halves:
            half["num_items_in_batch"] = batch["num_items_in_batch"]  # the step's loss tokens
        steps = []
        for _ in range(2):
            loss, gradients = optimizer_step(trainer, trainer._planner.plan([dict(half) for half in halves]))
            steps.append({"loss": loss, "coef": trainer.entropy_coef, "entropy": trainer._last_world_entropy})
            steps[-1]["gradients"] = gradients
        runs.append((steps, list(trainer._metrics["train"]["entropy_coef"])))
    (whole, whole_logged), (split, split_logged) = runs
    assert [step["coef"] for step in whole] == pytest.approx([start + delta, start + 2 * delta])  # once per step
    assert whole_logged == pytest.approx([start + delta, start + 2 * delta])  # logged once per step
    assert split_logged == pytest.approx(whole_logged)
    for whole_step, split_step in zip(whole, split, strict=True):
        assert split_step["coef"] == pytest.approx(whole_step["coef"], abs=1e-9)
        assert split_step["entropy"] == pytest.approx(whole_step["entropy"], rel=1e-6)
        assert split_step["loss"] == pytest.approx(whole_step["loss"], rel=1e-5, abs=1e-6)
        for name, gradient in whole_step["gradients"].items():
            torch.testing.assert_close(split_step["gradients"][name], gradient, atol=1e-6, rtol=1e-5, msg=name)
