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


def reference_gradient(model_dir, rows: list[int]) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    batch = fixed_global_batch(model.config.vocab_size)
    select = torch.tensor(rows)
    prompt_ids, completion_ids = batch["prompt_ids"][select], batch["completion_ids"][select]
    mask = (batch["completion_mask"][select] * batch["tool_mask"][select]).float()
    advantages = batch["advantages"][select]
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
