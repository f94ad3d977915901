"""DAPOConfig: GRPOConfig with the DAPO paper's defaults and the knobs DAPO adds."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from trl import GRPOConfig

from ..algorithm import POLICY_LOSSES, Aggregation
from .checks import check_all
from .derived import derive_dapo_fields, derive_platform_defaults

DEFAULT_LOSS_TYPE = "dapo"


def loss_type_help() -> str:
    """--loss_type's help, read from the loss table: its names (the default first), and what each averages over."""
    ordered = sorted(POLICY_LOSSES, key=lambda name: name != DEFAULT_LOSS_TYPE)
    names = ", ".join(f"{name!r} (default)" if name == DEFAULT_LOSS_TYPE else repr(name) for name in ordered)
    averages = "; ".join(
        f"{', '.join(name for name, loss in POLICY_LOSSES.items() if loss.aggregation is aggregation)}: "
        f"{aggregation.value}"
        for aggregation in Aggregation
        if any(loss.aggregation is aggregation for loss in POLICY_LOSSES.values())
    )
    return (
        f"Policy loss, a row of the loss table dapo_trl.algorithm.POLICY_LOSSES: {names}; a loss added with "
        "register_policy_loss is accepted too. What each averages its per-token terms over (K = micro-batches per "
        f"optimizer step): {averages}. Formulas and traits: docs/losses.md."
    )


@dataclass
class DAPOConfig(GRPOConfig):
    r"""
    Configuration for [`DAPOTrainer`]: every [`trl.GRPOConfig`] field, DAPO defaults, and DAPO's own knobs.

    Defaults that differ from `GRPOConfig` (paper, Section 5): `epsilon_high=0.28` (clip-higher),
    `weight_decay=0.1`, `report_to="tensorboard"`, `max_tool_calling_iterations=7` (ReTool's 8 turns); on a machine
    without a GPU, `use_cpu=True` and `bf16=False` (GRPOConfig would refuse to start there, or let
    `accelerate launch --multi_gpu` processes train unsynchronised).
    Already DAPO in TRL 1.16: `loss_type="dapo"`, `epsilon=0.2`, `beta=0.0`, `temperature=1.0`, `learning_rate=1e-6`.
    """

    # Overridden GRPOConfig / TrainingArguments defaults, and help texts that say what DAPO does with the field.
    loss_type: str = field(default=DEFAULT_LOSS_TYPE, metadata={"help": loss_type_help()})
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={
            "help": "Keyword arguments of transformers' AutoModelForCausalLM.from_pretrained (JSON on the command "
            'line: \'{"attn_implementation": "flash_attention_2"}\'). DAPOTrainer loads a model given as a hub id or '
            "folder with them, and the reference model (beta > 0 or kl_in_reward, without LoRA). train_dapo.py loads "
            "its model with them over the flags --model_revision, --dtype, --attn_implementation and "
            "--trust_remote_code: a flag left at its default gives way to the same key here; a flag set to another "
            "value than the key is refused."
        },
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={
            "help": "Where train_dapo.py resumes from (DAPOTrainer.train(resume_from_checkpoint=...) takes the same "
            "values): a checkpoint folder, or 'latest' (or 'true'): the newest complete checkpoint in output_dir, "
            "and a fresh start when there is none yet, so the same command can be requeued after a preemption. A "
            "checkpoint that is not complete is refused, naming what it lacks."
        },
    )
    epsilon_high: float | None = field(
        default=0.28,
        metadata={"help": "Upper clip bound epsilon_high of clip-higher (DAPO: 0.28). None means = epsilon."},
    )
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay (DAPO: 0.1)."})
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={
            "help": "Deprecated transformers alias of activation_checkpointing. Unset, activation checkpointing is "
            "on, as in GRPOConfig (which sets this old name, so every GRPOConfig warns about it)."
        },
    )
    ddp_timeout: int | None = field(
        default=None,
        metadata={
            "help": "Seconds a process may wait in a collective before the run fails (the process group's timeout). "
            "Unset: 7200 with a vLLM server (the other processes wait in TRL's broadcast while the main process "
            "generates a whole round: 25-50 minutes at the paper's settings; a stalled server fails sooner, through "
            "vllm_request_timeout), else transformers' 1800."
        },
    )
    report_to: None | str | list[str] = field(
        default="tensorboard",
        metadata={"help": "Loggers to report to: 'tensorboard' (default), 'wandb', 'none', or a list."},
    )
    max_tool_calling_iterations: int | None = field(
        default=7,
        metadata={
            "help": "Tool rounds per response when training with tools. 7 rounds = 8 assistant turns, ReTool's "
            "max_turns=8 in verl. None means no limit (TRL's default)."
        },
    )

    # Prompt length (TRL 1.16 dropped max_prompt_length; DAPO data needs it to bound memory).
    max_prompt_length: int | None = field(
        default=None,
        metadata={
            "help": "Maximum prompt length in tokens (after the chat template). Longer training prompts are "
            "handled as `overlong_prompt_policy` says. None keeps every prompt."
        },
    )
    overlong_prompt_policy: str = field(
        default="filter",
        metadata={"help": "What to do with prompts longer than max_prompt_length: 'filter' (drop, logged) or 'error'."},
    )

    # Soft overlong punishment (paper Eq. 13).
    apply_overlong_penalty: bool = field(
        default=True,
        metadata={"help": "Add DAPO's soft overlong punishment (Eq. 13) to the correctness reward."},
    )
    overlong_buffer_len: int | None = field(
        default=None,
        metadata={
            "help": "L_cache of Eq. 13: responses longer than max_completion_length - overlong_buffer_len are "
            "penalised linearly, down to -1 at max_completion_length. None = 20%% of max_completion_length "
            "(the paper's 4096 of 20480)."
        },
    )
    overlong_penalty_factor: float = field(
        default=1.0,
        metadata={"help": "Scale of the soft overlong penalty added to the reward (DAPO: 1.0)."},
    )

    # Dual-clip (verl's clip_ratio_c).
    clip_ratio_c: float | None = field(
        default=None,
        metadata={
            "help": "Dual-clip bound: for negative advantages the per-token loss is capped at -A * clip_ratio_c "
            "(verl default 3.0; verl's DAPO and ReTool recipes 10.0). Must exceed 1 + epsilon_high. None disables "
            "it (paper)."
        },
    )

    # KL in the reward (verl's algorithm.use_kl_in_reward, kl_penalty, kl_ctrl.*); not in DAPO.
    kl_in_reward: bool = field(
        default=False,
        metadata={
            "help": "Subtract kl_in_reward_coef x the response's summed per-token KL to the reference model from its "
            "reward, before the group advantage (verl's use_kl_in_reward). Costs a policy and a reference forward "
            "per generation batch and keeps a reference model (as beta > 0 does). Independent of beta (KL loss)."
        },
    )
    kl_in_reward_coef: float = field(
        default=0.001, metadata={"help": "KL coefficient beta, or its start value when adaptive (verl's kl_coef)."}
    )
    kl_in_reward_estimator: str = field(
        default="kl",
        metadata={
            "help": "Per-token KL estimate (verl's kl_penalty): 'kl' (k1), 'abs', 'mse' (k2) or 'low_var_kl' (k3)."
        },
    )
    kl_in_reward_controller: str = field(
        default="fixed",
        metadata={
            "help": "'fixed', or 'adaptive': after each generation batch, beta *= 1 + clip(KL / kl_in_reward_target "
            "- 1, -0.2, 0.2) x responses / kl_in_reward_horizon (verl's kl_ctrl.type)."
        },
    )
    kl_in_reward_target: float = field(
        default=0.1, metadata={"help": "Adaptive controller's target KL (mean per-token KL per response)."}
    )
    kl_in_reward_horizon: int = field(
        default=10000, metadata={"help": "Adaptive controller's horizon in responses (verl's kl_ctrl.horizon)."}
    )

    # Dynamic sampling.
    filter_groups_enable: bool = field(
        default=True,
        metadata={
            "help": "Dynamic sampling: drop groups whose accuracy is all-correct or all-wrong and refill the batch "
            "with groups from fresh prompts."
        },
    )
    max_filter_gen_batches: int = field(
        default=10,
        metadata={"help": "Most generation rounds per step for dynamic sampling (DAPO: 10). 0 = unlimited."},
    )
    filter_groups_oversample: int = field(
        default=1,
        metadata={
            "help": "Each dynamic-sampling round generates this many generation batches of prompts (verl's "
            "gen_batch_size / train_batch_size; DAPO used 3). Fewer rounds, more generation per round."
        },
    )
    filter_groups_on_exhausted: str = field(
        default="fill",
        metadata={
            "help": "When max_filter_gen_batches rounds still leave the batch short: 'fill' trains on the kept groups "
            "plus zero-advantage filler that adds nothing to the loss nor to its token denominator (logged as "
            "dynamic_sampling/filler_groups); 'error' stops with a message (verl's behaviour)."
        },
    )
    filter_groups_carry_surplus: bool = field(
        default=False,
        metadata={
            "help": "Keep kept groups beyond the batch target for the next step instead of discarding them (paper). "
            "Only the current step's groups are carried (older leftovers are discarded), so they are one step "
            "stale; their behaviour-policy log-probs are stored, so the clipped importance ratio corrects for it."
        },
    )
    prompt_triage: bool = field(
        default=False,
        metadata={
            "help": "Skip, before generating, prompts whose groups had no spread the last times they were sampled "
            "(GRESO, arXiv 2506.02177): a streak of k zero-variance samplings skips a prompt with probability "
            "1 - max(p ** k, prompt_triage_exploration_floor), p adapting so that the zero-variance groups a skip "
            "would have saved make prompt_triage_target_zero_variance of those generated; only streaks that this "
            "run has seen last (prompt_triage_min_agreement) are acted on. Skipped prompts come back in the next "
            "pass over the data. Needs filter_groups_enable; with rollout_streaming, a skip is decided when a round "
            "takes the prompt. What it saves and costs: docs/dynamic-sampling.md."
        },
    )
    prompt_triage_target_zero_variance: float = field(
        default=0.25,
        metadata={
            "help": "The share of generated groups that prompt triage lets be avoidable waste (a prompt with a streak, "
            "generated anyway, that agreed again; one third all right, two thirds all wrong, as GRESO): lower skips "
            "more."
        },
    )
    prompt_triage_exploration_floor: float = field(
        default=0.01,
        metadata={"help": "The least probability that prompt triage generates a prompt however long its streak."},
    )
    prompt_triage_min_agreement: float = field(
        default=0.9,
        metadata={
            "help": "Prompt triage skips on a streak (its kind, all right or all wrong, and its length, 6 and more "
            "pooled) only while prompts generated with such a streak in this run agreed again at least this often "
            "((agreed + 1) / (observed + 2)); 0 acts on every streak, as GRESO does."
        },
    )
    filter_groups_atol: float = field(
        default=1e-6,
        metadata={"help": "A group is kept when max - min of its accuracy exceeds this (float-noise tolerance)."},
    )
    filter_groups_shuffle_buffer_size: int = field(
        default=1000,
        metadata={
            "help": "With an IterableDataset train_dataset, dynamic sampling draws its fresh prompts through a seeded "
            "shuffle buffer of this many rows (and a seeded shard order per pass); 1000 is the buffer that "
            "GRPOTrainer's own dataloader shuffles a stream with (datasets' default). Larger mixes better; the "
            "buffered rows are saved in checkpoints, so a resumed run continues exactly. Map-style datasets are "
            "fully permuted instead. verl has no equivalent (its dynamic sampling needs a map-style dataset)."
        },
    )
    accuracy_reward_name: str | None = field(
        default=None,
        metadata={
            "help": "Name of the reward function whose raw value is the accuracy used by dynamic sampling and "
            "the accuracy metrics. None = the first reward function."
        },
    )

    # Padding-free training forwards.
    padding_free: bool = field(
        default=True,
        metadata={
            "help": "Training-phase forwards (policy loss, old and reference log-probs, carried surplus) feed real "
            "tokens only: the rows of each optimizer step are dealt to micro-batches (and, with dynamic sampling, "
            "processes) by token count, and each forward packs its rows into one sequence (position ids restarting "
            "per row) where the attention supports it, else trims them to the widest row. Exact: the same update "
            "as false, which keeps TRL's padded micro-batches (for comparison)."
        },
    )
    max_tokens_per_microbatch: int | None = field(
        default=None,
        metadata={
            "help": "Most real tokens one forward/backward may hold (verl's ppo_max_token_len_per_gpu), so its peak "
            "memory is bounded by tokens, not rows. Larger micro-batches are split into several backward passes "
            "(as many on every process); a single longer row runs alone, with a warning. None = no budget."
        },
    )

    # vLLM server weight sync.
    vllm_weight_sync: str = field(
        default="nccl",
        metadata={
            "help": "How vllm_mode='server' gets new weights: 'nccl' (TRL's broadcast; GPUs on a shared network) or "
            "'shared_storage' (save safetensors to vllm_weight_sync_dir, ask the server to reload them: for "
            "clusters where trainer and server cannot form an NCCL group, and for CPU machines). The server must "
            "run with VLLM_SERVER_DEV_MODE=1."
        },
    )
    vllm_weight_sync_dir: str | None = field(
        default=None,
        metadata={
            "help": "Directory the trainer writes weights to for shared_storage sync (default output_dir/vllm_weights)."
        },
    )
    vllm_weight_sync_server_dir: str | None = field(
        default=None,
        metadata={
            "help": "The same directory as the vLLM server sees it, if mounted elsewhere (default: the same path)."
        },
    )
    vllm_request_timeout: float = field(
        default=600.0,
        metadata={
            "help": "Seconds the vLLM server may go without progress while requests of ours are outstanding (no "
            "token generated, per its /metrics counters, and no answer): then the run stops with an error naming "
            "the URL instead of hanging. A long response is never a timeout. Weight reloads and small requests "
            "must be answered within it."
        },
    )

    # Rollout rejection (verl's algorithm.rollout_correction.rollout_rs); its importance weight is TRL's vllm_*.
    rollout_rejection: str | None = field(
        default=None,
        metadata={
            "help": "Drop loss tokens whose trainer/engine ratio pi_old / pi_rollout leaves [rollout_rejection_lower, "
            "rollout_rejection_upper] (verl's rollout_correction.rollout_rs): 'token' tests each token's ratio; "
            "'sequence' the response's product of them (drops the whole response); 'geometric' their geometric mean "
            "exp(mean_t log(pi_old / pi_rollout)) (whole response). A rejected token's loss is multiplied by 0 (it "
            "stays in the token denominator). Combines with TRL's importance weight (vllm_importance_sampling_*). "
            "Needs the engine's sampling log-probs (use_vllm, or rollout_streaming); with "
            "old_logprobs_source='engine', pi_old is the current policy (verl's bypass mode). Logged as "
            "sampling/rollout_rejected_fraction. None = off. docs/losses.md#rollout-correction."
        },
    )
    rollout_rejection_upper: float | None = field(
        default=None,
        metadata={
            "help": "Upper bound of the ratio rollout_rejection keeps (verl's rollout_rs_threshold; required with "
            "rollout_rejection, no default, as in verl). verl's presets: 2.0 for token and sequence, 1.001 for "
            "geometric."
        },
    )
    rollout_rejection_lower: float | None = field(
        default=None,
        metadata={
            "help": "Lower bound of the ratio rollout_rejection keeps (verl's rollout_rs_threshold_lower). None = "
            "1 / rollout_rejection_upper (verl's default)."
        },
    )

    # Validation (avg@n / pass@k per data source).
    vllm_server_recovery_timeout: float = field(
        default=300.0,
        metadata={
            "help": "With a vLLM server and vllm_weight_sync='shared_storage': seconds to wait for a server that went "
            "away (killed, restarting) to answer again; the weights each request needs are then reloaded and its "
            "unfinished requests sent again. 0 = fail at once. Keep it below the process-group timeout (ddp_timeout)."
        },
    )
    eval_num_samples: int = field(
        default=8,
        metadata={"help": "Responses sampled per validation prompt: avg@n and pass@1..n (paper: 32 for AIME)."},
    )
    eval_temperature: float = field(default=1.0, metadata={"help": "Validation sampling temperature (paper: 1.0)."})
    eval_top_p: float = field(default=0.7, metadata={"help": "Validation nucleus sampling top_p (paper: 0.7)."})
    eval_max_new_tokens: int | None = field(
        default=None, metadata={"help": "Longest validation response in tokens; None = max_completion_length."}
    )
    eval_samples_to_log: int = field(
        default=16,
        metadata={"help": "Validation prompts whose sampled responses are written to output_dir/eval_samples/."},
    )
    val_before_train: bool = field(
        default=False, metadata={"help": "Run validation once before the first training step (verl's option)."}
    )

    # Alias kept for the original dapo_trl / verl command line.
    entropy_coeff: float | None = field(
        default=None,
        metadata={"help": "Alias of entropy_coef (verl's spelling). Entropy bonus coefficient; DAPO uses 0."},
    )

    # Where the loss's pi_old comes from.
    old_logprobs_source: str = field(
        default="trainer",
        metadata={
            "help": "pi_old, the policy the clip is centred on. 'trainer' (TRL's): a no-grad forward of every "
            "scored row with the weights it is scored at. 'engine' (verl's rollout_correction.bypass_mode): the "
            "engine's sampling log-probs, no forward; the importance weight is then 1 and the clip alone bounds the "
            "step away from the sampler. 'interpolated' (AReaL's prox_logp_method=loglinear): log pi_old ~= "
            "log pi_behave + alpha (log pi_theta - log pi_behave), alpha = (v_old - v_behave) / (v_theta - "
            "v_behave) in optimizer steps, per token; equal to 'engine' for rows the current weights sampled. Both "
            "need the engine's log-probs (use_vllm, or rollout_streaming); the forward still runs where "
            "kl_in_reward or routing_replay need it. docs/algorithm.md#where-pi_old-comes-from."
        },
    )

    # Sequence parallelism (long responses).
    sequence_parallel_size: int = field(
        default=1,
        metadata={
            "help": "Ulysses sequence parallelism (verl's ulysses_sequence_parallel_size, DeepSpeed's "
            "sequence_parallel_size): every training-phase forward runs the rows of N consecutive processes as one "
            "packed sequence cut into N shards, one per process, with DeepSpeed's Ulysses attention (heads split "
            "across the group inside attention). Each process then holds about 1/N of a long row's activations. "
            "Exact: the same log-probs, loss and gradient as 1. Needs padding_free, a world size divisible by N, "
            "query heads divisible by N and KV heads divisible by N (or N by them). 1 = off."
        },
    )

    # Streaming rollout (dynamic sampling group by group; generation overlapped with training).
    rollout_streaming: bool = field(
        default=False,
        metadata={
            "help": "Streaming dynamic sampling with vLLM (a server or colocated): every group is its own seeded "
            "request, the engine is kept full (the next round starts before the current one drains) and groups are "
            "scored as soon as an in-order prefix of the round is done. The prompts and keep decisions of rounds "
            "(accepted in prompt-stream order, never by finishing order), without waiting on each round's longest "
            "response; the same tokens on every run only where the engine is batch-invariant (docs/rollout.md)."
        },
    )
    rollout_max_staleness: int = field(
        default=0,
        metadata={
            "help": "With rollout_streaming: generate the next batch while the trainer trains this one. Staleness "
            "counts weight versions, one per generation batch (sent after the batch's last update, whatever "
            "steps_per_generation, gradient_accumulation_steps and num_iterations are): generation batch j is "
            "sampled by version max(0, j - k) (carried surplus one more), pi_old is the weights at the start of "
            "its updates, and TRL's truncated importance weight (vllm_importance_sampling_*) corrects for the "
            "engine's. 0 = synchronous. k >= 1 needs vllm_weight_sync='shared_storage' (older versions load "
            "from disk) or rollout_in_flight_weight_updates."
        },
    )
    rollout_in_flight_weight_updates: bool = field(
        default=False,
        metadata={
            "help": "With rollout_max_staleness >= 1 and a vLLM server: load each weights version while requests "
            "run, instead of after the old version's requests drain. The server is paused with its requests and "
            "their KV cache kept (vLLM >= 0.31's /pause?mode=keep, VLLM_SERVER_DEV_MODE=1), reloaded and resumed; "
            "a response may hold tokens of several versions (its row is as old as its first token; the importance "
            "weight corrects each token by its engine log-prob). Checkpoints keep the groups generated ahead, a "
            "resumed run continues them (routing_replay: the finished ones). NCCL (MoE too) or shared storage."
        },
    )
    rollout_in_flight_kv_cache: str = field(
        default="recompute",
        metadata={
            "help": "With rollout_in_flight_weight_updates: what the paused requests continue from. 'recompute' "
            "(vLLM's default): their KV cache is dropped and recomputed by the new weights when they resume, so "
            "every later token is exactly the new version's, at the cost of one prefill of each running context. "
            "'keep': the KV cache the old weights wrote is reused (no prefill); later tokens then carry a small "
            "mismatch that the importance weight absorbs (measured in docs/rollout.md). New requests never reuse an "
            "older version's prefix cache: each version's requests carry a cache_salt of their own."
        },
    )
    rollout_max_in_flight_groups: int | None = field(
        default=None,
        metadata={
            "help": "With rollout_streaming: most groups the vLLM server samples at once (each is num_generations "
            "sequences). None = one round of groups (the generation batch x filter_groups_oversample)."
        },
    )
    rollout_lookahead_rounds: int = field(
        default=1,
        metadata={
            "help": "With rollout_streaming: rounds of prompts admitted beyond the current one while the batch may "
            "still need them. Groups admitted but not needed are cancelled and regenerated, same seed, next step."
        },
    )

    # Mixture-of-experts policies.
    routing_replay: bool = field(
        default=False,
        metadata={
            "help": "Routing replay (R3, verl's enable_rollout_routing_replay): a mixture-of-experts policy's training "
            "forwards (old and policy log-probs) route each sampled token to the experts the inference engine chose "
            "for it, with the trainer router's gate weights over them, instead of re-routing. Removes the routing "
            "part of the training-inference mismatch. Needs rollout_streaming (the engine returns the routing: "
            "vLLM with --enable-return-routed-experts) and padding_free; docs/moe.md."
        },
    )

    preemption_signals: str = field(
        default="SIGTERM,SIGUSR1",
        metadata={
            "help": "Signals that preempt the run (SLURM's --signal, Kubernetes' SIGTERM): every process abandons the "
            "optimizer step in progress, a complete checkpoint of the last completed one is saved, and train_dapo.py "
            "exits 0; resume with "
            "--resume_from_checkpoint latest. '' = the signals' default action (killed at once)."
        },
    )
    preemption_grace_seconds: float = field(
        default=300.0,
        metadata={
            "help": "After a preemption signal, the most seconds the way to the step's next safe point (a micro-batch, "
            "or a generation round with colocated vLLM or transformers' generate) and the checkpoint may take before "
            "the process exits without them (code 128 + the signal). Set it below the scheduler's own deadline."
        },
    )

    @classmethod
    def for_trainer(cls, args: Any, model: Any) -> DAPOConfig:
        """`args` for a DAPOTrainer: DAPO's defaults named after the model when None; a plain GRPOConfig is refused."""
        if args is None:
            model_name = model if isinstance(model, str) else model.config._name_or_path
            return cls(f"{str(model_name).rstrip('/').split('/')[-1]}-DAPO")
        if not isinstance(args, cls):
            raise TypeError(
                f"DAPOTrainer needs a DAPOConfig, got {type(args).__name__}: build it with "
                "DAPOConfig(**same_arguments) (DAPOConfig accepts every GRPOConfig field)."
            )
        return args

    def __post_init__(self):
        derive_platform_defaults(self)
        super().__post_init__()
        derive_dapo_fields(self)
        check_all(self)

    def accuracy_reward_index(self, reward_func_names: list[str]) -> int:
        """Which reward column is raw accuracy (dynamic sampling and accuracy metrics read it)."""
        if not reward_func_names:
            raise ValueError("DAPOTrainer needs at least one reward function (the correctness reward).")
        if self.accuracy_reward_name is None:
            return 0
        if self.accuracy_reward_name not in reward_func_names:
            raise ValueError(
                f"accuracy_reward_name={self.accuracy_reward_name!r} is not one of the reward functions "
                f"{reward_func_names}."
            )
        return reward_func_names.index(self.accuracy_reward_name)

    # ------------------------------------------------------------------------------------- checks, by feature
    # Each check fails at configuration time, naming the field and the fix, instead of deep inside training.
