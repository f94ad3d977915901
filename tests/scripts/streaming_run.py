"""dynamic_sampling_run.py's training, with generation by a deterministic fake engine (tests/scripts/fake_engine.py):
streamed (`rollout_streaming=true`, the fake engine in place of the vLLM server) or round by round (the same fake
completions returned where TRL would generate). Same usage and outputs as dynamic_sampling_run.py, plus the script
options timing_seed (the engine's random delays), engine_delay (its longest delay, seconds), engine_per_process=true
(a fake engine on every process, each generating the groups it owns, as with colocated vLLM), engine_lag=N (the
engine samples weights version v - N when asked for v), stream_only=true (every round's prompts from the seeded
stream, as at rollout_max_staleness >= 1), in_flight=true (the engine loads each version as it is published, under
running groups, and checkpoints keep the finished groups generated ahead, as with in-flight weight updates), resume,
crash_after_save (the process dies right after writing that step's checkpoint), tools=true (chat prompts, a Hermes
`add` tool, and half of the fake first turns call it: TRL's tool loop runs the call and asks for the next turn, which
the same fake generation answers; tools=environment: the same tool as the method of an `environment_factory`
environment, round by round) and moe=true (the tiny mixture-of-experts model; with routing_replay=true the fake
engine returns routed experts). A failure on one process (`training.faults.fail_together`): fail_in=reward (the
accuracy reward raises), decode (the tokenizer's batch_decode raises), evaluation (the reward raises while evaluating;
evaluates every step) or engine (the fake engine's start raises a timeout: the main process's driver), on process
fail_rank (default 1; the engine's is the main process) from optimizer step fail_from_step (default 1);
hold_failed=true keeps the failing process alive after its error (as a peer stuck in an NCCL collective would be,
where gloo would see its socket close), until the launcher stops it. Each process that raises writes
OUT/error_rank{r}.txt. A preemption while the main process waits for a wave: preempt_wave_at_step=N (the engine,
asked for the first group of optimizer step N + 1, sends SIGTERM to process preempt_rank, default 1, and holds that
step's groups for hold_seconds, default 120, so the wave cannot finish first); final_params=true writes the final
weights to OUT/final_params.pt, as dynamic_sampling_run.py does. dynamic_sampling_run.py's preempt_at_step with
preempt_during=round (the signal from the reward) and slow_reward_at_step / slow_reward_seconds work here too
(preempt_rank names the signalled process); with tools=true, preempt_during=tool (the signal from the tool's first
call of the step) and slow_tool_at_step / slow_tool_seconds (every tool call of that step holds it).
"""

import dataclasses
import functools
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from denominator_run import full_parameters
from dynamic_sampling_run import (
    PREEMPT,
    SCRIPT_OPTIONS,
    CrashAfterSave,
    RecordingTrainer,
    difficulty_dataset,
    id_shaping,
    known_difficulty_reward,
    preempt_here,
)
from fake_engine import FakeEngine, fake_completion
from script_args import leave_together, parse_overrides
from scripted_tools import TOOL_CALL, add
from transformers import AutoTokenizer, TrainerCallback
from trl.chat_template_utils import qwen2_5_chat_template

from dapo_trl import DAPOConfig
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.moe.routing_replay import ROUTING_KWARG
from dapo_trl.training.rollout import rollout_setup
from dapo_trl.training.rollout.stream_plan import group_seed
from dapo_trl.utils.transformers_compat import activation_checkpointing_kwargs

# The fake engine's k >= 1 runs test which rows make each batch (selection, versions, resume), not the loss's
# correction (its log-probs are no policy's): the refusal of k >= 1 for an engine of your own is lifted here;
# test_streaming_refuses_k1_for_an_engine_of_your_own checks the refusal users get.
rollout_setup.check_off_policy_correction = lambda args: None

ENGINE = {
    "timing_seed": 0,
    "engine_delay": 0.03,
    "engine_per_process": False,
    "engine_lag": 0,
    "stream_only": False,
    "in_flight": False,
}
FAILURE = {"fail_in": None, "fail_rank": 1, "fail_from_step": 1, "hold_failed": False}
PREEMPT_WAVE = {"preempt_wave_at_step": None, "preempt_rank": 1, "hold_seconds": 120.0}
SLOW_TOOL = {"slow_tool_at_step": None, "slow_tool_seconds": 0.0}
TRAINER = []  # the trainer, for the injected failures


@functools.wraps(add)  # its name, docstring and signature: the tool's schema
def held_add(a: int, b: int) -> int:
    """tools=true's tool: with preempt_during=tool, SIGTERM to process preempt_rank as its first call of optimizer step
    preempt_at_step + 1 begins; with slow_tool_at_step=N, every call of step N + 1 takes slow_tool_seconds (a
    sandbox or a remote service that holds the step)."""
    trainer = TRAINER[0]
    step = trainer.state.global_step
    preempt_here("tool", step, trainer.accelerator.process_index)
    if step == SLOW_TOOL["slow_tool_at_step"]:
        time.sleep(SLOW_TOOL["slow_tool_seconds"])
    return add(a, b)


class Calculator:
    """tools=environment's environment (TRL's `environment_factory`, one instance per rollout): the tool as its
    method, held and signalled as `held_add` is."""

    def reset(self, **kwargs) -> None:
        return None

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: The first integer.
            b: The second integer.
        """
        return held_add(a, b)


def failing_here(kind: str) -> bool:
    trainer = TRAINER[0]
    rank = 0 if kind == "engine" else FAILURE["fail_rank"]
    return (
        FAILURE["fail_in"] == kind
        and trainer.accelerator.process_index == rank
        and trainer.state.global_step >= FAILURE["fail_from_step"]
    )


@functools.wraps(known_difficulty_reward)  # its name: the reward's metrics keep theirs
def accuracy_reward(*args, **kwargs):
    training = TRAINER[0].model.training
    if failing_here("reward") and training or failing_here("evaluation") and not training:
        raise ValueError(f"injected failure in the reward on process {TRAINER[0].accelerator.process_index}")
    return known_difficulty_reward(*args, **kwargs)


def inject_decode_failure(trainer) -> None:
    real = trainer.processing_class.batch_decode

    def batch_decode(*args, **kwargs):
        if failing_here("decode"):
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected failure in batch_decode")
        return real(*args, **kwargs)

    trainer.processing_class.batch_decode = batch_decode


class FailingEngine(FakeEngine):
    def start(self, request, done) -> None:
        if failing_here("engine"):
            raise TimeoutError("the engine did not answer within vllm_request_timeout (injected)")
        if TRAINER[0].state.global_step == PREEMPT_WAVE["preempt_wave_at_step"]:  # runs on the driver's thread
            done = functools.partial(answer_late, done)
            if not PREEMPT_WAVE.get("sent"):
                PREEMPT_WAVE["sent"] = True
                pid = int((Path(os.environ["DS_OUT"]) / f"pid_rank{PREEMPT_WAVE['preempt_rank']}.txt").read_text())
                os.kill(pid, signal.SIGTERM)
        super().start(request, done)


def answer_late(done, request, result) -> None:
    """A group of the preempted step: answered only after hold_seconds (on the engine's pool thread)."""
    time.sleep(PREEMPT_WAVE["hold_seconds"])
    done(request, result)


class LaggingEngine(FailingEngine):
    """engine_lag=N: asked for weights version v, samples what version max(0, v - N) samples (and labels it v), so a
    synchronous run (rollout_max_staleness 0) with it samples as a run N versions stale does."""

    def _run(self, request, done, delay) -> None:
        lagged = dataclasses.replace(request, version=max(0, request.version - ENGINE["engine_lag"]))

        def relabelled(_, result) -> None:
            result.version = request.version
            done(request, result)

        super()._run(lagged, relabelled, delay)


class FakeGenerationTrainer(RecordingTrainer):
    @property
    def colocated_rollout_engines(self) -> bool:  # engine_per_process=true: one fake engine per process, as colocated
        return ENGINE["engine_per_process"]

    @property
    def tool_call_ids(self) -> list[int] | None:
        return self.processing_class(TOOL_CALL, add_special_tokens=False)["input_ids"] if self.tools else None

    def build_rollout_engine(self, max_in_flight):
        eos, max_tokens = self.processing_class.eos_token_id, self.args.max_completion_length
        timing = ENGINE["timing_seed"] + self.accelerator.process_index, ENGINE["engine_delay"]
        routing = self._replayed_routing.routing if self._replayed_routing is not None else None
        self.fake_engine = LaggingEngine(self.num_generations, eos, max_tokens, *timing, self.tool_call_ids, routing)
        self.fake_engine.updates_in_flight = ENGINE["in_flight"]  # loads under running requests; keeps groups ahead
        return self.fake_engine

    def _generate_and_score_completions(self, inputs):
        if self._rollout is None and self.model.training:
            self._rounds_in_step, self._generations = 0, self._generations + 1
        return super()._generate_and_score_completions(inputs)

    def _score_round(self, round_inputs, scoring=None):
        """Rounds: each group's key as streaming names it (the dataloader's g-th group of generation j, or the n-th
        prompt drawn from the stream), so the fake generation can seed it as the streamed request is seeded."""
        if self._rollout is None and self.model.training:
            first = self.accelerator.process_index * len(round_inputs)
            groups = [(first + row) // self.num_generations for row in range(len(round_inputs))]
            if self._rounds_in_step == 0:
                keys = [("batch", self._generations, g) for g in groups]
            else:
                keys = [("stream", self._draws_before + g) for g in groups]
            self._round_keys, self._rounds_in_step = keys, self._rounds_in_step + 1
        return super()._score_round(round_inputs, scoring)

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, **kwargs):
        if self._round is not None and self._round.prepared is not None:  # streamed: the fake engine sampled them
            return super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, **kwargs)
        keys, self._round_keys = getattr(self, "_round_keys", None), None  # a round's first turn; later turns unseeded
        version = self.state.global_step  # rounds: the weights TRL would have synced
        first_row = self.accelerator.process_index * len(prompt_ids)  # groups are contiguous in the global rows
        pairs = [
            fake_completion(
                ids,
                None if keys is None else group_seed(self.args.seed, keys[row]),
                version,
                (first_row + row) % num_generations,
                self.processing_class.eos_token_id,
                self.args.max_completion_length,
                self.tool_call_ids,
            )
            for row, ids in enumerate(prompt_ids)
        ]
        return [ids for ids, _ in pairs], [logprobs for _, logprobs in pairs]


class ScoringForwards(TrainerCallback):
    """Counts the policy's forwards without gradient (scoring: the old log-probs of carried groups) per optimizer
    step on this process, into OUT/forwards_rank<r>.jsonl: under ZeRO-3 each one gathers every parameter. With
    routing replay, also where each forward's replayed routing lives, against its input, into
    OUT/replayed_rank<r>.jsonl: a forward moves one pack's routing to the model's device, no more."""

    def __init__(self, trainer: FakeGenerationTrainer, out: Path):
        rank = trainer.accelerator.process_index
        self.path, self.count = out / f"forwards_rank{rank}.jsonl", 0
        self.replayed = out / f"replayed_rank{rank}.jsonl"
        trainer.model.register_forward_pre_hook(self.seen, with_kwargs=True)

    def seen(self, module, args, kwargs) -> None:
        self.count += not torch.is_grad_enabled()
        routing = kwargs.get(ROUTING_KWARG)
        if routing is not None:
            tokens = kwargs["input_ids"] if "input_ids" in kwargs else args[0]
            weight = next(module.parameters())
            record = {
                "grad": torch.is_grad_enabled(),
                "routing_device": str(routing.device),
                "model_device": str(weight.device),
                "routing_shape": list(routing.shape),
                "input_shape": list(tokens.shape),
            }
            with open(self.replayed, "a") as file:
                file.write(json.dumps(record) + "\n")

    def on_step_end(self, args, state, control, **kwargs):
        with open(self.path, "a") as file:
            file.write(json.dumps({"step": state.global_step - 1, "forwards": self.count}) + "\n")
        self.count = 0


def count_draws(trainer: FakeGenerationTrainer) -> None:
    """Rounds: number the prompts drawn from the sampler's stream, as streaming's cursor numbers them."""
    stream, trainer._draws, trainer._generations = trainer._sampler.stream, 0, -1
    draw = stream.draw

    def counted(count):
        trainer._draws_before, trainer._draws = trainer._draws, trainer._draws + count
        return draw(count)

    stream.draw = counted


def main() -> None:
    out, per_device, max_steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    overrides = parse_overrides(sys.argv[4:])
    resume = overrides.pop("resume", None)
    crash_after = overrides.pop("crash_after_save", None)
    for option in ENGINE:
        ENGINE[option] = overrides.pop(option, ENGINE[option])
    with_tools = overrides.pop("tools", False)
    architecture = "moe" if overrides.pop("moe", False) else "dense"
    for option in FAILURE:
        FAILURE[option] = overrides.pop(option, FAILURE[option])
    for option in PREEMPT_WAVE:
        PREEMPT_WAVE[option] = overrides.pop(option, PREEMPT_WAVE[option])
    for option in SLOW_TOOL:
        SLOW_TOOL[option] = overrides.pop(option, SLOW_TOOL[option])
    for option in ("preempt_at_step", "preempt_during", "slow_reward_at_step", "slow_reward_seconds"):
        PREEMPT[option] = overrides.pop(option, PREEMPT[option])
    PREEMPT["preempt_rank"] = PREEMPT_WAVE["preempt_rank"]  # one option names the signalled process
    final_params = overrides.pop("final_params", False)
    SCRIPT_OPTIONS["reward"] = "ids"  # the reward reads the completions, so the batches depend on them
    out.mkdir(parents=True, exist_ok=True)
    os.environ["DS_OUT"] = str(out)
    settings = dict(
        output_dir=str(out / "run"),
        per_device_train_batch_size=per_device,
        num_generations=4,
        max_completion_length=8,
        max_steps=max_steps,
        max_filter_gen_batches=0,
        apply_overlong_penalty=False,
        **activation_checkpointing_kwargs(False),
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    model = build_tiny_model(out.parent / f"tiny-{architecture}", architecture=architecture)
    dataset, tokenizer, tools = difficulty_dataset(0.5), None, None
    if with_tools:  # the first turn's tool call and its reply fit; at most two tool rounds
        settings.update(max_completion_length=96, max_tool_calling_iterations=2)
        dataset = dataset.map(lambda row: {"prompt": [{"role": "user", "content": row["prompt"]}]})
        tokenizer, tools = AutoTokenizer.from_pretrained(model), [held_add]
        tokenizer.chat_template = qwen2_5_chat_template
    environment = {}
    if with_tools == "environment":  # the tool is an environment's method instead
        tools, environment = None, {"environment_factory": Calculator}
    settings.update(overrides)
    trainer = FakeGenerationTrainer(
        model=str(model),
        reward_funcs=[accuracy_reward, id_shaping],
        args=DAPOConfig(**settings),
        train_dataset=dataset,
        eval_dataset=difficulty_dataset(0.5, size=8) if FAILURE["fail_in"] == "evaluation" else None,
        processing_class=tokenizer,
        tools=tools,
        **environment,
    )
    if crash_after is not None:
        trainer.add_callback(CrashAfterSave(crash_after))
    if ENGINE["stream_only"]:  # as at k >= 1: every first round from the seeded stream, not the dataloader
        trainer._rollout.first_round_from_loader = False
    if trainer._rollout is None:
        count_draws(trainer)
    trainer.add_callback(ScoringForwards(trainer, out))
    TRAINER.append(trainer)
    (out / f"pid_rank{trainer.accelerator.process_index}.txt").write_text(str(os.getpid()))
    inject_decode_failure(trainer)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except BaseException as exc:
        (out / f"error_rank{trainer.accelerator.process_index}.txt").write_text(f"{type(exc).__name__}: {exc}")
        if FAILURE["hold_failed"] and failing_here(FAILURE["fail_in"]):
            threading.Event().wait(300)  # stopped by the launcher once the other process exits
        raise
    engine = getattr(trainer, "fake_engine", None)
    if final_params:  # ZeRO-3 shards gathered on every rank
        final = full_parameters(trainer.accelerator.unwrap_model(trainer.model))
        if trainer.accelerator.is_main_process:
            torch.save({name: p.cpu() for name, p in final.items()}, out / "final_params.pt")
    if trainer.accelerator.is_main_process:
        (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
        if engine is not None:
            record = {"loads": engine.loads, "max_in_flight": engine.max_seen_in_flight}
            (out / "engine.json").write_text(json.dumps(record))
    leave_together(trainer.accelerator)


if __name__ == "__main__":
    main()
