"""The whole loop learns: on a toy task with a learnable reward the mean reward rises clearly.

Reward = +1 / -1 per completion by the share of its tokens with an even id; a random-init model starts near 0
and can learn it only if the advantage sign, the clipped loss and the optimizer step all point the right way.
"""

import statistics

import pytest
from datasets import Dataset

from dapo_trl import DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model

from .helpers import tiny_config

pytestmark = pytest.mark.e2e


def even_token_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    return [2.0 * sum(1 for t in ids if t % 2 == 0) / max(len(ids), 1) - 1.0 for ids in completion_ids]


def test_mean_reward_rises(tmp_path):
    model_dir = build_tiny_model(tmp_path / "tiny")
    dataset = Dataset.from_list([{"prompt": f"Count to {i}.", "solution": str(i)} for i in range(64)])
    config = tiny_config(
        tmp_path / "run",
        per_device_train_batch_size=16,
        num_generations=8,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_steps=30,
        apply_overlong_penalty=False,
        seed=0,
    )
    trainer = DAPOTrainer(model=str(model_dir), reward_funcs=even_token_reward, args=config, train_dataset=dataset)
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    print("mean reward per step:", [round(r, 3) for r in rewards])
    assert len(rewards) == 30
    start, end = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    assert end > start + 0.5, f"reward did not rise: first steps {rewards[:5]}, last steps {rewards[-5:]}"
