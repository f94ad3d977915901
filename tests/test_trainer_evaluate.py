"""`DAPOTrainer.evaluate()`: TRL's evaluation for every eval set and reward form GRPOTrainer takes, plus DAPO's avg@n /
pass@k (sampled with the eval settings, through the tool loop with tools) when the eval rows carry answers."""

import json
import sys
from collections import Counter

import pytest
from datasets import Dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer, Qwen2Config

from dapo_trl import DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model

from .helpers import tiny_config

pytestmark = pytest.mark.e2e

SOURCES = ["easy", "hard", "easy"]


def eval_rows(with_answers: bool = True) -> list[dict]:
    rows = [{"prompt": [{"role": "user", "content": f"q{i}"}], "data_source": kind} for i, kind in enumerate(SOURCES)]
    return [{**row, "solution": "1"} for row in rows] if with_answers else rows


def source_reward(completions, data_source, **kwargs):
    """Correct for every 'easy' response, wrong for every 'hard' one: known avg@n and pass@k."""
    return [1.0 if source == "easy" else -1.0 for source in data_source]


async def async_source_reward(completions, data_source, **kwargs):
    return source_reward(completions, data_source)


def build_trainer(tmp_path, trainer_class=DAPOTrainer, reward_funcs=source_reward, eval_dataset=None, **overrides):
    settings = {"eval_num_samples": 2, "eval_max_new_tokens": 6, "per_device_eval_batch_size": 2, **overrides}
    config = tiny_config(tmp_path / "out", **settings)
    return trainer_class(
        model=str(build_tiny_model()),
        reward_funcs=reward_funcs,
        args=config,
        train_dataset=Dataset.from_list(eval_rows() * 4),
        eval_dataset=Dataset.from_list(eval_rows()) if eval_dataset is None else eval_dataset,
    )


def validation_keys(metrics: dict, prefix: str = "eval") -> set[str]:
    return {key for key in metrics if key.startswith(f"{prefix}_") and ("/avg@" in key or "/pass@" in key)}


def assert_validated(metrics: dict, prefix: str = "eval", n: int = 2) -> None:
    assert metrics[f"{prefix}_easy/avg@{n}"] == 1.0 and metrics[f"{prefix}_hard/pass@{n}"] == 0.0
    assert metrics[f"{prefix}_all/avg@{n}"] == pytest.approx(2 / 3) and metrics[f"{prefix}_all/num_prompts"] == 3


class RecordingTrainer(DAPOTrainer):
    """Records the sampling settings of every generation call and the groups each reward call sees."""

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs):
        config = self.generation_config
        self.calls.append((num_generations, config.top_p, config.temperature, config.max_new_tokens))
        return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, *args, **kwargs)


def test_trl_metrics_and_validation_sampled_with_the_eval_settings(tmp_path):
    RecordingTrainer.calls = []
    trainer = build_trainer(
        tmp_path, RecordingTrainer, num_generations_eval=4, per_device_eval_batch_size=4, eval_top_p=0.7, top_p=0.9
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == 0.0 and "eval_reward" in metrics and "eval_rewards/source_reward/mean" in metrics
    assert metrics["eval_completions/mean_length"] == 8  # TRL's eval: max_completion_length, the random model
    assert_validated(metrics)
    assert metrics["eval_sampling/completions/mean_length"] == 6  # validation: eval_max_new_tokens
    # validation first (eval_num_samples=2, eval_top_p, eval_max_new_tokens), then TRL's loop (num_generations_eval=4)
    validation, trl_eval = set(RecordingTrainer.calls[:1]), set(RecordingTrainer.calls[1:])
    assert validation == {(2, 0.7, 1.0, 6)} and trl_eval == {(4, 0.9, 1.0, 8)}
    assert (trainer.num_generations_eval, trainer.generation_config.top_p, trainer.max_completion_length) == (4, 0.9, 8)
    logged = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert len(logged) == 1 and validation_keys(logged[0]) == validation_keys(metrics)  # logged once, together
    assert not trainer._metrics["eval"] and not trainer._metrics["train"]


def test_reward_model_as_the_reward(tmp_path):
    model_dir = build_tiny_model()
    reward_dir = tmp_path / "reward_model"
    config = Qwen2Config.from_pretrained(model_dir, num_labels=1)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(reward_dir)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(reward_dir)
    trainer = build_trainer(tmp_path, reward_funcs=[str(reward_dir), source_reward])
    name = trainer.reward_func_names[0]
    metrics = trainer.evaluate()  # the accuracy reward (the first) is a model: TRL's metrics only
    assert f"eval_rewards/{name}/mean" in metrics and "eval_rewards/source_reward/mean" in metrics
    assert "eval_reward" in metrics and "eval_loss" in metrics and not validation_keys(metrics)
    trainer.accuracy_reward_index = 1  # as accuracy_reward_name="source_reward" would pick
    metrics = trainer.evaluate()
    assert f"eval_rewards/{name}/mean" in metrics
    assert_validated(metrics)


def test_iterable_eval_set(tmp_path):
    trainer = build_trainer(tmp_path, eval_dataset=Dataset.from_list(eval_rows()).to_iterable_dataset())
    metrics = trainer.evaluate()
    assert "eval_loss" in metrics and "eval_rewards/source_reward/mean" in metrics
    assert_validated(metrics)


def test_dict_of_eval_sets_each_under_its_own_name(tmp_path):
    hard_chat = [{"prompt": [{"role": "user", "content": f"c{i}"}], "data_source": "hard"} for i in range(2)]
    eval_sets = {
        "math": Dataset.from_list(eval_rows()),  # rewards 1, -1, 1: mean 1/3
        "chat": Dataset.from_list(hard_chat).to_iterable_dataset(),  # no answers, every reward -1
    }
    trainer = build_trainer(tmp_path, eval_dataset=eval_sets)
    metrics = trainer.evaluate()
    # reward = source_reward + the overlong penalty (-1: TRL's eval completions all reach max_completion_length)
    assert metrics["eval_math_reward"] == pytest.approx(1 / 3 - 1) and metrics["eval_chat_reward"] == -2.0
    assert metrics["eval_math_rewards/source_reward/mean"] == pytest.approx(1 / 3)
    assert metrics["eval_chat_rewards/source_reward/mean"] == -1.0
    assert metrics["eval_math_completions/mean_length"] == metrics["eval_chat_completions/mean_length"] == 8
    # nothing un-prefixed that a later set would overwrite
    assert all(key == "epoch" or key.startswith(("eval_math_", "eval_chat_")) for key in metrics), sorted(metrics)
    assert_validated(metrics, "eval_math")
    assert not validation_keys(metrics, "eval_chat") and not validation_keys(metrics, "eval_all")
    math, chat = [entry for entry in trainer.state.log_history if any(key.endswith("_loss") for key in entry)]
    assert "eval_math_easy/avg@2" in math and math["eval_math_reward"] == pytest.approx(1 / 3 - 1)
    assert chat["eval_chat_reward"] == -2.0 and not validation_keys(chat)
    assert not any(key.startswith("eval_math_") for key in chat) and not any("chat" in key for key in math)
    assert (tmp_path / "out" / "eval_samples" / "step_000000_math.jsonl").exists()


def test_async_accuracy_reward(tmp_path):
    trainer = build_trainer(tmp_path, reward_funcs=async_source_reward)
    metrics = trainer.evaluate()
    assert metrics["eval_rewards/async_source_reward/mean"] == pytest.approx(1 / 3)
    assert_validated(metrics)


def test_eval_on_start_with_val_before_train_evaluates_once_at_step_0(tmp_path):
    trainer = build_trainer(tmp_path, eval_on_start=True, eval_strategy="steps", eval_steps=1, val_before_train=True)
    trainer.train()
    evaluations = [entry for entry in trainer.state.log_history if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [0, 1]
    for entry in evaluations:
        assert "eval_rewards/source_reward/mean" in entry
        assert_validated(entry)


# ------------------------------------------------------------------------------------------------- tools
TOOL_CALLS: list[tuple[int, int]] = []


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    TOOL_CALLS.append((a, b))
    return a + b


def used_the_tool(completions, **kwargs):
    """Correct when the response holds the tool's reply: only a multi-turn rollout can."""
    return [1.0 if any(message["role"] == "tool" for message in messages) else -1.0 for messages in completions]


class ScriptedToolCallTrainer(DAPOTrainer):
    """The random model never writes a tool call: every first turn calls `add`, the turn after the reply answers."""

    def _generate_single_turn(self, prompt_ids, *args, **kwargs):
        call = json.dumps({"name": "add", "arguments": {"a": 2, "b": 3}}, separators=(",", ":"))
        text = f"<tool_call>\n{call}\n</tool_call><|im_end|>" if self._tool_runtime.turn == 0 else "Answer: 5<|im_end|>"
        ids = self.processing_class(text, add_special_tokens=False)["input_ids"]
        self._tool_runtime.on_turn(prompt_ids, [ids] * len(prompt_ids))
        return [list(ids) for _ in prompt_ids], None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="as the other tool runs")
def test_validation_samples_through_the_tool_loop(tmp_path):
    from trl.chat_template_utils import qwen2_5_chat_template

    TOOL_CALLS.clear()
    model_dir = build_tiny_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen2_5_chat_template  # Hermes tool calls, as the tool runs use
    config = tiny_config(
        tmp_path / "out",
        eval_num_samples=2,
        eval_max_new_tokens=96,
        max_completion_length=96,
        per_device_eval_batch_size=2,
        max_tool_calling_iterations=1,
    )
    trainer = ScriptedToolCallTrainer(
        model=str(model_dir),
        reward_funcs=used_the_tool,
        args=config,
        train_dataset=Dataset.from_list(eval_rows() * 4),
        eval_dataset=Dataset.from_list(eval_rows()),
        processing_class=tokenizer,
        tools=[add],
    )
    trainer.model.train()  # as during training (val_before_train, eval_steps): the tool metrics must still be eval's
    metrics = trainer.evaluate()
    # validation: 2 calls of 2 prompts (the last one padding) x 2 samples; TRL's loop: 3 prompts x 2 generations
    assert Counter(TOOL_CALLS) == {(2, 3): 8 + 6}
    assert metrics["eval_all/avg@2"] == 1.0  # the accuracy reward saw the tool's reply in every response
    assert metrics["eval_sampling/tools/call_frequency"] == 1.0
    assert metrics["eval_sampling/tools/rounds_per_response"] == 1.0
    assert metrics["eval_tools/call_frequency"] == 1.0  # TRL's eval, kept apart
    assert not trainer._metrics["train"]
    samples = (tmp_path / "out" / "eval_samples" / "step_000000.jsonl").read_text().splitlines()
    assert all("<tool_response>\n5\n</tool_response>" in text for s in samples for text in json.loads(s)["completions"])
