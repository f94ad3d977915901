"""The token-level loss denominator is exact per optimizer step, whatever the process / accumulation layout.

Each run trains one SGD step (lr 1) on the same fixed 16-row batch, so the parameter update is minus the gradient.
The reference is paper Eq. 11 written out: at the first step r = 1, so the gradient of the clipped surrogate is
-(1 / sum_i |o_i|) * sum_i sum_t A_i * grad log pi(o_it), over exactly the rows of that optimizer step.
"""

import pytest
import torch

from .helpers import assert_update_is_minus_gradient, reference_gradient, run_layout
from .scripts.denominator_run import fixed_global_batch

pytestmark = pytest.mark.e2e


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
