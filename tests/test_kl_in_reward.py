"""KL in the reward (verl's use_kl_in_reward): the estimators, the adaptive controller, and the trainer's rewards,
advantages, metrics and checkpoints against references computed here from the formulas, with models of our own."""

import copy
import math

import numpy as np
import pytest
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.algorithm import adaptive_kl_coef, kl_penalty_per_token
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.training.sampling.kl_in_reward import (
    KL_CONTROLLER_STATE_FILE,
    KLController,
    policy_and_reference_log_probs,
)
from dapo_trl.training.sampling.shaping import GenerationRecord, ShapingColumns
from dapo_trl.training.trl_seam import GenerationOutput

from .helpers import tiny_config


# ------------------------------------------------------------------------------------------------ estimators
def reference_estimate(logp: float, ref_logp: float, estimator: str) -> float:
    """Schulman's estimators of KL(pi || pi_ref) from one sample, with verl's k3 clamps, written out per token."""
    log_ratio = ref_logp - logp  # log r, r = pi_ref / pi
    if estimator in ("kl", "k1"):
        return logp - ref_logp
    if estimator == "abs":
        return abs(logp - ref_logp)
    if estimator in ("mse", "k2"):
        return 0.5 * (logp - ref_logp) ** 2
    log_ratio = min(max(log_ratio, -20.0), 20.0)
    return min(max(math.exp(log_ratio) - log_ratio - 1.0, -10.0), 10.0)


@pytest.mark.parametrize("estimator", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_estimators_match_the_formulas(estimator):
    rng = np.random.default_rng(0)
    logps = rng.uniform(-30, 0, size=(6, 9))
    ref = np.concatenate([rng.uniform(-30, 0, size=(3, 9)), logps[3:] + rng.normal(0, 0.1, size=(3, 9))])
    got = kl_penalty_per_token(torch.tensor(logps), torch.tensor(ref), estimator)
    rows = zip(logps, ref, strict=True)
    expected = [[reference_estimate(a, b, estimator) for a, b in zip(r, q, strict=True)] for r, q in rows]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    if estimator in ("low_var_kl", "k3"):  # the clamps are hit: far-apart log-probs give 10 exactly
        assert got.max().item() == 10.0 and got.min().item() >= 0.0


def test_unknown_estimator_is_refused_by_name():
    with pytest.raises(ValueError, match="kl_in_reward_estimator='full'"):
        DAPOConfig(output_dir="/tmp/x", kl_in_reward=True, kl_in_reward_estimator="full")
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        kl_penalty_per_token(torch.zeros(1), torch.zeros(1), "k4")


# ------------------------------------------------------------------------------------------------ controller
def test_adaptive_controller_follows_verl_update():
    coef, target, horizon = 0.05, 0.1, 1000
    values = [coef]
    for kl, n in [(0.3, 64), (0.1, 64), (0.09, 128), (0.0, 64), (0.2, 10)]:
        error = float(np.clip(kl / target - 1, -0.2, 0.2))  # verl: proportional_error, then value *= mult
        values.append(values[-1] * (1 + error * n / horizon))
    controller = KLController(coef, "adaptive", target, horizon)
    got = [controller.value]
    for kl, n in [(0.3, 64), (0.1, 64), (0.09, 128), (0.0, 64), (0.2, 10)]:
        controller.update(kl, n)
        got.append(controller.value)
    assert got == pytest.approx(values, rel=1e-12)
    assert adaptive_kl_coef(1.0, 5.0, 0.1, 10, 10) == pytest.approx(1.2)  # clipped at +20% per horizon
    fixed = KLController(0.05, "fixed")
    fixed.update(10.0, 1000)
    assert fixed.value == 0.05
    restored = KLController(0.05, "adaptive")
    restored.load_state_dict(controller.state_dict())
    assert restored.value == controller.value
    refixed = KLController(0.3, "fixed")  # a resumed run with a new fixed beta uses the new one
    refixed.load_state_dict(controller.state_dict())
    assert refixed.value == 0.3


def test_kl_column_is_training_only():
    class Column:
        def __init__(self, train_only):
            self.train_only = train_only

    columns = ShapingColumns([Column(False), Column(True)])
    assert len(columns.active(training=True)) == 2 and len(columns.active(training=False)) == 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"kl_in_reward_coef": -0.1}, "kl_in_reward_coef=-0.1"),
        ({"kl_in_reward_controller": "pid"}, "kl_in_reward_controller='pid'"),
        ({"kl_in_reward_target": 0.0}, "kl_in_reward_target=0.0"),
        ({"multi_objective_aggregation": "normalize_then_sum"}, "kl_in_reward with multi_objective_aggregation"),
    ],
)
def test_bad_kl_settings_name_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        DAPOConfig(output_dir="/tmp/x", kl_in_reward=True, **overrides)


# ------------------------------------------------------------------------------------------------- end to end
def token_reward(completion_ids, **kwargs):
    """Deterministic and spread within a group (0..6), so the group std is not the KL penalty's alone."""
    return [float(sum(ids) % 7) for ids in completion_ids]


class RecordingTrainer(DAPOTrainer):
    """Keeps every scored generation batch (rows as generated, unpadded, and TRL's advantages) with the reference
    KL of each row, computed right there by `reference_kl_rewards` from a copy of the sampling policy and the test's
    own reference model (CPU kernels can change after a backward pass: compare numbers computed alike)."""

    def _generate_and_score_completions(self, inputs):
        policy = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval()
        if hasattr(policy, "merge_and_unload"):  # PEFT: the policy is the base with the adapter merged in
            policy = policy.merge_and_unload()
        self.policy_forwards = self.adapter_off_forwards = 0
        output = super()._generate_and_score_completions(inputs)
        prompt_ids, completion_ids = self._generation.output[:2]  # TRL `_generate`'s output
        kl = reference_kl_rewards(policy, self.reference, prompt_ids, completion_ids, self.args.kl_in_reward_estimator)
        self.batches.append((completion_ids, output["advantages"], *kl))
        return output

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        """Counts the no-grad forwards of `self.model`: with the adapter on (the policy) or off (a PEFT reference)."""
        if model is self.model and not torch.is_grad_enabled():
            off = any(getattr(module, "disable_adapters", None) is True for module in model.modules())
            self.adapter_off_forwards += off
            self.policy_forwards += not off
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)


def kl_trainer(tmp_path, **overrides) -> RecordingTrainer:
    peft_config = overrides.pop("peft_config", None)
    settings = {
        "kl_in_reward": True,
        "filter_groups_enable": False,
        "apply_overlong_penalty": False,
        "max_completion_length": 10,
        "temperature": 1.0,
        **overrides,
    }
    prompts = [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(8)]
    trainer = RecordingTrainer(
        model=str(build_tiny_model()),
        reward_funcs=token_reward,
        args=tiny_config(tmp_path / "out", **settings),
        train_dataset=Dataset.from_list(prompts),
        peft_config=peft_config,
    )
    trainer.batches, trainer.reference = [], AutoModelForCausalLM.from_pretrained(str(build_tiny_model())).eval()
    with torch.no_grad():  # the policy leaves the reference (the model on disk), so the KL is not zero
        generator = torch.Generator().manual_seed(1)
        for name, parameter in trainer.model.named_parameters():
            if peft_config is None or "lora_" in name:  # PEFT: only the adapter moves, the base stays
                parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return trainer


def completion_log_probs(model, prompt: torch.Tensor, completion: torch.Tensor) -> torch.Tensor:
    """log pi(completion token | its prefix), one unpadded sequence at a time."""
    ids = torch.cat([prompt, completion]).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, prompt.numel() - 1 : -1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, completion.unsqueeze(1)).squeeze(1)


def reference_kl_rewards(policy, reference, prompts, completions, estimator: str) -> tuple[list[float], list[float]]:
    """Per response: the summed KL estimate over its tokens, and its mean per token (verl's masked_mean)."""
    sums, means = [], []
    for prompt, completion in zip(prompts, completions, strict=True):
        prompt, completion = torch.tensor(prompt), torch.tensor(completion)
        logp = completion_log_probs(policy, prompt, completion).tolist()
        ref = completion_log_probs(reference, prompt, completion).tolist()
        per_token = [reference_estimate(a, b, estimator) for a, b in zip(logp, ref, strict=True)]
        sums.append(sum(per_token))
        means.append(sum(per_token) / max(len(per_token), 1))
    return sums, means


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """TRL's scale_rewards='group': (r - group mean) / (group std, Bessel-corrected, + 1e-4)."""
    out = []
    for start in range(0, len(rewards), group):
        chunk = np.array(rewards[start : start + group])
        out.extend((chunk - chunk.mean()) / (chunk.std(ddof=1) + 1e-4))
    return out


@pytest.mark.parametrize("steps_per_generation", [1, 2])
def test_fixed_kl_in_reward_matches_a_reference_computation(tmp_path, steps_per_generation):
    """With steps_per_generation=2 TRL computes the old log-probs itself before scoring: the KL reuses them (one
    policy forward per batch, not two) and the result is the same."""
    beta, estimator = 0.5, "low_var_kl"
    trainer = kl_trainer(
        tmp_path,
        kl_in_reward_coef=beta,
        kl_in_reward_estimator=estimator,
        num_generations=4,
        steps_per_generation=steps_per_generation,
    )
    assert trainer.ref_model is not None and trainer.beta == 0.0 and trainer.args.beta == 0.0  # no KL loss
    trainer.train()
    assert trainer.policy_forwards == 1
    ((completions, advantages, sums, means),) = trainer.batches
    assert min(sums) > 0.05  # the perturbation moved the policy: the test is not comparing zeros
    penalised = [score - beta * kl for score, kl in zip(token_reward(completions), sums, strict=True)]
    expected = torch.tensor(group_advantages(penalised, 4), dtype=torch.float32)
    torch.testing.assert_close(advantages.float(), expected, atol=1e-4, rtol=0)
    logged = trainer.state.log_history[0]
    assert logged["kl/in_reward"] == pytest.approx(float(np.mean(means)), rel=1e-4)
    assert logged["kl/coef"] == beta and "kl" not in logged  # TRL's own "kl" is the KL loss's, off here
    assert logged["rewards/kl_in_reward/mean"] == pytest.approx(float(np.mean(sums)), rel=1e-4)
    assert trainer.reward_func_names == ["token_reward"]  # the user's list, unchanged


@pytest.mark.parametrize(
    ("steps_per_generation", "kl_loss"),
    [(1, 0.0), (2, 0.04)],
    ids=["no-kl-loss", "kl-loss-and-old-logps"],
)
def test_peft_kl_in_reward_uses_the_adapter_off_reference_and_reuses_trls_forwards(
    tmp_path, steps_per_generation, kl_loss
):
    """A LoRA policy: the reference is the base model (the model on disk, adapter off), here computed independently
    from the model on disk and a merged copy of the policy. With TRL's KL loss on (`beta` > 0) TRL's reference
    forward also runs on `trainer.model`, with the adapter off; the KL reuses it and TRL's old log-probs (with
    steps_per_generation=2), so each batch makes one adapter-on and one adapter-off forward, not two of either.
    Training moves the adapter only: the base weights stay those on disk."""
    beta, estimator = 0.5, "low_var_kl"
    lora = LoraConfig(r=8, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = kl_trainer(
        tmp_path,
        kl_in_reward_coef=beta,
        kl_in_reward_estimator=estimator,
        num_generations=4,
        steps_per_generation=steps_per_generation,
        beta=kl_loss,
        peft_config=lora,
    )
    assert trainer.ref_model is None and trainer.beta == kl_loss  # the reference is the adapter off
    adapter = {name: p.detach().clone() for name, p in trainer.model.named_parameters() if "lora_" in name}
    trainer.train()
    assert (trainer.policy_forwards, trainer.adapter_off_forwards) == (1, 1)
    parameters = dict(trainer.accelerator.unwrap_model(trainer.model).named_parameters())
    assert all(not torch.equal(parameters[name], before) for name, before in adapter.items())
    base = {
        name.replace("base_model.model.", "", 1).replace(".base_layer", ""): p
        for name, p in parameters.items()
        if "lora_" not in name
    }
    on_disk = dict(trainer.reference.named_parameters())
    assert base.keys() == on_disk.keys() and all(torch.equal(base[name], on_disk[name]) for name in base)
    ((completions, advantages, sums, means),) = trainer.batches
    assert min(sums) > 0.05  # the adapter moved the policy away from the base: not comparing zeros
    penalised = [score - beta * kl for score, kl in zip(token_reward(completions), sums, strict=True)]
    expected = torch.tensor(group_advantages(penalised, 4), dtype=torch.float32)
    torch.testing.assert_close(advantages.float(), expected, atol=1e-4, rtol=0)
    logged = trainer.state.log_history[0]
    assert logged["kl/in_reward"] == pytest.approx(float(np.mean(means)), rel=1e-4)
    assert ("kl" in logged) == (kl_loss > 0)  # TRL's KL loss, against the same adapter-off reference


def test_adaptive_coefficient_steps_per_generation_batch_and_resumes(tmp_path):
    coef, horizon, responses = 0.2, 10, 4
    common = {"kl_in_reward_coef": coef, "kl_in_reward_controller": "adaptive", "kl_in_reward_horizon": horizon}
    # A target far below the measured KL: each update multiplies beta by 1 + 0.2 * 4 / 10.
    common.update(kl_in_reward_target=1e-9, save_strategy="steps", save_steps=1, max_steps=2)
    trainer = kl_trainer(tmp_path, **common)
    trainer.train()
    coefs = [entry["kl/coef"] for entry in trainer.state.log_history if "kl/coef" in entry]
    growth = 1 + 0.2 * responses / horizon
    assert coefs == pytest.approx([coef, coef * growth])
    saved = torch.load(tmp_path / "out" / "checkpoint-1" / KL_CONTROLLER_STATE_FILE)
    assert saved["value"] == pytest.approx(coef * growth)

    resumed = kl_trainer(tmp_path, **common)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-1"))
    resumed_coefs = [entry["kl/coef"] for entry in resumed.state.log_history if "kl/coef" in entry]
    assert resumed_coefs[-1] == pytest.approx(coef * growth)  # step 2 uses the saved beta, not the start value


class ForwardRecorder:
    """Stands in for the trainer: records the padded batch each forward sees and which model it ran."""

    def __init__(self):
        one_process = {"device": torch.device("cpu"), "state": None, "distributed_type": "NO", "num_processes": 1}
        self.accelerator = type("Accelerator", (), one_process)()
        self._tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()
        self.args = type("Args", (), {"per_device_train_batch_size": 2, "sequence_parallel_size": 1})()
        self.model, self.ref_model, self.beta, self.calls = "policy", "reference", 0.0, []

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size):
        self.calls.append((model, input_ids, attention_mask, logits_to_keep))
        return torch.full((input_ids.size(0), logits_to_keep), -1.0 if model == "policy" else -2.0), None, None


def test_the_kl_covers_the_models_own_tokens_and_attends_to_tool_outputs():
    trainer = ForwardRecorder()
    output = GenerationOutput(
        [[5, 6, 7], [8]], [[9, 9, 9, 9], [3, 4]], [[1, 0, 0, 1], [1, 1]], None, None, {}, None, None
    )
    policy, reference, mask = policy_and_reference_log_probs(trainer, GenerationRecord(True, output))
    assert [call[0] for call in trainer.calls] == ["policy", "reference"]
    assert (policy[0, 0], reference[0, 0]) == (-1, -2)
    _, input_ids, attention_mask, keep = trainer.calls[0]
    assert input_ids.tolist() == [[5, 6, 7, 9, 9, 9, 9], [0, 0, 8, 3, 4, 0, 0]] and keep == 4  # TRL's layout
    assert attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0, 0]]  # tool outputs are context
    assert mask.tolist() == [[1, 0, 0, 1], [1, 1, 0, 0]]  # but not the model's tokens: no KL on them
    # TRL's own old log-probs of this very batch (same ids and mask) are reused: only the reference forward runs.
    recorded = (input_ids, attention_mask, torch.full((2, 4), -3.0))
    trainer.calls.clear()
    policy, _, _ = policy_and_reference_log_probs(trainer, GenerationRecord(True, output, recorded))
    assert [call[0] for call in trainer.calls] == ["reference"] and policy[0, 0] == -3.0
    other = (input_ids.flip(0), attention_mask.flip(0), torch.full((2, 4), -3.0))  # another batch: not reused
    trainer.calls.clear()
    policy_and_reference_log_probs(trainer, GenerationRecord(True, output, other))
    assert [call[0] for call in trainer.calls] == ["policy", "reference"]
    # With collective forwards (here a sequence-parallel group) a recorded forward is reused only where every
    # process can: another process without a match (the min over processes is 0) makes this one run its forward too.
    trainer.args.sequence_parallel_size = 2
    trainer.accelerator.reduce = lambda flag, reduction: torch.zeros_like(flag) if reduction == "min" else flag
    trainer.calls.clear()
    policy_and_reference_log_probs(trainer, GenerationRecord(True, output, recorded))
    assert [call[0] for call in trainer.calls] == ["policy", "reference"]
    trainer.args.sequence_parallel_size = 1
    with pytest.raises(ValueError, match="kl_in_reward does not support image inputs"):
        policy_and_reference_log_probs(trainer, GenerationRecord(True, output._replace(images=[["image"]])))
