"""OptimizerSteps against a plain simulation of the Trainer loop: which generation batches exist when, and each
optimizer step's exact token count, for every steps_per_generation / gradient_accumulation_steps / num_iterations."""

from types import SimpleNamespace

import pytest
import torch

from dapo_trl.training.step.steps import OptimizerSteps


def tokens_of(generation: int, index: int) -> float:
    return float(10 * generation + index + 1)


@pytest.mark.parametrize(
    "S,K,iterations,window_lengths",
    [(3, 2, 1, [2] * 6), (2, 3, 2, [3] * 4), (4, 2, 1, [2] * 4), (1, 3, 1, [3] * 3), (3, 2, 1, [2, 2, 1, 2, 2, 1])],
    ids=["S3-K2", "S2-K3-mu2", "S4-K2", "S1-K3", "S3-K2-epoch-remainders"],
)
def test_every_optimizer_step_gets_its_exact_token_count(S, K, iterations, window_lengths):
    generate_every = S * iterations
    args = SimpleNamespace(steps_per_generation=S, gradient_accumulation_steps=K, num_iterations=iterations)
    steps = OptimizerSteps(args, "cpu", exact_denominator=True)
    made = []  # (micro-step at which the generation was made, the micro-step it starts at)
    spared = {}  # made at micro-step -> the ids of the micro-batches still in use then (routing replay spares them)
    handed = []  # (micro-step, id, whether OptimizerSteps calls it the micro-batch's last use)

    def generate(step, prompts):
        made.append((current, step))
        spared.setdefault(current, set()).update(batch["id"] for batch in steps.in_use())
        return [{"loss_tokens": tokens_of(prompts, index), "id": (prompts, index)} for index in range(S)]

    current = 0
    for length in window_lengths:
        start = current
        # TRL's dataloader repeats each generation batch's prompts for its S x num_iterations micro-steps.
        batches = [(start + offset) // generate_every for offset in range(length)]
        steps.begin(start, batches)
        ids = []
        for current in range(start, start + length):
            inputs = steps.micro_batch(current, generate)
            ids.append(inputs["id"])
            handed.append((current, inputs["id"], steps.last_use(current)))
            expected_id = (current // generate_every, current % S)
            assert inputs["id"] == expected_id  # TRL's buffer slot for this micro-step
        exact = sum(tokens_of(*identifier) for identifier in ids)
        assert steps.tokens == exact
        assert inputs["num_items_in_batch"] == pytest.approx(torch.tensor(exact * S / length))
        current = start + length
    # Each generation batch is made at the first micro-step of the optimizer step it starts in, never later.
    for made_at, first_used in made:
        assert made_at <= first_used and first_used % generate_every == 0
    assert [first for _, first in made] == sorted({k // generate_every * generate_every for k in range(current)})
    # A micro-batch's last use is its last hand-out (its last PPO epoch), and nothing else is.
    last_hand_out = {identifier: step for step, identifier, _ in handed}
    assert [last for _, _, last in handed] == [last_hand_out[identifier] == step for step, identifier, _ in handed]
    # Whenever a generation batch is made, every micro-batch handed out later that was made earlier is spared.
    for made_at, _ in made:
        later = {identifier for step, identifier, _ in handed if step >= made_at}
        earlier = {identifier for step, identifier, _ in handed if step < made_at} | spared[made_at]
        assert later & earlier <= spared[made_at]


def test_a_micro_step_outside_the_announced_optimizer_step_is_refused():
    args = SimpleNamespace(steps_per_generation=2, gradient_accumulation_steps=2, num_iterations=1)
    steps = OptimizerSteps(args, "cpu", exact_denominator=False)
    with pytest.raises(RuntimeError, match="get_batch_samples"):
        steps.micro_batch(0, lambda step, prompts: [])
