"""The token-level loss denominator is exact per optimizer step, whatever the process / accumulation layout.

Each run trains one SGD step (lr 1) on the same fixed 16-row batch, so the parameter update is minus the gradient.
The reference is paper Eq. 11 written out: at the first step r = 1, so the gradient of the clipped surrogate is
-(1 / sum_i |o_i|) * sum_i sum_t A_i * grad log pi(o_it), over exactly the rows of that optimizer step.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM

from .helpers import SCRIPTS, python_command, run_command
from .scripts.denominator_run import fixed_global_batch

pytestmark = pytest.mark.e2e
SCRIPT = str(SCRIPTS / "denominator_run.py")


def reference_gradient(model_dir, rows: list[int], inert: list[bool] | None = None) -> dict[str, torch.Tensor]:
    """Eq. 11's gradient over `rows` of the fixed batch (repeats allowed); rows marked `inert` have advantage 0 but
    their tokens still count in the denominator."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = fixed_global_batch(model.config.vocab_size)
    select = torch.tensor(rows)
    prompt_ids, completion_ids = batch["prompt_ids"][select], batch["completion_ids"][select]
    mask = (batch["completion_mask"][select] * batch["tool_mask"][select]).float()
    advantages = batch["advantages"][select]
    if inert is not None:
        advantages = advantages.masked_fill(torch.tensor(inert), 0.0)
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
    attention = torch.cat([batch["prompt_mask"][select], batch["completion_mask"][select]], dim=1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt_ids.size(1) - 1 : -1]
    logps = torch.log_softmax(logits.float(), dim=-1).gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)
    objective = (advantages[:, None] * logps * mask).sum() / mask.sum()
    (-objective).backward()
    return {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def run_layout(tmp_path, processes: int, accumulation: int, steps_per_generation: int, *overrides: str, **launch):
    """One optimizer step in the given layout (extra `key=value` DAPOConfig overrides); (update, rows, model dir)."""
    out = tmp_path / "_".join([f"p{processes}k{accumulation}s{steps_per_generation}", *overrides]).replace("=", "-")
    arguments = [str(out), str(accumulation), str(steps_per_generation), *overrides]
    run_command(python_command(SCRIPT, *arguments, num_processes=processes, **launch))
    delta = torch.load(out / "delta.pt")
    rows = []
    for rank in range(processes):
        for micro_batch in torch.load(out / f"rows_rank{rank}.pt")["rows"]:
            rows.extend(micro_batch)
    return delta, rows, out / "model"


def assert_update_is_minus_gradient(delta, gradient):
    for name, grad in gradient.items():
        torch.testing.assert_close(delta[name], -grad, atol=2e-5, rtol=2e-3, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize(
    "processes,accumulation,steps_per_generation",
    [(1, 4, 4), (1, 2, 4), (2, 2, 2), (2, 1, 2)],
    ids=["1proc-K4-S4", "1proc-K2-S4", "2proc-K2-S2", "2proc-K1-S2"],
)
def test_update_matches_eq11_over_the_optimizer_step(tmp_path, processes, accumulation, steps_per_generation):
    delta, rows, model_dir = run_layout(tmp_path, processes, accumulation, steps_per_generation)
    expected_rows = 16 * accumulation // steps_per_generation
    assert len(rows) == len(set(rows)) == expected_rows
    assert_update_is_minus_gradient(delta, reference_gradient(model_dir, rows))


def test_one_process_times_four_equals_two_processes_times_two(tmp_path):
    delta_1x4, rows_1x4, _ = run_layout(tmp_path, 1, 4, 4)
    delta_2x2, rows_2x2, _ = run_layout(tmp_path, 2, 2, 2)
    assert sorted(rows_1x4) == sorted(rows_2x2) == list(range(16))
    for name in delta_1x4:
        torch.testing.assert_close(delta_1x4[name], delta_2x2[name], atol=2e-5, rtol=2e-3)


@pytest.mark.parametrize("processes", [1, 2], ids=["1proc", "2proc"])
def test_an_optimizer_step_spanning_two_generation_batches_is_exact(tmp_path, processes):
    """steps_per_generation=3, gradient_accumulation_steps=2: optimizer step 2 trains micro-batch 3 of generation 0
    and micro-batch 1 of generation 1, which TRL generates only in the middle of that step. DAPOTrainer generates it
    at the step's start, so the step's denominator is its exact token count.

    Generation 0 has zero advantages: step 1 changes nothing (plain SGD), so step 2 starts from the initial weights
    (ratio 1) and the whole update is step 2's: generation 0's rows add nothing to its numerator and their tokens to
    its denominator. TRL's own normaliser would divide each half by its generation's count x K / S instead.
    """
    per_device = 4 // processes  # 12 rows per generation batch: 3 micro-batches of 4 global rows
    overrides = (f"per_device_train_batch_size={per_device}", "max_steps=2", "zero_first_generation=true")
    delta, _, model_dir = run_layout(tmp_path, processes, 2, 3, *overrides)
    out = model_dir.parent
    window, items = [], set()
    for rank in range(processes):
        micro_batches = torch.load(out / f"rows_rank{rank}.pt")["micro_batches"]
        assert len(micro_batches) == 4
        window.extend(micro_batches[2]["rows"] + micro_batches[3]["rows"])  # optimizer step 2
        items.update(micro_batches[index]["num_items"] for index in (2, 3))
    assert {generation for generation, _ in window} == {0, 1}  # the step spans both generation batches
    rows = [row for _, row in window]
    batch = fixed_global_batch(500)
    tokens = sum(int((batch["completion_mask"][row] * batch["tool_mask"][row]).sum()) for row in rows)
    (num_items,) = items  # every process, both micro-batches: one count, the step's exact count (x S / K for TRL)
    assert num_items == pytest.approx(tokens * 3 / 2)
    gradient = reference_gradient(model_dir, rows, inert=[generation == 0 for generation, _ in window])
    assert_update_is_minus_gradient(delta, gradient)
