"""JudgeReward against a real OpenAI-compatible stub server on 127.0.0.1, started and stopped by each test."""

from __future__ import annotations

import pickle
import re
import time

import pytest

from dapo_trl.rewards.judge import DEFAULT_JUDGE_TEMPLATE, JudgeReward, chat_completions_url, parse_verdict

from .helpers import StubServer, clear_proxies, closed_port

_ANSWER = re.compile(r"Answer: (\S+)")
_REFERENCE = re.compile(r"Reference answer:\n(\S+)")


def judge_server(behaviour, max_requests: int = 200) -> StubServer:
    """A chat-completions stub: `behaviour(index, body) -> (status, reply text, delay_s)`; 429 / 503 add Retry-After."""

    def answer(index, body):
        status, reply, delay = behaviour(index, body)
        if status != 200:
            reply = {"error": {"message": f"stub error {status}"}}
        elif not isinstance(reply, bytes):
            reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": reply}}]}
        return status, reply, {"Retry-After": "0"} if status in (429, 503) else {}, delay

    return StubServer(answer, max_requests)


def contents(server: StubServer) -> list[str]:
    return [r["body"]["messages"][0]["content"] for r in server.requests]


def grade(body: dict) -> bool:
    """The stub judge's rule: the response's "Answer: X" equals the reference."""
    content = body["messages"][0]["content"]
    answer = _ANSWER.search(content)
    return answer is not None and answer.group(1) == _REFERENCE.search(content).group(1)


def always(status: int, reply: str | None = "CORRECT", delay: float = 0.0):
    return lambda index, body: (status, reply, delay)


def fast(server: StubServer | str, **kwargs) -> JudgeReward:
    """A JudgeReward with test-sized timeouts."""
    options = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, "api_key": ""}
    options.update(kwargs)
    return JudgeReward(server.base_url if isinstance(server, StubServer) else server, "judge-model", **options)


@pytest.fixture(autouse=True)
def _loopback_only(monkeypatch):
    """No proxy may carry the stub's loopback traffic elsewhere, and no ambient key leaks in."""
    clear_proxies(monkeypatch)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)


# -- parsing and construction ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reply,verdict",
    [
        ("CORRECT", True),
        ("  correct\n", True),
        ("**Correct**", True),
        ("Correct.", True),
        ("INCORRECT", False),
        ("incorrect", False),
        (" Incorrect. ", False),
        ("NOT CORRECT", False),
        ("INCORRECT (the correct answer is 5)", False),
        ("The answer looks correct at first.\nVerdict: INCORRECT", False),
        ("<think>this is incorrect... no wait</think>\nCORRECT", True),
        ("reasoning that is correct</think>INCORRECT", False),
        ("CORRECTLY", None),
        ("I cannot tell", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_verdict(reply, verdict):
    assert parse_verdict(reply) is verdict


@pytest.mark.parametrize(
    "base_url,url",
    [
        ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1/chat/completions"),
        ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/chat/completions"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000/v1/chat/completions"),
        (" https://judge.internal/prefix ", "https://judge.internal/prefix/v1/chat/completions"),
    ],
)
def test_chat_completions_url(base_url, url):
    assert chat_completions_url(base_url) == url


@pytest.mark.parametrize(
    "base_url",
    [
        "",
        "127.0.0.1:8000",
        "localhost",
        "ftp://host",
        "http://",
        "http://host:port",
        "http://h:8000?a=1",
        "http://h/v1/chat/completions",
        "http://h /x",
    ],
)
def test_malformed_base_url_is_rejected_at_construction(base_url):
    with pytest.raises(ValueError, match=r"base_url=.*e\.g\. 'http://127\.0\.0\.1:8000'"):
        JudgeReward(base_url, "judge-model")


def test_other_arguments_are_checked():
    with pytest.raises(ValueError, match="on_failure"):
        JudgeReward("http://127.0.0.1:1", "m", on_failure="ignore")
    with pytest.raises(ValueError, match="max_concurrency"):
        JudgeReward("http://127.0.0.1:1", "m", max_concurrency=0)
    with pytest.raises(ValueError, match=r"\{reference\}"):
        JudgeReward("http://127.0.0.1:1", "m", prompt_template="{response}")
    with pytest.raises(ValueError, match="got 2 prompts, 1 completions"):
        JudgeReward("http://127.0.0.1:1", "m")(["a", "b"], ["x"], ["1"])


def test_name_message_pickle_and_repr():
    reward = JudgeReward("http://127.0.0.1:1", "m", api_key="sk-secret")
    assert reward.__name__ == "judge_reward"
    # Single-pass substitution: braces in the fields (LaTeX, or a literal "{reference}") are left alone.
    message = reward.judge_message([{"role": "user", "content": "Find {reference} \\frac{1}{2}"}], "Answer: 3", 3)
    assert "Find {reference} \\frac{1}{2}" in message and message.endswith("CORRECT or INCORRECT.")
    assert "Response:\nAnswer: 3\n\nReference answer:\n3\n" in message
    assert message == DEFAULT_JUDGE_TEMPLATE.format(
        prompt="Find {reference} \\frac{1}{2}", response="Answer: 3", reference="3"
    )
    assert "sk-secret" not in repr(reward)
    assert pickle.loads(pickle.dumps(reward)).url == reward.url


def test_empty_batch_sends_nothing():
    with judge_server(always(200)) as server:
        assert fast(server)([], [], []) == []
        assert server.requests == []


# -- a real server ----------------------------------------------------------------------------------------------

CORRECT_REPLIES = ["CORRECT", " correct\n", "**Correct**", "Verdict: CORRECT."]
INCORRECT_REPLIES = ["INCORRECT", "incorrect", "**INCORRECT** (the correct answer is 7)", "<think>ok</think>INCORRECT"]


def judging(index: int, body: dict):
    replies = CORRECT_REPLIES if grade(body) else INCORRECT_REPLIES
    # Later requests answer sooner, so replies arrive out of order.
    return 200, replies[index % 4], 0.002 * (8 - index % 8)


def test_batch_verdicts_keep_their_order():
    n = 64
    prompts = [[{"role": "user", "content": f"Problem {i}: what is {i} + 0?"}] for i in range(n)]
    completions = [
        [{"role": "assistant", "content": f"Easy.\nAnswer: {i if i % 3 else i + 1}"}] if i % 2 else f"Answer: {i}"
        for i in range(n)
    ]
    solution = [str(i) for i in range(n)]
    expected = [1.0 if i % 2 == 0 or i % 3 else -1.0 for i in range(n)]
    with judge_server(judging) as server:
        reward = fast(server, max_concurrency=8)
        assert reward(prompts=prompts, completions=completions, solution=solution) == expected
    assert len(server.requests) == n
    request = server.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["body"]["model"] == "judge-model"
    assert request["body"]["temperature"] == 0.0 and request["body"]["max_tokens"] == 16
    assert "Authorization" not in request["headers"]
    sent = [reward.judge_message(*x) for x in zip(prompts, completions, solution, strict=True)]
    assert sorted(contents(server)) == sorted(sent)
    assert reward.last_stats["judge/failures"] == 0 and reward.last_stats["judge/requests"] == n


def test_requests_run_concurrently_up_to_the_limit():
    with judge_server(always(200, "CORRECT", delay=0.2)) as server:
        reward = fast(server, max_concurrency=16)
        rewards = reward([f"q{i}" for i in range(32)], [f"Answer: {i}" for i in range(32)], ["0"] * 32)
    assert rewards == [1.0] * 32
    assert len(server.requests) == 32
    # Sequential calls would never exceed 1 in flight; the pool must never exceed its limit.
    assert 12 <= server.peak_in_flight <= 16, server.peak_in_flight


@pytest.mark.parametrize("status", [503, 500, 429])
def test_retries_after_a_server_error_then_succeeds(status):
    def flaky(index, body):
        return (status, None, 0.0) if index == 0 else (200, "CORRECT", 0.0)

    with judge_server(flaky, max_requests=5) as server:
        reward = fast(server, max_retries=3)
        assert reward(["q"], ["Answer: 1"], ["1"]) == [1.0]
    assert len(server.requests) == 2
    assert reward.last_stats["judge/retries"] == 1 and reward.last_stats["judge/failures"] == 0


def test_client_error_is_not_retried():
    with judge_server(always(400), max_requests=10) as server:
        reward = fast(server, max_retries=3)
        assert reward(["q"], ["Answer: 1"], ["1"]) == [-1.0]
        assert len(server.requests) == 1
        assert reward.last_stats["judge/failures"] == 1 and reward.last_stats["judge/retries"] == 0
        with pytest.raises(RuntimeError, match=r"HTTP 400.*served model name") as error:
            fast(server, max_retries=3, on_failure="raise")(["q"], ["Answer: 1"], ["1"])
        assert f"{server.base_url}/v1/chat/completions" in str(error.value)
        assert len(server.requests) == 2


def test_unparseable_reply_scores_incorrect_without_failing():
    with judge_server(always(200, "I am not sure.")) as server:
        reward = fast(server, on_failure="raise")
        assert reward(["q"], ["Answer: 1"], ["1"]) == [-1.0]
    assert reward.last_stats["judge/unparsed"] == 1 and reward.last_stats["judge/failures"] == 0


def test_non_json_reply_is_a_failure_and_not_retried():
    with judge_server(always(200, b"<html>not an API</html>"), max_requests=5) as server:
        with pytest.raises(RuntimeError, match="not a chat completion.*OpenAI-compatible"):
            fast(server, on_failure="raise")(["q"], ["Answer: 1"], ["1"])
    assert len(server.requests) == 1


def test_server_that_never_answers_ends_within_the_deadline():
    with judge_server(always(200, "CORRECT", delay=30.0), max_requests=20) as server:
        reward = fast(server, timeout_s=0.3, max_retries=1, max_concurrency=4)
        assert reward.deadline_s == pytest.approx(0.6)
        metrics: dict[str, float] = {}
        start = time.monotonic()
        rewards = reward([f"q{i}" for i in range(6)], ["Answer: 1"] * 6, ["1"] * 6, log_metric=metrics.__setitem__)
        elapsed = time.monotonic() - start
    assert rewards == [-1.0] * 6
    assert elapsed < reward.deadline_s + 0.5, elapsed
    assert metrics["judge/failures"] == 6
    assert len(server.requests) <= 12


def test_unreachable_server_raises_naming_the_url():
    url = f"http://127.0.0.1:{closed_port()}"
    reward = fast(url, max_retries=1, on_failure="raise")
    start = time.monotonic()
    with pytest.raises(RuntimeError) as error:
        reward(["q"], ["Answer: 1"], ["1"])
    message = str(error.value)
    assert f"{url}/v1/chat/completions" in message
    assert "2 attempt(s)" in message and "Connection" in message and "running and reachable" in message
    assert time.monotonic() - start < 2.0


def test_unreachable_server_scores_incorrect_by_default():
    reward = fast(f"http://127.0.0.1:{closed_port()}", max_retries=1)
    metrics: dict[str, float] = {}
    assert reward(["a", "b"], ["Answer: 1", "Answer: 2"], ["1", "2"], log_metric=metrics.__setitem__) == [-1.0, -1.0]
    assert metrics["judge/failures"] == 2 and metrics["judge/retries"] == 2


def test_identical_items_are_sent_once():
    prompts = ["q1", "q2", "q1", "q1", "q2", "q3"] * 2
    completions = ["Answer: 1", "Answer: 5", "Answer: 1", "Answer: 2", "Answer: 5", "Answer: 3"] * 2
    solution = ["1", "2", "1", "1", "2", "3"] * 2
    with judge_server(lambda index, body: (200, "CORRECT" if grade(body) else "INCORRECT", 0.0)) as server:
        reward = fast(server)
        assert reward(prompts, completions, solution) == [1.0, -1.0, 1.0, -1.0, -1.0, 1.0] * 2
    assert len(server.requests) == 4  # (q1, 1), (q2, 5), (q1, 2), (q3, 3)
    assert len(set(contents(server))) == 4
    assert reward.last_stats["judge/requests"] == 4


def test_api_key_is_sent_as_bearer(monkeypatch):
    with judge_server(always(200)) as server:
        fast(server, api_key="sk-explicit")(["q"], ["Answer: 1"], ["1"])
        monkeypatch.setenv("OPENAI_API_KEY", "sk-from-env")
        fast(server, api_key=None)(["q"], ["Answer: 1"], ["1"])
    assert [r["headers"].get("Authorization") for r in server.requests] == ["Bearer sk-explicit", "Bearer sk-from-env"]


def test_log_metric_receives_the_counts():
    def mixed(index, body):
        content = body["messages"][0]["content"]
        if "bad request" in content:
            return 400, None, 0.0
        if "flaky" in content and sum("flaky" in c for c in contents(server)) == 1:
            return 503, None, 0.0
        return 200, "CORRECT", 0.05

    logged: list[tuple[str, float]] = []
    with judge_server(mixed, max_requests=10) as server:
        reward = fast(server, correct_reward=2.0, incorrect_reward=-3.0)
        rewards = reward(
            ["flaky", "bad request", "fine", "fine"],
            ["Answer: 1"] * 4,
            ["1"] * 4,
            log_metric=lambda name, value: logged.append((name, value)),
        )
    assert rewards == [2.0, -3.0, 2.0, 2.0]
    metrics = dict(logged)
    assert len(logged) == len(metrics)  # each metric once per batch
    assert metrics["judge/failures"] == 1
    assert metrics["judge/retries"] == 1
    assert metrics["judge/requests"] == 3
    assert 0.01 < metrics["judge/latency_s"] < 2.0
    assert len(server.requests) == 4
