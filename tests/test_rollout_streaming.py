"""Streaming dynamic sampling and generation overlapped with training (`rollout_streaming`, `rollout_max_staleness`).

A deterministic fake engine (tests/scripts/fake_engine.py) stands in for the vLLM server: its completions depend on
(prompt, weights version, index) only, and each group finishes after a random delay, so groups complete out of order
and differently in every run. The batches must not care.
"""

import contextlib
import http.server
import json
import math
import random
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import NamedTuple

import pytest
import torch
from datasets import Dataset

from dapo_trl import DAPOConfig, DAPOTrainer
from dapo_trl.builtin_models import build_tiny_model
from dapo_trl.training.rollout import colocate_engine, rollout_stream, server_engine
from dapo_trl.training.rollout.colocate_engine import VLLMColocateEngine
from dapo_trl.training.rollout.rollout_engine import GroupRequest, GroupResult, RequestSampling
from dapo_trl.training.rollout.rollout_stream import (
    MAX_TAIL_WAVES,
    MAX_WAVES_PER_ROUND,
    RolloutDriver,
    ServerStreamingRollout,
)
from dapo_trl.training.rollout.server_engine import VLLMServerEngine
from dapo_trl.training.rollout.stream_plan import group_seed, plan_horizon
from dapo_trl.training.sampling.dynamic_sampling import DynamicSampler, ScoredRound
from dapo_trl.training.sampling.streams import PromptStream

from .helpers import REPO, SCRIPTS, python_command, read_jsonl, run_command, run_unchecked
from .helpers import trained_rows as batches  # every trained row per step, to compare runs batch for batch
from .scripts.fake_engine import FakeEngine, fake_completion

SCRIPT = str(SCRIPTS / "streaming_run.py")
GROUP, EOS, MAX_TOKENS = 4, 2, 8


# ---------------------------------------------------------------------------------------------------- end to end
def train(out, steps: int, *overrides: str, processes: int = 1, per_device: int = 8, deepspeed: str | None = None):
    command = python_command(
        SCRIPT, str(out), str(per_device), str(steps), *overrides, num_processes=processes, deepspeed_config=deepspeed
    )
    return run_command(command)


def replayed_experts(out, rank: int) -> list[Counter]:
    """How many tokens each expert took in each of a process's training passes (the replayed routing), pass by pass."""
    return [
        Counter(expert for routing in record["routings"] for token in routing for layer in token for expert in layer)
        for record in read_jsonl(out / f"trained_rank{rank}.jsonl")
    ]


def assert_one_pack_of_routing_per_forward(out, rank: int = 0) -> None:
    """Routing replay: each forward (training and scoring) got its pack's routing, token for token, on the model's
    device; the micro-batches' routings stay in host memory (`routing_device` in the trained records)."""
    forwards = read_jsonl(out / f"replayed_rank{rank}.jsonl")
    assert any(forward["grad"] for forward in forwards) and any(not forward["grad"] for forward in forwards)
    for forward in forwards:
        assert forward["routing_device"] == forward["model_device"], forward
        assert forward["routing_shape"][:2] == forward["input_shape"], forward


def rollout_metrics(out) -> list[dict]:
    history = json.loads((out / "log_history.json").read_text())
    return [entry for entry in history if "rollout/staleness_mean" in entry]


def decided_metrics(out) -> list[dict]:
    """Each step's reward, length and dynamic-sampling metrics: those timing must not change."""
    names = ("reward", "frac_reward_zero_std", "rewards/", "completions/", "dynamic_sampling/")
    return [{name: value for name, value in entry.items() if name.startswith(names)} for entry in rollout_metrics(out)]


@pytest.mark.e2e
def test_streaming_gives_the_batches_of_rounds(tmp_path):
    """k = 0: groups finish in any order, yet every step trains exactly the batch rounds would (same prompts, same
    completions, same advantages), streamed on two processes against rounds on one. With tools: half of the first
    turns call a tool, and TRL's tool loop runs the call and the next turn after each streamed wave as after a round."""
    train(tmp_path / "rounds", 3, "tools=true")
    train(tmp_path / "stream", 3, "tools=true", "rollout_streaming=true", "timing_seed=2", processes=2, per_device=4)
    rounds = batches(tmp_path / "rounds")
    assert sorted(rounds) == [0, 1, 2] and all(len(rows) == 8 for rows in rounds.values())
    assert batches(tmp_path / "stream", processes=2) == rounds
    # As with colocated vLLM: an engine on every process, each generating the groups it owns, waves gathered.
    train(
        tmp_path / "spread",
        3,
        "tools=true",
        "rollout_streaming=true",
        "engine_per_process=true",
        processes=2,
        per_device=4,
    )
    assert batches(tmp_path / "spread", processes=2) == rounds
    metrics = rollout_metrics(tmp_path / "stream")
    # Two runs that trained the same batches with other timings and wave splits log the same step metrics.
    assert decided_metrics(tmp_path / "stream") == decided_metrics(tmp_path / "spread")
    assert all(0 < entry["tools/call_frequency"] < 1 for entry in metrics)  # the loop ran, on some rows
    assert [entry["rollout/staleness_max"] for entry in metrics] == [0, 0, 0]
    assert sum(entry["dynamic_sampling/rounds"] for entry in metrics) > 3  # extra rounds were streamed
    assert all(0 < entry["rollout/engine_busy_fraction"] <= 1 for entry in metrics)
    loads = json.loads((tmp_path / "stream" / "engine.json").read_text())["loads"]
    assert loads == [0, 1, 2]  # one weights version per step, loaded before the step's groups


@pytest.mark.e2e
def test_streaming_without_dynamic_sampling_trains_the_batches_of_plain_grpo(tmp_path):
    """filter_groups_enable=false: no group is filtered, so a step is its dataloader batch, streamed group by group
    (what routing replay and overlap need): the prompts TRL's own generation trains (one request for the batch; the
    stand-in samples it unseeded, so the completions differ)."""
    train(tmp_path / "plain", 2, "filter_groups_enable=false")
    train(tmp_path / "stream", 2, "filter_groups_enable=false", "rollout_streaming=true", "timing_seed=3")
    plain = {step: sorted(row[0] for row in rows) for step, rows in batches(tmp_path / "plain").items()}
    assert sorted(plain) == [0, 1] and all(len(prompts) == 8 for prompts in plain.values())
    streamed = {step: sorted(row[0] for row in rows) for step, rows in batches(tmp_path / "stream").items()}
    assert streamed == plain
    metrics = rollout_metrics(tmp_path / "stream")
    assert [entry["dynamic_sampling/keep_rate"] for entry in metrics] == [1.0, 1.0]
    assert [entry["dynamic_sampling/rounds"] for entry in metrics] == [1.0, 1.0]


@pytest.mark.e2e
def test_overlap_survives_a_crash_and_any_timing_under_zero3(tmp_path):
    """k = 1 with carried surplus and two optimizer updates per rollout, on the tiny mixture-of-experts model with
    routing replay (the fake engine returns each completion's routed experts): the batches of an uninterrupted run on
    one process, routings included, equal those of a ZeRO-3 run on two processes that dies right after its step-3
    checkpoint, inside generation batch 1, and resumes from it (other engine timings in each leg; each process's
    remaining micro-batches come from the checkpoint, not from a new generation; carried groups keep the weights
    version that sampled them, and their routing, across the checkpoint). The two processes replay different
    routings (their experts differ pass by pass) and ZeRO-3, its MoE blocks leaf modules, does not hang. Under
    ZeRO-3 each scoring forward gathers every parameter: one per scoring pass, a few per generation batch. The
    checkpoint resumed on one process is refused, naming the fix."""
    settings = (
        "moe=true",
        "routing_replay=true",
        "rollout_streaming=true",
        "rollout_max_staleness=1",
        "steps_per_generation=2",
        "gradient_accumulation_steps=1",
        "save_strategy=steps",
        "save_steps=3",
        "filter_groups_carry_surplus=true",
        "filter_groups_oversample=2",
    )
    train(tmp_path / "whole", 6, *settings, "timing_seed=1")
    zero3 = str(REPO / "configs" / "deepspeed" / "zero3_cpu_test.json")
    crashed = tmp_path / "crashed"
    with pytest.raises(AssertionError, match="exited"):
        train(crashed, 6, *settings, "timing_seed=2", "crash_after_save=3", processes=2, per_device=4, deepspeed=zero3)
    assert not (crashed / "run" / "checkpoint-6").exists()
    checkpoint = crashed / "run" / "checkpoint-3"
    train(crashed, 6, *settings, "timing_seed=3", f"resume={checkpoint}", processes=2, per_device=4, deepspeed=zero3)

    def by_generation(steps: dict[int, list]) -> dict[int, list]:  # 1 and 2 processes split a batch differently
        grouped: dict[int, list] = {}
        for step, rows in steps.items():
            grouped.setdefault(step // 2, []).extend(rows)
        return {batch: sorted(rows) for batch, rows in grouped.items()}

    whole = batches(tmp_path / "whole")
    assert sorted(whole) == list(range(6)) and all(row[3] != "None" for rows in whole.values() for row in rows)
    assert {record["routing_device"] for record in read_jsonl(tmp_path / "whole" / "trained_rank0.jsonl")} == {"cpu"}
    assert_one_pack_of_routing_per_forward(tmp_path / "whole")
    assert by_generation(batches(crashed, processes=2)) == by_generation(whole)
    passes = list(zip(replayed_experts(crashed, 0), replayed_experts(crashed, 1), strict=True))
    assert any(ours != theirs for ours, theirs in passes)
    assert all(set(ours) - {0} and set(theirs) - {0} for ours, theirs in passes)  # replayed: experts, not 0s
    metrics = rollout_metrics(tmp_path / "whole")  # one entry per generation batch
    assert all(0 <= entry["routing_replay/router_agreement"] <= 1 for entry in metrics)
    # Batch j samples version max(0, j - 1); a carried group was sampled for batch j - 1, by max(0, j - 2).
    carried = [entry["dynamic_sampling/carried_in_groups"] > 0 for entry in metrics]
    assert any(carried) and [entry["rollout/staleness_max"] for entry in metrics] == [
        batch - max(0, batch - 1 - carried_in) for batch, carried_in in enumerate(carried)
    ]
    assert json.loads((tmp_path / "whole" / "engine.json").read_text())["loads"][:3] == [0, 1, 2]
    # Gathers: scoring forwards per generation batch are a few per pass (a round's 8 local rows in chunks of at most
    # 4 rows, token-balanced), and passes at most 4 per round: bounded by rounds, not by finished groups. Step 3,
    # resumed inside batch 1, scores nothing: its micro-batches were in the checkpoint.
    logged = {entry["step"]: entry for entry in rollout_metrics(crashed)}  # logged at the step's end
    for rank in range(2):
        forwards = {record["step"]: record["forwards"] for record in read_jsonl(crashed / f"forwards_rank{rank}.jsonl")}
        resumed = {step: count for step, count in forwards.items() if step >= 3}
        assert sorted(resumed) == [3, 4, 5] and resumed[3] == 0 and resumed[5] == 0
        passes, rounds = logged[5]["rollout/scoring_passes"], logged[5]["dynamic_sampling/rounds"]
        assert passes <= MAX_WAVES_PER_ROUND * rounds + MAX_TAIL_WAVES
        # passes + 1: routing replay's mismatch without replay scores a batch's first wave once more
        assert passes <= resumed[4] <= 2 * 2 * (passes + 1), (resumed[4], passes)
    # checkpoint-3, inside generation batch 1, holds each process's own rows: resumed on one process it is refused,
    # naming the fix, before anything trains.
    refused = run_unchecked(
        python_command(SCRIPT, str(tmp_path / "one"), "8", "6", *settings, f"resume={checkpoint}", num_processes=1)
    )
    assert refused.returncode != 0 and "saved by 2 processes" in refused.stderr, refused.stderr[-3000:]
    assert "resume with 2 processes" in refused.stderr and not (tmp_path / "one" / "trained_rank0.jsonl").exists()


@pytest.mark.e2e
def test_routing_replay_trains_every_ppo_epoch_and_steps_that_span_two_generation_batches(tmp_path):
    """Routing replay with two PPO epochs (`num_iterations=2`: each micro-batch trains twice, so its routings stay on
    the shelves until its second pass) and three micro-batches an optimizer step over generation batches of two (a
    step spans two generation batches: the second is dealt while the first still has a micro-batch to train, whose
    routings the deal must spare), on one process and on two under ZeRO-3: every micro-batch's two passes replay
    the same routing, and the two layouts train the same rows with the same routings."""
    settings = (
        "moe=true",
        "routing_replay=true",
        "rollout_streaming=true",
        "num_iterations=2",
        "steps_per_generation=2",
        "gradient_accumulation_steps=3",
    )
    zero3 = str(REPO / "configs" / "deepspeed" / "zero3_cpu_test.json")
    train(tmp_path / "one", 4, *settings, per_device=4)
    train(tmp_path / "two", 4, *settings, processes=2, per_device=2, deepspeed=zero3)

    def passes(out, rank: int) -> list[list[tuple]]:
        """The process's micro-batches in training order: (prompt, completion, advantage, routing) rows."""
        records = read_jsonl(out / f"trained_rank{rank}.jsonl")
        return [
            sorted(
                zip(
                    record["prompts"],
                    map(tuple, record["completion_ids"]),
                    record["advantages"],
                    map(repr, record["routings"]),
                    strict=True,
                )
            )
            for record in records
        ]

    def by_generation(out, processes: int) -> list[list[tuple]]:
        """Each generation batch's rows (4 micro-steps: 2 micro-batches x 2 epochs), over all processes."""
        batches: dict[int, list] = {}
        for rank in range(processes):
            trained = passes(out, rank)
            assert len(trained) == 12  # 4 optimizer steps x 3 micro-batches
            for index in range(0, len(trained), 4):  # micro-step 4j..4j+3: batch j, epochs 0 and 1
                first, second = trained[index : index + 2], trained[index + 2 : index + 4]
                assert first == second  # the second epoch replays what the first did, row for row
                assert all(row[3] != repr([]) for batch in first for row in batch)
                batches.setdefault(index // 4, []).extend(row for batch in first for row in batch)
        return [sorted(rows) for _, rows in sorted(batches.items())]

    one = by_generation(tmp_path / "one", 1)
    assert len(one) == 3 and by_generation(tmp_path / "two", 2) == one


@pytest.mark.e2e
def test_overlap_with_four_updates_per_rollout_trains_a_lagged_synchronous_runs_batches(tmp_path):
    """DAPO's schedule (several optimizer updates per rollout) overlapped: k = 1 with steps_per_generation 4 and one
    micro-batch per update trains, step by step, what a synchronous run trains whose sampler lags one weights
    version: a version per generation batch, not per optimizer step, loaded once per generation batch."""
    layout = ("steps_per_generation=4", "gradient_accumulation_steps=1", "rollout_streaming=true")
    train(tmp_path / "lagged", 12, *layout, "engine_lag=1", "stream_only=true", per_device=4)
    train(tmp_path / "overlapped", 12, *layout, "rollout_max_staleness=1", "timing_seed=4", per_device=4)
    lagged = batches(tmp_path / "lagged")
    assert sorted(lagged) == list(range(12)) and all(len(rows) == 4 for rows in lagged.values())
    assert batches(tmp_path / "overlapped") == lagged
    logged = [entry["rollout/staleness_max"] for entry in rollout_metrics(tmp_path / "overlapped")]
    assert logged == [0, 1, 1]  # one entry per generation batch: batch 0 has no older weights
    loads = json.loads((tmp_path / "overlapped" / "engine.json").read_text())["loads"]
    assert loads[:3] == [0, 1, 2]  # version j: the weights after generation batch j - 1's four updates


# ----------------------------------------------------------------------------- staleness equivalence, without a model
PROMPTS = [f"{'mixed' if i % 2 else 'easy'} {i}" for i in range(40)]


def tokenize(prompts: list[str]) -> list[list[int]]:
    return [[3 + ord(c) % 50 for c in prompt] for prompt in prompts]


def accuracy(prompt: str, completion: list[int]) -> float:
    """Easy prompts are always right; mixed ones by the parity of the completion (so groups differ by content)."""
    return 1.0 if prompt.startswith("easy") or sum(completion) % 2 == 0 else -1.0


def scored(rows: list[dict], completions: list[list[int]]) -> ScoredRound:
    width = max(len(ids) for ids in completions)
    ids = torch.tensor([ids + [0] * (width - len(ids)) for ids in completions])
    index = torch.tensor([PROMPTS.index(row["prompt"]) for row in rows])
    return ScoredRound(
        rows={"prompt_ids": index[:, None], "completion_ids": ids, "advantages": torch.zeros(len(rows))},
        accuracy=torch.tensor([accuracy(row["prompt"], c) for row, c in zip(rows, completions, strict=True)]),
    )


def settings(**overrides):
    args = dict(
        output_dir="unused",
        num_generations=GROUP,
        per_device_train_batch_size=8,
        use_cpu=True,
        rollout_streaming=True,
        max_filter_gen_batches=0,
        report_to="none",
        seed=5,
    )
    return DAPOConfig(**{**args, **overrides})


def streamed_batches(
    staleness: int, steps: int, timing_seed: int, metrics: list | None = None
) -> tuple[list[list], list[int]]:
    """Batches of a StreamingRollout on the fake engine, the trainer 'training' for a random while between them."""
    args = settings(rollout_max_staleness=staleness)
    dataset = [{"prompt": prompt} for prompt in PROMPTS]
    sampler = DynamicSampler(args, dataset, GROUP, {}, shuffle=True)
    engine = FakeEngine(GROUP, EOS, MAX_TOKENS, timing_seed, max_delay=0.01)
    driver = RolloutDriver(engine, max_in_flight=3)
    rollout = ServerStreamingRollout(sampler, driver, tokenize, lambda value: value, staleness, 1, wave_timeout=30)
    pace = random.Random(timing_seed)
    out = []
    for _ in range(steps):
        driver.publish(rollout.generation)
        batch, step_metrics = rollout.sample([{}] * 8, lambda rows, prepared: scored(rows, prepared["completion_ids"]))
        if metrics is not None:
            metrics.append(step_metrics)
        completions = [[token for token in ids if token != 0] for ids in batch["completion_ids"].tolist()]
        out.append(list(zip(batch["prompt_ids"][:, 0].tolist(), completions, strict=True)))
        time.sleep(pace.random() * 0.05)  # training
    driver.close()
    return out, engine.loads


def synchronous_stale_batches(staleness: int, steps: int) -> list[list]:
    """The reference, from the rule alone: batch j samples, one group after another in the seeded prompt stream,
    from weights version max(0, j - staleness), and keeps the first 2 groups with spread; rounds of 2 groups are
    consumed whole."""
    stream, drawn = PromptStream(len(PROMPTS), seed=5), 0
    out = []
    for step in range(steps):
        version, kept = max(0, step - staleness), []
        while len(kept) < 2:
            for index in stream.draw(2):  # one round
                prompt, seed, drawn = PROMPTS[index], group_seed(5, ("stream", drawn)), drawn + 1
                (ids,) = tokenize([prompt])
                group = [fake_completion(ids, seed, version, i, EOS, MAX_TOKENS)[0] for i in range(GROUP)]
                if len({accuracy(prompt, c) for c in group}) > 1 and len(kept) < 2:
                    kept.append([(index, c) for c in group])
        out.append(sum(kept, []))
    return out


@pytest.mark.parametrize("staleness", [1, 2])
def test_overlapped_batches_equal_a_synchronous_run_whose_weights_lag_by_staleness(staleness):
    reference, figures = synchronous_stale_batches(staleness, steps=5), []
    for timing_seed in (1, 2):
        metrics = []
        streamed, loads = streamed_batches(staleness, steps=5, timing_seed=timing_seed, metrics=metrics)
        assert streamed == reference
        assert loads[: 5 - staleness] == list(range(5 - staleness))  # each version loaded once, in order
        # Measured from each trained row's own version: batch j samples from max(0, j - staleness).
        assert [m["rollout/staleness_max"] for m in metrics] == [min(j, staleness) for j in range(5)]
        assert [m["rollout/staleness_mean"] for m in metrics] == [min(j, staleness) for j in range(5)]
        # Waves coalesced: a round is scored in at most MAX_WAVES_PER_ROUND passes, whatever finished when.
        assert all(
            1 <= m["rollout/scoring_passes"] <= MAX_WAVES_PER_ROUND * m["dynamic_sampling/rounds"] + MAX_TAIL_WAVES
            for m in metrics
        )
        figures.append([{k: v for k, v in m.items() if k.startswith("dynamic_sampling/")} for m in metrics])
    assert figures[0] == figures[1]  # keep counts of the decided groups: the same whatever finished when


def test_a_wrong_group_seed_changes_the_batches(monkeypatch):
    """The fake engine samples from the request's seed, so the equality above is sensitive to the per-group seed."""
    monkeypatch.setattr(rollout_stream, "group_seed", lambda run_seed, key: group_seed(run_seed, key) + 1)
    streamed, _ = streamed_batches(1, steps=2, timing_seed=1)
    assert streamed != synchronous_stale_batches(1, steps=2)


def test_group_seeds_are_stable_and_distinct():
    keys = [("stream", n) for n in range(1000)] + [("batch", 3, g) for g in range(8)]
    seeds = [group_seed(42, key) for key in keys]
    assert len(set(seeds)) == len(seeds) and all(0 <= seed < 2**31 for seed in seeds)
    assert group_seed(42, ("stream", 7)) == group_seed(42, ("stream", 7)) != group_seed(43, ("stream", 7))


class FailingEngine(FakeEngine):
    def start(self, request, done):
        done(request, RuntimeError("POST http://server/v1/completions: no answer within 5 s"))


def test_a_failing_engine_stops_sampling_with_its_error():
    args = settings()
    sampler = DynamicSampler(args, [{"prompt": p} for p in PROMPTS], GROUP, {}, shuffle=True)
    driver = RolloutDriver(FailingEngine(GROUP, EOS, MAX_TOKENS, 0), max_in_flight=2)
    rollout = ServerStreamingRollout(sampler, driver, tokenize, lambda value: value, 1, 1, wave_timeout=5)
    driver.publish(0)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="no answer within 5 s"):
        rollout.sample([{}] * 8, lambda rows, prepared: scored(rows, prepared["completion_ids"]))
    assert time.monotonic() - started < 5


def test_the_driver_loads_a_version_only_when_nothing_of_the_last_one_runs():
    engine = FakeEngine(GROUP, EOS, MAX_TOKENS, 0, max_delay=0.05)
    driver = RolloutDriver(engine, max_in_flight=4)
    requests = [GroupRequest(("stream", n), [5, 6], n, version=n // 4) for n in range(12)]
    driver.plan(requests)
    driver.publish(0)
    assert driver.ready_prefix([r.key for r in requests[:4]], 4, timeout=10) >= 4
    time.sleep(0.1)
    assert engine.loads == [0]  # version 1 is not published yet
    driver.publish(2)
    assert driver.ready_prefix([r.key for r in requests], 12, timeout=10) == 12
    assert engine.loads == [0, 1, 2]  # FakeEngine.start asserts each group ran on its own version
    driver.close()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"rollout_max_staleness": 1, "rollout_streaming": False}, "also pass --rollout_streaming true"),
        ({"rollout_max_staleness": -1}, "rollout_max_staleness=-1 must be >= 0"),
        ({"rollout_max_staleness": 1, "use_vllm": True, "vllm_mode": "server"}, "--vllm_weight_sync shared_storage"),
        ({"rollout_max_staleness": 1, "use_vllm": True, "vllm_mode": "colocate"}, "devices of its own"),
        ({"use_vllm": True, "vllm_mode": "colocate", "vllm_enable_sleep_mode": True}, "--vllm_enable_sleep_mode off"),
        ({"use_vllm": True, "vllm_mode": "colocate", "vllm_tensor_parallel_size": 2}, "--vllm_tensor_parallel_size 1"),
        (
            {
                "rollout_max_staleness": 1,
                "use_vllm": True,
                "vllm_mode": "server",
                "vllm_weight_sync": "shared_storage",
                "vllm_importance_sampling_correction": False,
            },
            "needs --vllm_importance_sampling_correction true",
        ),
        ({"kl_in_reward": True, "kl_in_reward_controller": "adaptive"}, "kl_in_reward_controller='fixed'"),
        ({"rollout_in_flight_weight_updates": True}, "--rollout_max_staleness 1 (or more)"),
        (
            {"rollout_max_staleness": 1, "use_vllm": True, "vllm_mode": "server", "vllm_weight_sync": "nccl"},
            "over NCCL needs --rollout_in_flight_weight_updates true",
        ),
        ({"rollout_in_flight_kv_cache": "drop"}, "must be 'recompute' or 'keep'"),
        ({"rollout_max_in_flight_groups": 0}, "rollout_max_in_flight_groups=0 must be >= 1"),
    ],
)
def test_bad_streaming_settings_are_refused_with_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        settings(**overrides)


# ----------------------------------------------------------------------------------- the vLLM server engine's HTTP
class FakeCompletions(http.server.BaseHTTPRequestHandler):
    """`/v1/models` and a slow `/v1/completions` answering `n` choices of 3 tokens; records every request body."""

    bodies: list = []

    def do_GET(self):
        self._answer({"data": [{"id": "tiny"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeCompletions.bodies.append(body)
        time.sleep(0.3)
        choice = {"token_ids": [5, 6, body["seed"] % 50], "logprobs": {"token_logprobs": [-0.1, -0.2, -0.3]}}
        with contextlib.suppress(OSError):  # a cancelled request's client is gone
            self._answer({"choices": [choice] * body["n"]})

    def _answer(self, payload):
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def test_the_server_engine_sends_seeded_groups_and_a_cancelled_key_can_run_again():
    """Cancelling a running group closes its connection and drops its answer; the same key requested again (the
    group regenerated under the next weights) runs and answers."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeCompletions)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    engine = VLLMServerEngine(f"http://127.0.0.1:{server.server_port}", RequestSampling(n=GROUP, max_tokens=8), 4, 10)
    answers, finished = [], threading.Event()

    def done(request, result):
        answers.append((request, result))
        finished.set()

    first = GroupRequest(("stream", 3), [7, 8], seed=11, version=0)
    again = GroupRequest(("stream", 3), [7, 8], seed=11, version=1)
    engine.start(first, done)
    time.sleep(0.1)
    engine.cancel(first)
    engine.start(again, done)
    assert finished.wait(10)
    time.sleep(0.5)  # the cancelled one would have answered by now
    engine.close()
    server.shutdown()
    assert [request for request, _ in answers] == [again]
    result = answers[0][1]
    assert result.version == 1 and result.completion_ids == [[5, 6, 11]] * GROUP
    assert result.logprobs[0] == torch.tensor([-0.1, -0.2, -0.3]).tolist()  # held as float32, as TRL holds them
    body = FakeCompletions.bodies[-1]
    assert (body["prompt"], body["n"], body["seed"], body["max_tokens"]) == ([[7, 8]], GROUP, 11, 8)


# ------------------------------------------------------------------------------ the colocated engine's stepping thread
class FakeLLMEngine:
    """vLLM's in-process engine as VLLMColocateEngine uses it: each request finishes after `steps` engine steps with
    `n` completions of 3 tokens; records the thread of every call (vLLM's engine is not thread-safe)."""

    def __init__(self, steps: int = 3, fail_at_step: int | None = None):
        self.steps, self.fail_at_step = steps, fail_at_step
        self.running: dict[str, list] = {}  # id -> [steps left, params]
        self.aborted: list[str] = []
        self.sent: list[tuple] = []  # (prompt ids, sampling params) of every request
        self.threads: set[str] = set()
        self.step_count = 0

    def _call(self):
        self.threads.add(threading.current_thread().name)

    def add_request(self, request_id, prompt, params):
        self._call()
        self.running[request_id] = [self.steps, params]
        self.sent.append((prompt["prompt_token_ids"], params))

    def abort_request(self, request_ids):
        self._call()
        for request_id in request_ids:
            self.aborted.append(request_id)
            self.running.pop(request_id, None)

    def has_unfinished_requests(self):
        self._call()
        return bool(self.running)

    def step(self):
        self._call()
        self.step_count += 1
        if self.step_count == self.fail_at_step:
            raise MemoryError("KV cache exhausted")
        time.sleep(0.01)
        outputs = []
        for request_id, entry in list(self.running.items()):
            entry[0] -= 1
            if entry[0] == 0:
                params = self.running.pop(request_id)[1]
                first = (params["seed"] or 0) % 50
                completions = [
                    SimpleNamespace(
                        index=i,
                        token_ids=[first, i, 7],
                        logprobs=[{first: Logprob(-0.5)}, {i: Logprob(-0.25)}, {7: Logprob(None)}],
                    )
                    for i in reversed(range(params["n"]))
                ]
                outputs.append(SimpleNamespace(request_id=request_id, finished=True, outputs=completions))
        return outputs


class Logprob(NamedTuple):
    logprob: float | None


def colocated_engine(monkeypatch, fake: FakeLLMEngine) -> VLLMColocateEngine:
    class Params(dict):
        def __init__(self, **kwargs):
            super().__init__(kwargs)

    monkeypatch.setattr(colocate_engine, "vllm_sampling_params", lambda: (Params, "final-only"))
    return VLLMColocateEngine(SimpleNamespace(llm_engine=fake), RequestSampling(n=3, max_tokens=8), timeout=5)


def test_the_colocated_engine_steps_groups_on_its_own_thread_and_aborts_cancelled_ones(monkeypatch):
    fake = FakeLLMEngine()
    engine = colocated_engine(monkeypatch, fake)
    answers, lock = {}, threading.Lock()

    def done(request, result):
        with lock:
            answers[request.key] = result

    requests = [GroupRequest(("stream", n), [1, 2, n], seed=100 + n, version=0) for n in range(4)]
    for request in requests:
        engine.start(request, done)
    engine.cancel(requests[2])
    engine.wait_idle()
    assert sorted(answers) == [("stream", 0), ("stream", 1), ("stream", 3)]  # the cancelled group never answers
    result = answers[("stream", 3)]
    assert result.completion_ids == [[103 % 50, i, 7] for i in range(3)]  # in completion order, whatever vLLM's
    assert result.logprobs == [[-0.5, -0.25, float("-inf")]] * 3
    assert len(fake.aborted) == 1 and not fake.running
    assert [ids for ids, _ in fake.sent] == [[1, 2, n] for n in range(4)]
    assert [(p["n"], p["seed"], p["logprobs"], p["max_tokens"]) for _, p in fake.sent] == [
        (3, 100 + n, 0, 8) for n in range(4)
    ]
    assert all(params.output_kind == "final-only" for _, params in fake.sent)  # one output per group, all n in it
    assert fake.threads == {"dapo-colocate-engine"}  # every engine call from the stepping thread
    engine.close()


def test_a_tool_loops_next_turns_run_on_the_stepping_thread_beside_the_streamed_groups(monkeypatch):
    fake = FakeLLMEngine(steps=4)
    engine = colocated_engine(monkeypatch, fake)
    answers = {}
    engine.start(GroupRequest(("stream", 0), [9], seed=7, version=0), lambda r, res: answers.update({r.key: res}))
    completions, logprobs = engine.generate_turns([[1, 2], [3], [1, 2]])
    assert [ids[1:] for ids in completions] == [[0, 7]] * 3 and logprobs == [[-0.5, -0.25, float("-inf")]] * 3
    turns = [params for ids, params in fake.sent if ids != [9]]
    assert [params["n"] for params in turns] == [1, 1, 1] and all(params["seed"] is None for params in turns)
    engine.wait_idle()
    assert list(answers) == [("stream", 0)] and fake.threads == {"dapo-colocate-engine"}
    engine.close()


def test_a_failing_colocated_engine_fails_every_running_group(monkeypatch):
    engine = colocated_engine(monkeypatch, FakeLLMEngine(steps=5, fail_at_step=2))
    answers = {}
    for n in range(2):
        engine.start(GroupRequest(("stream", n), [1], seed=n, version=0), lambda r, res: answers.update({r.key: res}))
    engine.wait_idle()
    assert len(answers) == 2 and all(isinstance(error, RuntimeError) for error in answers.values())
    assert "MemoryError: KV cache exhausted" in str(answers[("stream", 0)])
    engine.close()


def test_streaming_without_an_engine_is_refused_with_the_fix(tmp_path):
    model = str(build_tiny_model(tmp_path / "tiny"))
    dataset = Dataset.from_list([{"prompt": "1 + 1?", "solution": "2"}] * 4)
    with pytest.raises(ValueError, match="rollout_streaming needs vLLM: pass --use_vllm true"):
        DAPOTrainer(model=model, args=settings(output_dir=str(tmp_path / "out")), train_dataset=dataset)


# ------------------------------------------------------------------ races, each interleaving forced with events
class GatedEngine:
    """A `GroupEngine` whose `start` and `load_weights` can be held at a gate, and which, like a real server,
    ignores a cancel that comes before the request started and runs a group only on its own weights."""

    def __init__(self, hold_start: bool = False, hold_load: bool = False):
        self.version: object = None
        self.loads: list[int] = []
        self.started: list[GroupRequest] = []
        self.cancelled: list[GroupRequest] = []
        self.entered, self.release = threading.Event(), threading.Event()
        self.hold_start, self.hold_load = hold_start, hold_load

    def _gate(self, hold: bool) -> None:
        if hold:
            self.entered.set()
            assert self.release.wait(10)

    def start(self, request, done):
        self._gate(self.hold_start)
        assert request.version == self.version, f"group of version {request.version} ran on weights {self.version}"
        self.started.append(request)
        done(request, GroupResult(request.key, request.version, [[5, 2]] * GROUP, [[-0.5, -0.5]] * GROUP))

    def cancel(self, request):
        if request in self.started:
            self.cancelled.append(request)

    def load_weights(self, version):
        self._gate(self.hold_load)
        self.version = version
        self.loads.append(version)

    def close(self):
        pass


def test_a_group_withdrawn_between_admission_and_start_is_cancelled_once_started():
    engine = GatedEngine(hold_start=True)
    driver = RolloutDriver(engine, max_in_flight=2)
    request = GroupRequest(("stream", 0), [1], 7, version=0)
    driver.loaded_externally(0)
    engine.version = 0
    driver.plan([request])
    assert engine.entered.wait(10)  # admitted; engine.start has begun but not returned
    withdrawing = threading.Thread(target=driver.withdraw)
    withdrawing.start()
    time.sleep(0.2)
    assert withdrawing.is_alive()  # withdraw waits for the start in progress ...
    engine.release.set()
    withdrawing.join(10)
    assert engine.cancelled == [request]  # ... and returns once it is cancelled: no orphan on the server
    driver.close()


def test_a_reload_concurrent_with_an_evaluation_sync_never_overrides_it():
    """evaluate(): withdraw, loaded_externally(None), TRL syncs other weights. A reload the driver was running must
    end before, and must not leave the driver believing its version is loaded."""
    engine = GatedEngine(hold_load=True)
    driver = RolloutDriver(engine, max_in_flight=2)
    request = GroupRequest(("stream", 0), [1], 7, version=1)
    driver.plan([request])
    driver.publish(1)
    assert engine.entered.wait(10)  # the driver is reloading version 1

    def evaluation_sync():
        driver.withdraw()
        driver.loaded_externally(None)
        engine.version = "evaluation weights"  # TRL's sync of the current weights

    evaluation = threading.Thread(target=evaluation_sync)
    evaluation.start()
    engine.release.set()
    evaluation.join(10)
    assert engine.version == "evaluation weights"
    driver.plan([request])  # the next batch asks for version 1 again: it must be reloaded
    assert driver.ready_prefix([request.key], 1, timeout=10) == 1
    assert engine.loads == [1, 1] and engine.started == [request]
    driver.close()


class UnstartableEngine(GatedEngine):
    def start(self, request, done):
        raise ConnectionRefusedError("[Errno 111] Connection refused")


def test_an_engine_start_that_raises_surfaces_at_once():
    driver = RolloutDriver(UnstartableEngine(), max_in_flight=2)
    driver.publish(0)
    request = GroupRequest(("stream", 0), [1], 7, version=0)
    driver.plan([request])
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="could not start group .* Connection refused"):
        driver.ready_prefix([request.key], 1, timeout=60)
    assert time.monotonic() - started < 10  # not after the wave timeout
    driver.close()


def test_held_results_bound_the_look_ahead_but_never_what_the_caller_waits_for():
    engine = GatedEngine()
    engine.version = 0
    group_bytes = GROUP * 2 * (4 + 4) + GROUP * 8  # 2-token completions: ids, log-probs, and the lengths
    driver = RolloutDriver(engine, max_in_flight=8, max_held_bytes=3 * group_bytes)  # three groups' bytes
    driver.loaded_externally(0)
    requests = [GroupRequest(("stream", n), [1], n, version=0) for n in range(12)]
    driver.plan(requests)
    time.sleep(0.2)  # let it admit all it may (nothing it holds is taken meanwhile)
    assert len(engine.started) == 3
    keys = [request.key for request in requests]
    assert driver.ready_prefix(keys, 5, timeout=10) >= 5  # the caller needs five: admitted whatever is held
    driver.take(keys[:5])
    assert driver.ready_prefix(keys[5:], 7, timeout=10) == 7
    driver.close()


class MetricsAndCompletions(FakeCompletions):
    """FakeCompletions plus vLLM's `/metrics`: the server still runs `running[0]` requests, one fewer per poll."""

    running = [3]
    reload_saw: list = []

    def do_GET(self):
        if self.path != "/metrics":
            return super().do_GET()
        text = f'vllm:num_requests_running{{engine="0"}} {float(self.running[0])}\nvllm:num_requests_waiting 0.0\n'
        self.running[0] = max(0, self.running[0] - 1)
        data = text.encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def serve(handler):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def test_the_server_runs_none_of_our_requests_when_weights_are_reloaded(tmp_path):
    """An aborted request may hold KV blocks for a while: the engine asks the server before reloading."""
    server = serve(MetricsAndCompletions)
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "model.safetensors").write_bytes(b"")

    def reload(base_url, weights, timeout):
        MetricsAndCompletions.reload_saw.append((weights, MetricsAndCompletions.running[0]))

    engine = VLLMServerEngine(
        f"http://127.0.0.1:{server.server_port}",
        RequestSampling(n=GROUP, max_tokens=8),
        4,
        10,
        "/server/weights",
        reload,
        tmp_path,
    )
    engine.load_weights(1)
    assert MetricsAndCompletions.reload_saw == [("/server/weights/v1", 0)]
    engine.close()
    server.shutdown()


def test_a_group_cancelled_before_its_connection_opens_is_never_sent(monkeypatch):
    connecting, proceed = threading.Event(), threading.Event()
    open_connection = server_engine.asyncio.open_connection

    async def gated_open_connection(*args, **kwargs):
        connecting.set()
        await server_engine.asyncio.get_running_loop().run_in_executor(None, proceed.wait, 10)
        return await open_connection(*args, **kwargs)

    monkeypatch.setattr(server_engine.asyncio, "open_connection", gated_open_connection)
    FakeCompletions.bodies = []
    server = serve(FakeCompletions)
    engine = VLLMServerEngine(f"http://127.0.0.1:{server.server_port}", RequestSampling(n=GROUP, max_tokens=8), 4, 10)
    answers = []
    request = GroupRequest(("stream", 0), [7, 8], seed=11, version=0)
    engine.start(request, lambda r, result: answers.append(result))
    assert connecting.wait(10)
    engine.cancel(request)
    proceed.set()
    deadline = time.monotonic() + 10
    while engine.running() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.4)  # a request that was sent would have been answered by now (the stub answers after 0.3 s)
    assert engine.running() == 0 and FakeCompletions.bodies == [] and answers == []
    engine.close()
    server.shutdown()


def test_streaming_refuses_k1_for_an_engine_of_your_own(tmp_path):
    """TRL applies the off-policy correction only to vLLM's log-probs: an engine of your own at k >= 1 is refused."""

    class OwnEngineTrainer(DAPOTrainer):
        def build_rollout_engine(self, max_in_flight):
            return FakeEngine(GROUP, EOS, MAX_TOKENS, 0)

    model = str(build_tiny_model(tmp_path / "tiny"))
    dataset = Dataset.from_list([{"prompt": "1 + 1?", "solution": "2"}] * 4)
    args = settings(output_dir=str(tmp_path / "out"), rollout_max_staleness=1)
    with pytest.raises(ValueError, match="without the off-policy correction.*--rollout_max_staleness 0"):
        OwnEngineTrainer(model=model, args=args, train_dataset=dataset)


@pytest.mark.e2e
def test_the_driver_moves_a_dapo_scale_batch_within_its_memory_and_thread_budget():
    """512 groups x 16 responses x 16k tokens (134M tokens, the worst case of a DAPO batch) through the driver on one
    process: held as arrays and bounded by the held-token budget, with no thread per group."""
    result = run_command(python_command(str(SCRIPTS / "rollout_scale_run.py"), "512", "16384", "64"), timeout=300)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    print(figures)
    assert figures["tokens"] == 512 * 16 * 16384
    assert figures["rss_growth_mb"] < 1024  # 64 running + 64 held + a 128-group wave at 8 bytes a token: ~400 MB
    assert figures["peak_threads"] <= 4  # the caller, the driver, the engine's worker


def test_a_round_is_scored_in_at_most_four_passes_however_its_groups_finish():
    """Rounds of 32 groups finishing one by one in random order: each wave holds at least a quarter of its round (but
    the round's last, and a few short ones for the batch's last groups), so a round costs at most MAX_WAVES_PER_ROUND
    scoring forwards (plus MAX_TAIL_WAVES a step), not one per finished group."""
    args = settings(per_device_train_batch_size=128, filter_groups_carry_surplus=True)  # whole rounds are scored
    sampler = DynamicSampler(args, [{"prompt": prompt} for prompt in PROMPTS], GROUP, {}, shuffle=True)
    driver = RolloutDriver(FakeEngine(GROUP, EOS, MAX_TOKENS, timing_seed=4, max_delay=0.05), max_in_flight=32)
    rollout = ServerStreamingRollout(sampler, driver, tokenize, lambda value: value, 1, 1, wave_timeout=30)
    waves = []

    def score(rows, prepared):
        waves.append(len(rows) // GROUP)
        return scored(rows, prepared["completion_ids"])

    driver.publish(0)
    _, metrics = rollout.sample([{}] * 128, score)
    driver.close()
    rounds = metrics["dynamic_sampling/rounds"]
    assert rounds >= 2 and sum(waves) == 32 * rounds and len(waves) <= MAX_WAVES_PER_ROUND * rounds + MAX_TAIL_WAVES
    assert sorted(waves)[len(waves) // 2] >= 8 and metrics["rollout/scoring_passes"] == len(waves)


def test_the_planning_horizon_is_the_smallest_count_that_keeps_enough_at_the_normal_bound():
    for missing in (1, 2, 4, 7, 64, 512):
        for keep in (0.1, 0.3, 0.5, 0.9, 1.0):
            z, spread = 1.28, math.sqrt(keep * (1 - keep))
            smallest = next(g for g in range(1, 100_000) if g * keep - z * spread * math.sqrt(g) >= missing)
            assert plan_horizon(missing, keep) == smallest, (missing, keep)
    assert plan_horizon(0, 0.5) == 0 and plan_horizon(512, 0.5) < 1.05 * 1024 and plan_horizon(4, 0.5) == 13


class ClosingMidBody(http.server.BaseHTTPRequestHandler):
    """Answers /v1/completions with a Content-Length it never fills, then closes the connection."""

    def do_GET(self):
        FakeCompletions._answer(self, {"data": [{"id": "tiny"}]})

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b'{"choices": [')
        self.close_connection = True

    def log_message(self, *args):
        pass


def test_a_connection_closed_mid_answer_fails_the_group_at_once():
    server = serve(ClosingMidBody)
    engine = VLLMServerEngine(f"http://127.0.0.1:{server.server_port}", RequestSampling(n=GROUP, max_tokens=8), 4, 60)
    answers, finished = [], threading.Event()
    engine.start(GroupRequest(("stream", 0), [1], 3, 0), lambda r, result: (answers.append(result), finished.set()))
    assert finished.wait(10)  # not after the 60 s request timeout
    assert isinstance(answers[0], RuntimeError) and "IncompleteReadError" in str(answers[0])
    engine.close()
    server.shutdown()


def test_a_colocated_answer_that_cannot_be_read_fails_its_group(monkeypatch):
    class NoLogprobs(FakeLLMEngine):
        def step(self):
            outputs = super().step()
            for output in outputs:
                for completion in output.outputs:
                    completion.logprobs = None
            return outputs

    engine = colocated_engine(monkeypatch, NoLogprobs(steps=1))
    answers, finished = [], threading.Event()
    engine.start(GroupRequest(("stream", 0), [1], 3, 0), lambda r, result: (answers.append(result), finished.set()))
    assert finished.wait(10)
    assert isinstance(answers[0], RuntimeError) and "returned no log-probs" in str(answers[0])
    engine.close()


def test_an_answer_is_read_into_the_arrays_json_gives():
    """The fast read of a vLLM answer (number lists cut out of the bytes, parsed by numpy) gives the arrays of a full
    JSON parse: missing log-probs (null) as -inf, spaces after separators, routed experts; an answer laid out
    otherwise (no token_ids key) goes through json."""
    import base64
    import io

    import numpy as np

    from dapo_trl.training.rollout.server_answers import group_result, group_result_from_json

    buffer = io.BytesIO()
    np.save(buffer, np.arange(6, dtype=np.int32).reshape(3, 1, 2))
    routing = base64.b64encode(buffer.getvalue()).decode()
    choices = [
        {"index": 0, "text": 'say "token_ids":[9]', "token_ids": [5, 6, 7],
         "logprobs": {"tokens": ["token_id:5"], "token_logprobs": [-0.5, None, -1e-3]}, "routed_experts": routing},
        {"index": 1, "text": "", "token_ids": [8], "logprobs": {"token_logprobs": [-2.25]}, "routed_experts": routing},
    ]  # fmt: skip
    request = GroupRequest(("stream", 1), [1, 2], 3, 0)
    for raw in (json.dumps({"choices": choices}).encode(), json.dumps({"choices": choices}, indent=1).encode()):
        fast, slow = group_result(request, raw, 0.0), group_result_from_json(request, raw, 0.0)
        assert fast.completion_ids == slow.completion_ids == [[5, 6, 7], [8]]
        assert fast.logprobs == slow.logprobs and fast.logprobs[0][1] == float("-inf")
        assert [r.tolist() for r in fast.routed_experts] == [r.tolist() for r in slow.routed_experts]
    plain = [{"token_ids": [4], "logprobs": {"token_logprobs": [-1.0]}}]
    renamed = json.dumps({"choices": plain}).replace('"token_ids"', '"ids"').encode()
    with pytest.raises(KeyError):  # not vLLM's layout: json reads it, and says what is missing
        group_result(request, renamed, 0.0)
