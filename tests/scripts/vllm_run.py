"""Two DAPO steps with vLLM generation, in server or colocate mode; check every weight sync.

Usage:
  python vllm_run.py server OUT MODEL_DIR BASE_URL [key=value DAPOConfig overrides...]
  python vllm_run.py colocate OUT MODEL_DIR [key=value ...]
Server mode syncs through shared storage; the server must already run on MODEL_DIR in float32 and dev mode
(`--dtype auto` runs a float32 checkpoint in bfloat16 on vLLM-CPU: log-prob gaps ~1e-3). On vLLM-CPU set
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_CPU_KVCACHE_SPACE=1.
After every weight sync the engine's log-probabilities of a fixed token sequence are compared with the trainer
model's; the gaps go to OUT/sync_checks.json with the log history. Exit 1 if a gap after a sync exceeds 1e-5, or a
gap before a later sync does not (the weights did not move). `check_syncs=false` just trains (and writes
OUT/log_history.json). `lora=R` trains a LoRA adapter of rank R (alpha 2R, every linear layer): what reaches the
engine is the base with the adapter merged, and the trainer side of each check is the PEFT model with its adapter on;
with `lora_experts=true` (a mixture-of-experts model) the adapter also targets the experts' weights (PEFT's
`target_parameters`: they are 3-D parameters, not linear layers).
Server streaming (`rollout_streaming=true`) records every trained row in OUT/trained.jsonl; `check_versions=true` also
writes, per step, the largest gap between the engine's sampling log-probs and the trainer's re-scoring under the
weights version that sampled the rows (OUT/version_gaps.json); `crash_after_save=N` dies right after checkpoint N and
`resume=PATH` resumes from a checkpoint; `freeze_server=PID` stops the server process PID (SIGSTOP), and
`kill_server=PID` kills its process group, just before step 2's first generation request (`ServerFault`);
`frozen_server=PID` stops the server's process group for good as step 1 begins (`FrozenServerAtStep1`); a run that
fails writes the time it failed to OUT/failed_at. Faults of the fast path (tests/scripts/fault_harness.py), from
optimizer step `fault_step` on: `fault=kill_in_reload` (the process kills itself, as kill -9 would, inside an in-flight
reload: between the server's /pause and /resume), `fault=fail_fence` (the fence that marks the switch in every running
answer fails; both in the first in-flight load of version 1 or later, which an anchor group running through it
makes sure of), `fault=sigterm_in_reward` (SIGTERM as the reward scores, a reward that then takes 120 s),
`fault=sigterm_in_generation` (SIGTERM from the engine as it starts a group of version 1 or later: generating ahead),
`fault=sigterm_in_training` (SIGTERM as a micro-batch's loss begins), `fault=kill_in_publish` (kill -9 halfway
through writing weights version 1 to shared storage: the transfer), `fault=sigterm_in_save` (SIGTERM as the first
checkpoint after `fault_step` writes the rollout's groups generated ahead), `fault=kill_peer_in_reload` (several
processes: the main process, inside an in-flight reload, kills process 1 as kill -9 would and then stays between /pause
and /resume, as a driver thread stuck there does, until the run ends).
`tools=true` (colocate with rollout_streaming=true): chat prompts and an `add` tool; the random model never calls it,
so the first turn of every even-numbered group is replaced by a scripted call (its tokens' sampling log-probs NaN:
TRL leaves them out of its log-prob gap), and TRL's tool loop asks the colocated engine for the next turns
(`VLLMColocateEngine.generate_turns`, counted in OUT/sync_checks.json as `tool_turn_calls`).
"""

import json
import os
import re
import signal
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from script_args import parse_overrides
from scripted_tools import TOOL_CALL, add
from transformers import TrainerCallback
from trl.models import unwrap_model_for_generation

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.training.rollout.rollout_engine import GroupRequest, GroupResult
from dapo_trl.training.rollout.rollout_stream import ROLLOUT_STATE_FILE

sys.path.append(str(Path(__file__).resolve().parent.parent))  # tests/, for the probes (this runs as a script)
from vllm_probes import (
    engine_sequence_logprobs,
    model_sequence_logprobs,
    served_model_name,
    server_sequence_logprobs,
)

TOLERANCE = 1e-5
CHECK_TEXT = "What is 12 plus 7? First, 12 + 7 = 19.\nAnswer: 19"


FAULT = {"fault": None, "fault_step": 1}


def parity_reward(completion_ids, trainer_state=None, **kwargs) -> list[float]:
    """+1 / -1 by the parity of the completion's token-id sum: random-looking, so groups have spread (or not)."""
    if FAULT["fault"] == "sigterm_in_reward" and trainer_state is not None:
        if trainer_state.global_step == FAULT["fault_step"]:
            injected(RecordedStreaming.out)
            FAULT["fault"] = None  # once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(120)  # a judge or a remote reward service that takes its time
    return [1.0 if sum(ids) % 2 == 0 else -1.0 for ids in completion_ids]


def injected(out: Path) -> None:
    """Record that the fault was injected (the harness checks it was: a fault never reached proves nothing)."""
    (out / "fault_injected").write_text(str(FAULT["fault"]))


RELOAD_FAULTS = ("kill_in_reload", "kill_peer_in_reload", "fail_fence")


def inject_engine_fault(trainer: DAPOTrainer, out: Path) -> None:
    """`fault=kill_in_reload` / `kill_peer_in_reload` / `fail_fence` / `sigterm_in_generation`: hooks on the main
    process's streaming engine (driver's thread). A load is in flight only while requests run: when version 1 or later
    is published (`publish_rollout_weights`), an anchor group of 900 tokens starts first, so that load pauses the
    server with it running."""
    if trainer._rollout.driver is None:  # not the main process: it has no engine
        return
    engine = trainer._rollout.driver.engine
    reload, fence, start, payload = engine._reload, engine._fence, engine.start, engine.request_payload

    def killing_reload(base_url, weights, timeout, reset_prefix_cache=True):
        if FAULT["fault"] == "kill_in_reload" and not reset_prefix_cache:  # in flight: the server is paused
            injected(out)
            print("fault: killed between /pause and /resume", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if FAULT["fault"] == "kill_peer_in_reload" and not reset_prefix_cache:
            injected(out)
            FAULT["fault"] = None  # once
            os.kill(int((out / "pid_rank1").read_text()), signal.SIGKILL)
            print("fault: killed process 1 between /pause and /resume", flush=True)
            time.sleep(300)  # stuck here: only the run's exit paths can resume the server
        return reload(base_url, weights, timeout, reset_prefix_cache)

    async def failing_fence(version, quiet=0.05):
        if FAULT["fault"] == "fail_fence":
            injected(out)
            raise TimeoutError("fault injected: the fence did not settle")
        return await fence(version, quiet)

    def signalling_start(request, done):
        if FAULT["fault"] == "sigterm_in_generation" and request.key[0] != "anchor" and request.version >= 1:
            injected(out)
            FAULT["fault"] = None  # once
            os.kill(os.getpid(), signal.SIGTERM)
        return start(request, done)

    def anchored_payload(request):
        body = payload(request)
        if request.key[0] == "anchor":
            body.update(max_tokens=900, ignore_eos=True)  # seconds on the CPU: it outlasts the load
        return body

    def publish(version: int) -> None:
        if FAULT["fault"] in RELOAD_FAULTS and version >= 1 and trainer.accelerator.is_main_process:
            anchor = GroupRequest(("anchor", version), [5, 6, 7], version, version=version - 1)
            start(anchor, lambda request, result: None)
            deadline = time.monotonic() + 60
            while not engine.running() and time.monotonic() < deadline:
                time.sleep(0.01)  # the anchor's request is on its way: the load below finds it running
        trainer_publish(version)

    trainer_publish = trainer.publish_rollout_weights
    trainer.publish_rollout_weights = publish
    engine._reload, engine._fence, engine.start = killing_reload, failing_fence, signalling_start
    engine.request_payload = anchored_payload


def kill_while_publishing(out: Path) -> None:
    """`fault=kill_in_publish`: the process dies (as kill -9 would) halfway through writing weights version 1 or later
    to shared storage: the weights file half written, the version's folder there."""
    import safetensors.torch

    real_save_file = safetensors.torch.save_file

    def save_file(tensors, filename, *args, **kwargs):
        real_save_file(tensors, filename, *args, **kwargs)
        if FAULT["fault"] == "kill_in_publish" and re.fullmatch(r"v[1-9][0-9]*", Path(filename).parent.name):
            injected(out)
            with open(filename, "r+b") as written:
                written.truncate(os.path.getsize(filename) // 2)
            print(f"fault: killed halfway through writing {filename}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    safetensors.torch.save_file = save_file


def signal_in_save(trainer: DAPOTrainer, out: Path) -> None:
    """`fault=sigterm_in_save`: SIGTERM as the first checkpoint after `fault_step` starts writing the rollout's state
    (the groups generated ahead), midway through the save."""
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        late = trainer.state.global_step > FAULT["fault_step"]
        if FAULT["fault"] == "sigterm_in_save" and late and str(path).endswith(ROLLOUT_STATE_FILE):
            injected(out)
            FAULT["fault"] = None  # once
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(obj, path, *args, **kwargs)

    torch.save = save


class CrashAfterSave(TrainerCallback):
    """Dies (as kill -9 would) right after the checkpoint of step `step` is written."""

    def __init__(self, step: int):
        self.step = step

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os._exit(3)


class ScriptedToolCalls(DAPOTrainer):
    """Colocated streaming whose even-numbered groups' first turns are a scripted tool call."""

    tool_turn_calls = 0

    def build_rollout_engine(self, max_in_flight):
        engine = super().build_rollout_engine(max_in_flight)
        call = self.processing_class(TOOL_CALL, add_special_tokens=False)["input_ids"]
        start, generate_turns = engine.start, engine.generate_turns

        def scripted_start(request, done, n=None):
            if n is not None or request.key[-1] % 2:  # a tool loop's turn, or an odd group: the model's own
                return start(request, done, n)

            def script(request_, result):
                if not isinstance(result, BaseException):
                    count = len(result.lengths)
                    result = GroupResult(
                        result.key,
                        result.version,
                        [list(call)] * count,
                        [[float("nan")] * len(call)] * count,
                        result.seconds,
                    )
                done(request_, result)

            return start(request, script)

        def counted_turns(prompt_ids):
            ScriptedToolCalls.tool_turn_calls += 1
            return generate_turns(prompt_ids)

        engine.start, engine.generate_turns = scripted_start, counted_turns
        return engine


class RecordedStreaming(DAPOTrainer):
    """Server streaming that records what each step trained (OUT/trained.jsonl) and, with `check_versions`, the
    largest gap per step between the engine's sampling log-probs and the trainer's re-scoring of the same rows under
    the weights version that sampled them (the trainer's own weights when it published that version)."""

    out: Path
    check_versions = False
    version_gaps: dict[int, float] = {}
    trainer_versions: dict[int, dict] = {}  # version -> the trainer's weights when it published it
    _version_model = None

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if FAULT["fault"] == "sigterm_in_training" and self.state.global_step >= FAULT["fault_step"]:
            injected(self.out)
            FAULT["fault"] = None  # once
            os.kill(os.getpid(), signal.SIGTERM)
        masks = inputs["completion_mask"].bool()
        record = {
            "step": self.state.global_step,
            "prompt_ids": inputs["prompt_ids"].tolist(),
            "completion_ids": [ids[m].tolist() for ids, m in zip(inputs["completion_ids"], masks, strict=True)],
            "advantages": inputs["advantages"].tolist(),
        }
        with open(self.out / "trained.jsonl", "a") as file:
            file.write(json.dumps(record) + "\n")
        return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    def _score_round(self, round_inputs, scoring=None):
        scored = super()._score_round(round_inputs, scoring)
        if self.check_versions and self._rollout is not None and self.model.training:
            gap = self.gap_to_sampling_version(scored.rows, self._rollout.version)
            step = self.state.global_step
            self.version_gaps[step] = max(self.version_gaps.get(step, 0.0), gap)
        return scored

    def publish_rollout_weights(self, version: int) -> None:
        """The trainer's own weights as they are when it publishes `version` (`check_versions`): what the re-score
        compares the engine with, not the file the engine loaded (a publish that wrote other weights must fail)."""
        if self.check_versions:
            weights = self.accelerator.unwrap_model(self.model).state_dict()
            self.trainer_versions[version] = {name: tensor.detach().clone() for name, tensor in weights.items()}
        super().publish_rollout_weights(version)

    def gap_to_sampling_version(self, rows: dict, version: int) -> float:
        import copy

        if self._version_model is None:
            self._version_model = copy.deepcopy(self.accelerator.unwrap_model(self.model)).eval()
        self._version_model.load_state_dict(self.trainer_versions[version])
        ids = torch.cat([rows["prompt_ids"], rows["completion_ids"]], dim=1)
        mask = torch.cat([rows["prompt_mask"], rows["completion_mask"]], dim=1)
        with torch.no_grad():
            keep = rows["completion_ids"].size(1)
            logps = self._get_per_token_logps_and_entropies(self._version_model, ids, mask, keep, batch_size=8)[0]
        sampled = rows["sampling_per_token_logps"]
        where = rows["completion_mask"].bool() & torch.isfinite(sampled)
        return (logps - sampled)[where].abs().max().item()


def mode_settings(mode: str, out: Path, arguments: list[str]) -> tuple[dict, list[str]]:
    """The DAPOConfig fields of a mode, and the arguments left for overrides."""
    if mode == "server":
        base_url = arguments[0]
        settings = {
            "vllm_mode": "server",
            "vllm_server_base_url": base_url,
            "vllm_server_timeout": 120.0,
            "vllm_weight_sync": "shared_storage",
            "vllm_weight_sync_dir": str(out / "vllm_weights"),
            "vllm_request_timeout": 300.0,
        }
        return settings, arguments[1:]
    if mode == "colocate":
        return {"vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3, "vllm_max_model_length": 256}, arguments
    raise SystemExit(f"mode must be 'server' or 'colocate', got {mode!r}")


class ServerFault:
    """A signal to the server just before the first generation request of step 2 (weights version 1): SIGSTOP to its
    process (`freeze_server=PID`), or SIGKILL to its process group (`kill_server=PID`). Round by round the request is
    TRL's client's POST /v1/completions; streamed, the driver's first group of version 1."""

    def __init__(self, trainer: DAPOTrainer, pid: int, kill: bool):
        self.pid, self.kill, self.done = pid, kill, False
        if trainer._rollout is None:
            client = trainer.vllm_generation.vllm_client
            post = client._post

            def faulty_post(url: str, **kwargs):
                if url.endswith("/v1/completions") and trainer.state.global_step >= 1:
                    self.strike()
                return post(url, **kwargs)

            client._post = faulty_post
        else:
            engine = trainer._rollout.driver.engine
            start = engine.start

            def faulty_start(request, done):
                if request.version >= 1:
                    self.strike()
                return start(request, done)

            engine.start = faulty_start

    def strike(self) -> None:
        if not self.done:
            self.done = True
            if self.kill:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGSTOP)
            print("killed the server" if self.kill else "froze the server", flush=True)


class FrozenServerAtStep1(TrainerCallback):
    """`frozen_server=PID`: the server's process group (its API server and engine core) is stopped for good (SIGSTOP)
    as step 1 begins: "froze the server at T" (T from time.time())."""

    def __init__(self, pid: int):
        self.pid = pid

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 1:
            os.killpg(self.pid, signal.SIGSTOP)
            print(f"froze the server at {time.time()}", flush=True)


def main() -> None:
    mode, out, model_dir = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    settings, rest = mode_settings(mode, out, sys.argv[4:])
    overrides = parse_overrides(rest)
    check_syncs = overrides.pop("check_syncs", True)
    lora = overrides.pop("lora", None)
    lora_experts = overrides.pop("lora_experts", False)
    with_tools = overrides.pop("tools", False)
    RecordedStreaming.check_versions = overrides.pop("check_versions", False)
    resume, crash_after = overrides.pop("resume", None), overrides.pop("crash_after_save", None)
    freeze_server, kill_server = overrides.pop("freeze_server", None), overrides.pop("kill_server", None)
    frozen_server = overrides.pop("frozen_server", None)
    for option in FAULT:
        FAULT[option] = overrides.pop(option, FAULT[option])
    out.mkdir(parents=True, exist_ok=True)
    settings.update(
        output_dir=str(out / "run"),
        use_vllm=True,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1e-2,  # large, so each step visibly moves the weights the engine must pick up
        filter_groups_enable=True,
        max_filter_gen_batches=2,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    rows = [{"prompt": f"What is {i} plus {i % 7}?", "solution": str(i + i % 7)} for i in range(64)]
    trainer_class, tool_options = DAPOTrainer, {}
    if mode == "server" and settings.get("rollout_streaming"):
        trainer_class, RecordedStreaming.out = RecordedStreaming, out
    if with_tools:  # room for the tool schema in the prompt, the call, its reply and the next turn
        from transformers import AutoTokenizer
        from trl.chat_template_utils import qwen2_5_chat_template

        settings.update(max_completion_length=128, max_tool_calling_iterations=1, vllm_max_model_length=1024)
        rows = [{**row, "prompt": [{"role": "user", "content": row["prompt"]}]} for row in rows]
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        tokenizer.chat_template = qwen2_5_chat_template
        trainer_class, tool_options = ScriptedToolCalls, {"tools": [add], "processing_class": tokenizer}
    peft_config = None
    if lora is not None:
        from peft import LoraConfig

        # On the experts: attention and the routers by name ("all-linear" with target_parameters makes PEFT 0.21 add a
        # fused-experts rank pattern that matches no module, and warn), the experts' 3-D weights as parameters.
        modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate"] if lora_experts else "all-linear"
        experts = {"target_parameters": ["experts.gate_up_proj", "experts.down_proj"]} if lora_experts else {}
        peft_config = LoraConfig(r=lora, lora_alpha=2 * lora, target_modules=modules, task_type="CAUSAL_LM", **experts)
    trainer = trainer_class(
        model=model_dir,
        reward_funcs=parity_reward,
        args=DAPOConfig(**settings),
        train_dataset=Dataset.from_list(rows),
        peft_config=peft_config,
        **tool_options,
    )
    if not check_syncs:  # plain training, e.g. to watch what happens when the server dies
        if crash_after is not None:
            trainer.add_callback(CrashAfterSave(crash_after))
        if freeze_server is not None or kill_server is not None:
            ServerFault(trainer, freeze_server or kill_server, kill=kill_server is not None)
        if frozen_server is not None:
            trainer.add_callback(FrozenServerAtStep1(frozen_server))
        if FAULT["fault"] in (*RELOAD_FAULTS, "sigterm_in_generation"):
            inject_engine_fault(trainer, out)
        if FAULT["fault"] == "kill_in_publish":
            kill_while_publishing(out)
        if FAULT["fault"] == "sigterm_in_save":
            signal_in_save(trainer, out)
        (out / f"pid_rank{trainer.accelerator.process_index}").write_text(str(os.getpid()))
        try:
            trainer.train(resume_from_checkpoint=resume)
        except Exception:
            (out / "failed_at").write_text(str(time.time()))
            raise
        if trainer.accelerator.is_main_process:
            (out / "log_history.json").write_text(json.dumps(trainer.state.log_history))
            (out / "version_gaps.json").write_text(json.dumps(RecordedStreaming.version_gaps))
            weights = trainer.accelerator.unwrap_model(trainer.model).state_dict()
            torch.save({name: tensor.detach().cpu() for name, tensor in weights.items()}, out / "final_params.pt")
        return
    token_ids = trainer.processing_class(CHECK_TEXT).input_ids
    backend = trainer.vllm_generation
    if mode == "server":
        base_url, served_model = settings["vllm_server_base_url"], served_model_name(settings["vllm_server_base_url"])

        def engine_logprobs():
            return server_sequence_logprobs(base_url, served_model, token_ids)[1:]
    else:

        def engine_logprobs():
            return engine_sequence_logprobs(backend.llm, token_ids)[1:]

    def gap_to_engine() -> float:
        served = engine_logprobs()
        # Gathered like TRL's generation does (ZeRO-3: a bare forward of the partitioned module breaks backward).
        with unwrap_model_for_generation(trainer.model_wrapped, trainer.accelerator) as model:
            was_training = model.training
            model.eval()
            local = model_sequence_logprobs(model, token_ids)
            model.train(was_training)
        return max(abs(a - b) for a, b in zip(served, local, strict=True))

    checks = []
    original_sync = backend.sync_weights

    def checked_sync():
        before = gap_to_engine()  # the engine still has the previous weights
        start = time.monotonic()
        original_sync()
        seconds = time.monotonic() - start
        after = gap_to_engine()
        step = trainer.state.global_step
        checks.append(
            {"global_step": step, "gap_before_sync": before, "gap_after_sync": after, "sync_seconds": seconds}
        )
        print(f"[sync check] step {step}: gap before {before:.3g}, after {after:.3g}, sync {seconds:.3f} s", flush=True)

    backend.sync_weights = checked_sync
    start = time.monotonic()
    trainer.train()
    train_seconds = time.monotonic() - start
    checked_sync()  # the weights after the last step
    worst = max(check["gap_after_sync"] for check in checks)
    moved = [check["gap_before_sync"] for check in checks[1:]]
    passed = worst <= TOLERANCE and all(gap > TOLERANCE for gap in moved)
    if trainer.accelerator.is_main_process:
        model = trainer.accelerator.unwrap_model(trainer.model)
        trained = sorted(name for name, parameter in model.named_parameters() if parameter.requires_grad)
        result = {
            "train_seconds": train_seconds,
            "backend": type(backend).__name__,
            "checks": checks,
            "log_history": trainer.state.log_history,
            "tolerance": TOLERANCE,
            "model_class": type(model).__name__,
            "trained_parameters": trained,
            "tool_turn_calls": ScriptedToolCalls.tool_turn_calls,
        }
        (out / "sync_checks.json").write_text(json.dumps(result, indent=2, default=float))
        print(f"train {train_seconds:.1f} s; worst gap after sync {worst:.3g}; gaps before sync {moved}")
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
