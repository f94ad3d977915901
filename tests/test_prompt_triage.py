"""Prompt triage (`training.sampling.prompt_triage`): GRESO's skip rule against a reference written from the paper's
description, its history and adaptation, and dynamic sampling with it over many passes of prompts of known
difficulty: fewer groups generated for the same trained batches, the same decisions on two processes as on one,
and a resumed sampler drawing exactly what the uninterrupted one drew."""

import io
import threading
from types import SimpleNamespace

import pytest
import torch

from dapo_trl.training.sampling.dynamic_sampling import DynamicSampler, Process, ScoredRound
from dapo_trl.training.sampling.prompt_triage import (
    P_INITIAL,
    P_MAX,
    P_MIN,
    P_STEP,
    STREAK_CAP,
    PromptTriage,
    Streak,
    prompt_key,
    skip_probability,
    streak_record,
)
from dapo_trl.training.sampling.streams import PromptStream

GROUP = 4


def reference_skip_probability(streak: int, p: float, floor: float) -> float:
    """GRESO: a prompt that was zero-variance in each of its last `streak` samplings is explored (generated) with
    probability p multiplied once per such sampling, never below the floor; skipped otherwise."""
    explored = 1.0
    for _ in range(streak):
        explored *= p
    return 0.0 if streak == 0 else 1.0 - max(explored, floor)


@pytest.mark.parametrize("streak", [0, 1, 2, 5, 40])
@pytest.mark.parametrize("p", [0.05, 0.5, 0.95])
def test_the_skip_rule_is_gresos(streak, p):
    assert skip_probability(streak, p, 0.01) == pytest.approx(reference_skip_probability(streak, p, 0.01))
    assert skip_probability(streak, p, 0.01) <= 0.99  # the floor: every prompt stays reachable


def test_a_streak_grows_while_groups_agree_and_ends_with_spread():
    triage = PromptTriage(seed=0)
    for _ in range(3):
        triage.begin_step()
        triage.record(["easy", "hard", "mixed"], [True, True, False], [1.0, -1.0, 0.0])
        triage.end_step()
    assert (triage.history[prompt_key("easy")].length, triage.history[prompt_key("easy")].kind) == (3, "easy")
    assert (triage.history[prompt_key("hard")].length, triage.history[prompt_key("hard")].kind) == (3, "hard")
    assert prompt_key("mixed") not in triage.history
    triage.begin_step()
    triage.record(["easy", "hard"], [False, True], [0.0, 1.0])  # easy has spread now; hard became all right
    assert prompt_key("easy") not in triage.history
    assert (triage.history[prompt_key("hard")].length, triage.history[prompt_key("hard")].kind) == (1, "easy")


def test_decisions_read_the_history_as_the_step_began_and_repeat_for_the_same_draw():
    triage = PromptTriage(seed=3, min_agreement=0)  # GRESO's rule as published: every streak acted on
    triage.begin_step()
    triage.record(["a"], [True], [1.0])
    assert not triage.skips("a", "draw/1")  # recorded during the step: counts from the next one
    triage.end_step()
    triage.begin_step()
    triage.p["easy"] = 0.0  # the frozen copy decides, not the live value
    decisions = [triage.skips("a", f"draw/{n}") for n in range(200)]
    assert decisions == [triage.skips("a", f"draw/{n}") for n in range(200)]
    assert 0.3 < sum(decisions) / len(decisions) < 0.7  # P(skip) = 1 - 0.5 ** 1


def reference_lasted_often_enough(outcomes: list[bool], min_agreement: float) -> bool:
    """Laplace's rule of succession: after s successes in n trials the next succeeds with probability
    (s + 1) / (n + 2); a streak is acted on when that chance of lasting once more reaches the bar."""
    return (sum(outcomes) + 1) / (len(outcomes) + 2) >= min_agreement


def agree_again(triage: PromptTriage, prompt: str, agreed: bool) -> None:
    """One step in which `prompt` (carrying an easy streak) is generated: all right again, or with spread."""
    triage.begin_step()
    triage.record([prompt], [agreed], [1.0 if agreed else 0.0])
    triage.end_step()


def test_a_streak_is_acted_on_only_once_streaks_like_it_have_lasted_in_this_run():
    triage = PromptTriage(seed=1, min_agreement=0.9)
    agree_again(triage, "first", True)  # an easy streak of 1: nothing known yet of whether such streaks last
    outcomes: list[bool] = []
    for n in range(30):  # other prompts with an easy streak of 1 generated again: all but the fourth last
        triage.begin_step()
        skipped = any(triage.skips("first", f"draw/{draw}") for draw in range(400))
        assert skipped == reference_lasted_often_enough(outcomes, 0.9)
        triage.end_step()
        agree_again(triage, f"p{n}", True)
        agree_again(triage, f"p{n}", n != 3)
        outcomes.append(n != 3)
        assert triage.agreement[("easy", 1)] == (sum(outcomes), len(outcomes))
    assert skipped  # the bar was passed on the way (17 of 18 lasted: 18 / 20)
    triage.agreement[("easy", 1)] = (5, 20)  # a record below the bar stops the skips of its streaks
    triage.begin_step()
    assert not any(triage.skips("first", f"draw/{draw}") for draw in range(400))
    assert streak_record(Streak(STREAK_CAP + 9, "hard")) == streak_record(Streak(STREAK_CAP, "hard"))


def test_exploration_moves_towards_the_target_share_and_stays_in_bounds():
    triage = PromptTriage(seed=0, target_zero_variance=0.25)
    triage.begin_step()
    triage.record(["easy"], [True], [1.0])
    triage.end_step()
    assert triage.p == {"easy": P_INITIAL, "hard": P_INITIAL}  # nothing had a streak: no skip could change the share
    for _ in range(200):  # every generated group is all right: skip more easy prompts, explore more hard ones
        triage.begin_step()
        triage.record(["easy", "mixed"], [True, False], [1.0, 0.0])
        metrics = triage.end_step()
    assert triage.p["easy"] == pytest.approx(P_MIN) and triage.p["hard"] == pytest.approx(P_MAX)
    assert metrics["prompt_triage/zero_variance"] == 0.5 and metrics["prompt_triage/predicted_zero_variance"] == 0.5
    triage.begin_step()
    triage.record(["mixed"], [False], [0.0])
    triage.end_step()  # no prompt of the step was predicted: p stays
    assert triage.p["easy"] == pytest.approx(P_MIN)
    assert P_STEP == 0.01
    for step in range(20):  # prompts with a streak that show spread again: nothing avoidable, explore more
        triage.begin_step()
        triage.record(["easy"], [True], [1.0])  # a streak again (the next step predicts it) ...
        triage.end_step()
        triage.begin_step()
        triage.record(["easy", f"new {step}"], [False, True], [0.0, 1.0])  # ... which breaks; a new prompt agrees
        triage.end_step()
    assert triage.p["easy"] > P_MIN + 0.1  # GRESO's all-zero-variance share (0.5 here) would have kept it at P_MIN


# ------------------------------------------------------------------------------ dynamic sampling with triage
def dataset(size: int = 48) -> list[dict]:
    """A third always right, a third always wrong, a third with spread (DAPO's +1 / -1 accuracy)."""
    return [{"prompt": f"{('easy', 'hard', 'mixed')[i % 3]} {i}"} for i in range(size)]


def accuracy_of(prompt: str, position: int) -> float:
    kind = prompt.split()[0]
    return 1.0 if kind == "easy" else -1.0 if kind == "hard" else (1.0 if position % 2 else -1.0)


def sampler_args(triage: bool, **overrides) -> SimpleNamespace:
    settings = dict(
        seed=11,
        filter_groups_enable=True,
        filter_groups_oversample=1,
        filter_groups_atol=1e-6,
        filter_groups_on_exhausted="fill",
        filter_groups_carry_surplus=False,
        filter_groups_shuffle_buffer_size=100,
        max_filter_gen_batches=0,
        scale_rewards="group",
        multi_objective_aggregation="sum_then_normalize",
        rollout_streaming=False,
        prompt_triage=triage,
        prompt_triage_target_zero_variance=0.25,
        prompt_triage_exploration_floor=0.01,
        prompt_triage_min_agreement=0.9,
    )
    return SimpleNamespace(**{**settings, **overrides})


class Exchange:
    """`Process.gather_objects` for processes played by threads: each gives its list, all get the concatenation."""

    def __init__(self, count: int):
        self.count, self.barrier, self.slots = count, threading.Barrier(count), [None] * count

    def gather(self, index: int, items: list) -> list:
        self.slots[index] = list(items)
        self.barrier.wait()
        merged = [item for slot in self.slots for item in slot]
        self.barrier.wait()
        return merged


def run_sampler(
    steps: int, triage: bool, processes: int = 1, state: bytes | None = None, groups_per_step: int = 4, **settings
):
    """`steps` steps of dynamic sampling on `processes` (threads); each step's generated prompts (global order),
    trained prompts, metrics, and the sampler's state at the end (as a checkpoint holds it)."""
    data, exchange = dataset(), Exchange(processes)
    index_of = {row["prompt"]: i for i, row in enumerate(data)}
    per_process = groups_per_step * GROUP // processes
    results: list = [None] * processes

    def play(index: int) -> None:
        process = Process(index, processes, lambda items: exchange.gather(index, items))
        sampler = DynamicSampler(sampler_args(triage, **settings), data, GROUP, {}, process=process)
        loader = PromptStream(len(data), seed=5)
        if state is not None:
            saved = torch.load(io.BytesIO(state), weights_only=False)
            sampler.load_state_dict(saved["sampler"])
            loader.load_state_dict(saved["loader"])
        generated, trained, metrics = [], [], []

        def score_round(local_rows: list[dict]) -> ScoredRound:
            rows = process.gather_objects(local_rows)
            prompts = [row["prompt"] for row in rows]
            generated[-1].extend(prompts[::GROUP])
            accuracy = torch.tensor([accuracy_of(p, i) for i, p in enumerate(prompts)])
            tensors = {
                "advantages": accuracy.clone(),
                "prompt_index": torch.tensor([index_of[p] for p in prompts]),
                "completion_mask": torch.ones(len(prompts), 3, dtype=torch.long),
            }
            return ScoredRound(tensors, accuracy)

        for _ in range(steps):
            generated.append([])
            picked = [data[i] for i in loader.draw(groups_per_step)]
            rows = [dict(row) for row in picked for _ in range(GROUP)]
            batch, step_metrics = sampler.sample(rows[index * per_process : (index + 1) * per_process], score_round)
            trained.append([data[i]["prompt"] for i in batch["prompt_index"][::GROUP].tolist()])
            metrics.append(step_metrics)
        buffer = io.BytesIO()
        torch.save({"sampler": sampler.state_dict(), "loader": loader.state_dict()}, buffer)
        results[index] = (generated, trained, metrics, buffer.getvalue())

    threads = [threading.Thread(target=play, args=(index,)) for index in range(processes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results[0] if processes == 1 else results


def test_triage_generates_fewer_groups_for_the_same_batches_and_skips_only_prompts_without_spread():
    """Over 12 passes of the data (48 prompts, 4 groups a step, a third with spread): without triage dynamic sampling
    generates 3 groups per kept one; with it, the prompts that agreed are mostly skipped before generation."""
    steps = 144
    generated_off, trained_off, metrics_off, _ = run_sampler(steps, triage=False)
    generated_on, trained_on, metrics_on, _ = run_sampler(steps, triage=True)
    for trained in (trained_off, trained_on):  # every trained group has spread
        assert all(prompt.startswith("mixed") for step in trained for prompt in step)
    late = slice(steps // 2, None)  # once the histories exist
    groups_off = sum(len(step) for step in generated_off[late])
    groups_on = sum(len(step) for step in generated_on[late])
    assert groups_on < 0.6 * groups_off
    tokens_off = sum(m["rollout/generated_tokens_per_trained_token"] for m in metrics_off[late])
    tokens_on = sum(m["rollout/generated_tokens_per_trained_token"] for m in metrics_on[late])
    assert tokens_on < 0.6 * tokens_off
    assert sum(m["prompt_triage/skipped"] for m in metrics_on) > 0
    assert all("prompt_triage/skipped" not in m for m in metrics_off)
    mixed_generated = {p for step in generated_on for p in step if p.startswith("mixed")}
    assert len(mixed_generated) == 16  # prompts with spread are never lost
    agreed_late = {p for step in generated_on[late] for p in step if not p.startswith("mixed")}
    assert agreed_late  # nor are the skipped ones: the floor and p bring some back
    assert metrics_on[-1]["prompt_triage/p_easy"] < P_INITIAL  # skipping more than it began with


@pytest.mark.parametrize(
    "settings",
    [{}, {"filter_groups_oversample": 2, "filter_groups_carry_surplus": True}],
    ids=["plain", "oversample-and-carry"],
)
def test_two_processes_decide_as_one_and_a_resumed_sampler_draws_what_the_uninterrupted_one_drew(settings):
    generated, trained, metrics, _ = run_sampler(40, True, **settings)
    assert sum(m["prompt_triage/skipped"] for m in metrics) > 0
    (generated_a, trained_a, _, _), (generated_b, trained_b, _, _) = run_sampler(40, True, processes=2, **settings)
    assert generated_a == generated_b == generated and trained_a == trained_b == trained
    first, _, _, state = run_sampler(25, True, **settings)
    rest, rest_trained, rest_metrics, _ = run_sampler(15, True, state=state, **settings)
    assert first + rest == generated and rest_trained == trained[25:]
    assert [m["prompt_triage/skipped"] for m in rest_metrics] == [m["prompt_triage/skipped"] for m in metrics[25:]]


def test_prompt_triage_is_refused_where_it_cannot_act(tmp_path):
    from .helpers import tiny_config

    with pytest.raises(ValueError, match="prompt_triage=true .* needs filter_groups_enable=true"):
        tiny_config(tmp_path, prompt_triage=True, filter_groups_enable=False)
    with pytest.raises(ValueError, match="prompt_triage_target_zero_variance=1.5 must be in"):
        tiny_config(tmp_path, prompt_triage=True, prompt_triage_target_zero_variance=1.5)
    with pytest.raises(ValueError, match="prompt_triage_min_agreement=1.5 must be in"):
        tiny_config(tmp_path, prompt_triage=True, prompt_triage_min_agreement=1.5)
    assert tiny_config(tmp_path, prompt_triage=True).prompt_triage


# ---------------------------------------------------------------------------------------------- streaming
def triage_metrics(out) -> list[tuple[float, float]]:
    import json

    history = json.loads((out / "log_history.json").read_text())
    return [
        (e["prompt_triage/skipped"], e["dynamic_sampling/groups_generated"])
        for e in history
        if "prompt_triage/skipped" in e
    ]


@pytest.mark.e2e
def test_streaming_triage_trains_what_any_timing_trains_on_two_processes_and_across_a_crash(tmp_path):
    """Streaming at k = 1 (the next batch planned and generated while this one trains) with prompt triage: skips are
    decided when a round takes a prompt, from the history as the step began, which learns only from the groups any
    timing scores; so a run on two processes with other engine timings, killed right after its step-10 checkpoint and
    resumed from it with other timings again, trains the batches of an uninterrupted run on one process, with the same
    skips and groups generated, and triage skips prompts (the easy and hard ones of the fake data)."""
    from .helpers import SCRIPTS, python_command, run_command, trained_rows

    script = str(SCRIPTS / "streaming_run.py")
    settings = (
        "rollout_streaming=true",
        "rollout_max_staleness=1",
        "prompt_triage=true",
        "prompt_triage_min_agreement=0.75",  # a streak acted on once two like it lasted: the bar is passed early
        "filter_groups_oversample=4",  # rounds of 8 groups, waves of up to 2: a wave may end past the batch's cut
        "save_strategy=steps",
        "save_steps=10",
    )

    def train(out, *extra, processes=1, per_device=8):
        run_command(python_command(script, str(out), str(per_device), "20", *settings, *extra, num_processes=processes))

    train(tmp_path / "whole", "timing_seed=0")
    crashed = tmp_path / "crashed"
    with pytest.raises(AssertionError, match="exited"):
        train(crashed, "timing_seed=2", "crash_after_save=10", processes=2, per_device=4)
    train(crashed, "timing_seed=3", f"resume={crashed / 'run' / 'checkpoint-10'}", processes=2, per_device=4)
    whole = trained_rows(tmp_path / "whole", 1)
    assert sorted(whole) == list(range(20))
    assert trained_rows(crashed, 2) == whole
    skips = triage_metrics(tmp_path / "whole")
    assert sum(skipped for skipped, _ in skips) > 0
    assert triage_metrics(crashed)[-10:] == skips[-10:]
