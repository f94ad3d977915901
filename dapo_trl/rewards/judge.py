"""A correctness reward that asks a judge model through an OpenAI-compatible chat-completions endpoint.

`JudgeReward` has TRL's reward-function signature, `f(prompts, completions, solution, **kwargs) -> list[float]`,
and returns DAPO's +1 / -1 like `dapo_trl.rewards`. For each completion it sends one request,
`POST {base_url}/v1/chat/completions` with `{"model", "messages", "temperature", "max_tokens"}` (a vLLM server, or
any OpenAI-compatible one), and reads the reply as CORRECT or INCORRECT.

A whole batch goes out at once: identical requests are sent once, and the rest run concurrently on a thread pool
(`max_concurrency` in flight) through `dapo_trl.utils.http`, so a step's 120 judgments cost about one request's latency
rather than 120. Connection errors, timeouts (a judgment is harmless to ask twice), HTTP 429 and 5xx are retried
with exponential backoff; other 4xx are not. Every request has a timeout, and the batch has a deadline of
`timeout_s * (max_retries + 1)`, so a dead or hung judge can delay a training step but never hang it. An item whose
request failed scores `incorrect_reward` (counted in `judge/failures`), or raises `RuntimeError` with
`on_failure="raise"`.

Through TRL's `log_metric` keyword it reports, per batch: `judge/failures` (completions whose request failed),
`judge/retries` (HTTP attempts beyond the first), `judge/latency_s` (mean seconds per request, retries included),
`judge/requests` (distinct requests sent after deduplication) and `judge/unparsed` (completions whose judge reply
was neither CORRECT nor INCORRECT; they score `incorrect_reward`).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import re
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ..utils.http import HTTPClient, RequestFailed, RetryPolicy, checked_service_path
from .answers import CORRECT_REWARD, INCORRECT_REWARD, completion_text

logger = logging.getLogger(__name__)

DEFAULT_JUDGE_TEMPLATE = """\
You are grading the final answer of a response to a math problem.

Problem:
{prompt}

Response:
{response}

Reference answer:
{reference}

Is the final answer of the response mathematically equivalent to the reference answer? Judge only the final \
answer, not the working or the formatting. Reply with exactly one word: CORRECT or INCORRECT."""

# Placeholders of a prompt template; {response} and {reference} are required.
_PLACEHOLDER = re.compile(r"\{(prompt|response|reference)\}")
_THINK_BLOCK = re.compile(r"(?is)<think>.*?</think>")
# Longest first, so "INCORRECT" and "NOT CORRECT" never read as "CORRECT".
_VERDICT = re.compile(r"\b(NOT\s+CORRECT|INCORRECT|CORRECT)\b")
_URL_EXAMPLE = "'http://127.0.0.1:8000' (a vLLM `vllm serve` address; a trailing '/v1' is accepted)"
# Overloaded (429) or failing (5xx): another try may succeed. Another 4xx would only fail again.
RETRY_STATUSES = frozenset({429, *range(500, 600)})
_DEADLINE_HINT = "Check that the judge server is up and not overloaded, or raise timeout_s."


def parse_verdict(reply: str | None) -> bool | None:
    """True for a CORRECT reply, False for INCORRECT, None when the reply says neither.

    Case, whitespace and markdown do not matter, and a `<think>...</think>` block is ignored. When the judge writes
    more than one line, the last line that states a verdict decides, and within it the first verdict (so
    "INCORRECT (the correct answer is 5)" is INCORRECT).
    """
    if not reply:
        return None
    text = _THINK_BLOCK.sub("\n", reply)
    if "</think>" in text:  # a reasoning block whose opening tag the server stripped
        text = text.rsplit("</think>", 1)[1]
    for line in reversed(text.upper().splitlines()):
        match = _VERDICT.search(line)
        if match:
            return match.group(1) == "CORRECT"
    return None


def prompt_text(prompt: str | Sequence[dict[str, Any]]) -> str:
    """The question of a prompt: the string itself, or the user messages of a chat prompt."""
    if isinstance(prompt, str):
        return prompt
    user = [_content_text(m.get("content")) for m in prompt if m.get("role") == "user"]
    return "\n\n".join(user or [_content_text(m.get("content")) for m in prompt])


def _content_text(content: Any) -> str:
    """Text of a message content: a string, or a list of `{"type": "text", "text": ...}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text") or "" for part in content if isinstance(part, dict))
    return str(content)


def chat_completions_url(base_url: str) -> str:
    """`{base_url}/v1/chat/completions`, after checking that `base_url` is an http(s) server root."""

    def bad(problem: str) -> ValueError:
        return ValueError(
            f"JudgeReward base_url={base_url!r} {problem}; give the judge server's root URL, e.g. {_URL_EXAMPLE}"
        )

    scheme, netloc, path = checked_service_path(base_url, bad)
    if path.endswith("/chat/completions"):
        raise bad("is an endpoint, not the server root")
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urllib.parse.urlunsplit((scheme, netloc, f"{path}/v1/chat/completions", "", ""))


@dataclass
class _Outcome:
    """What came of one distinct judge request."""

    verdict: bool | None = None  # None: the reply stated no verdict (or the request failed)
    error: str | None = None  # set when the request failed for good
    hint: str = ""  # what to check, for a failure
    attempts: int = 0
    latency_s: float = 0.0

    @property
    def failed(self) -> bool:
        return self.error is not None

    @property
    def retries(self) -> int:
        return max(0, self.attempts - 1)


class JudgeReward:
    """Reward +1 / -1 from a judge model's CORRECT / INCORRECT verdict, batched and concurrent.

    Args:
        base_url: root URL of an OpenAI-compatible server, e.g. "http://127.0.0.1:8000" (a trailing "/v1" is
            accepted); requests go to `{base_url}/v1/chat/completions`.
        model: model name as the server serves it (vLLM: the `--served-model-name`, else the model path).
        api_key: sent as `Authorization: Bearer ...`; defaults to the OPENAI_API_KEY environment variable, if set.
        max_concurrency: requests in flight at once.
        timeout_s: seconds one request may take; the batch's deadline is `timeout_s * (max_retries + 1)`.
        max_retries: retries after a connection error, timeout, HTTP 429 or 5xx (never after another 4xx).
        backoff_s: delay before the first retry, doubling each retry (with jitter; at least a 429/503's
            Retry-After), and never past the batch deadline.
        prompt_template: the judge's user message, with placeholders {prompt} (the question), {response} (the
            completion's text) and {reference} (the `solution` column). Other braces are left alone.
        correct_reward / incorrect_reward: scores for the two verdicts. A reply that says neither scores
            incorrect_reward.
        on_failure: "incorrect" scores a failed request as incorrect_reward and counts it in `judge/failures`;
            "raise" raises RuntimeError naming the URL, the error and what to check.
        temperature / max_tokens: sampling settings of the judge request.
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_concurrency: int = 32,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        prompt_template: str = DEFAULT_JUDGE_TEMPLATE,
        correct_reward: float = CORRECT_REWARD,
        incorrect_reward: float = INCORRECT_REWARD,
        on_failure: Literal["incorrect", "raise"] = "incorrect",
        temperature: float = 0.0,
        max_tokens: int = 16,
    ):
        self.__name__ = "judge_reward"  # TRL names the reward's metrics after it
        self.url = chat_completions_url(base_url)
        self.base_url = base_url.strip()
        if not isinstance(model, str) or not model.strip():
            raise ValueError("JudgeReward model must name the served judge model, e.g. 'Qwen/Qwen2.5-7B-Instruct'")
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"JudgeReward max_concurrency must be an integer >= 1, got {max_concurrency!r}")
        if not timeout_s > 0:
            raise ValueError(f"JudgeReward timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"JudgeReward max_retries must be an integer >= 0, got {max_retries!r}")
        if not backoff_s >= 0:
            raise ValueError(f"JudgeReward backoff_s must be >= 0, got {backoff_s!r}")
        if on_failure not in ("incorrect", "raise"):
            raise ValueError(f"JudgeReward on_failure must be 'incorrect' or 'raise', got {on_failure!r}")
        missing = [name for name in ("{response}", "{reference}") if name not in prompt_template]
        if missing:
            raise ValueError(f"JudgeReward prompt_template lacks the placeholder(s) {', '.join(missing)}")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"JudgeReward max_tokens must be an integer >= 1, got {max_tokens!r}")
        self.model = model
        self.api_key = api_key if api_key is not None else (os.environ.get("OPENAI_API_KEY") or None)
        self.max_concurrency = max_concurrency
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.prompt_template = prompt_template
        self.correct_reward = float(correct_reward)
        self.incorrect_reward = float(incorrect_reward)
        self.on_failure = on_failure
        self.temperature = float(temperature)
        self.max_tokens = max_tokens
        self.last_stats: dict[str, float] = {}

    def __repr__(self) -> str:  # never shows the API key
        return (
            f"JudgeReward(url={self.url!r}, model={self.model!r}, max_concurrency={self.max_concurrency}, "
            f"timeout_s={self.timeout_s}, max_retries={self.max_retries}, on_failure={self.on_failure!r})"
        )

    @property
    def deadline_s(self) -> float:
        """The most seconds one batch may take."""
        return self.timeout_s * (self.max_retries + 1)

    def judge_message(self, prompt: Any, completion: Any, solution: Any) -> str:
        """The judge's user message for one completion (single-pass substitution, so no field leaks into another)."""
        values = {"prompt": prompt_text(prompt), "response": completion_text(completion), "reference": str(solution)}
        return _PLACEHOLDER.sub(lambda m: values[m.group(1)], self.prompt_template)

    def __call__(self, prompts: list, completions: list, solution: list, **kwargs: Any) -> list[float]:
        if not len(prompts) == len(completions) == len(solution):
            raise ValueError(
                f"got {len(prompts)} prompts, {len(completions)} completions and {len(solution)} solutions"
            )
        if not completions:
            return []
        messages = [self.judge_message(p, c, s) for p, c, s in zip(prompts, completions, solution, strict=True)]
        distinct: dict[str, int] = {}
        request_of = [distinct.setdefault(m, len(distinct)) for m in messages]
        outcomes = self._run(list(distinct))

        rewards = []
        failures = unparsed = 0
        for index in request_of:
            outcome = outcomes[index]
            if outcome.failed:
                failures += 1
            elif outcome.verdict is None:
                unparsed += 1
            rewards.append(self.correct_reward if outcome.verdict else self.incorrect_reward)

        self.last_stats = {
            "judge/failures": float(failures),
            "judge/retries": float(sum(o.retries for o in outcomes)),
            "judge/latency_s": sum(o.latency_s for o in outcomes) / len(outcomes),
            "judge/requests": float(len(outcomes)),
            "judge/unparsed": float(unparsed),
        }
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            for name, value in self.last_stats.items():
                log_metric(name, value)
        if failures:
            first = next(o for o in outcomes if o.failed)
            logger.warning(
                "%d of %d judge requests failed and scored %s; first error: %s. %s",
                sum(o.failed for o in outcomes),
                len(outcomes),
                self.incorrect_reward,
                first.error,
                first.hint,
            )
        if unparsed:
            logger.warning(
                "%d judge replies stated neither CORRECT nor INCORRECT; they scored %s", unparsed, self.incorrect_reward
            )
        return rewards

    # -- transport ---------------------------------------------------------------------------------------------

    def _run(self, messages: list[str]) -> list[_Outcome]:
        """One outcome per message, in order, all within the batch deadline."""
        start = time.monotonic()
        deadline = start + self.deadline_s
        stop = threading.Event()
        workers = min(self.max_concurrency, len(messages))
        policy = RetryPolicy(
            max_retries=self.max_retries,
            backoff_s=self.backoff_s,
            retry_statuses=RETRY_STATUSES,
            retry_read_timeouts=True,
            max_delay_s=None,  # the batch deadline bounds every wait
        )
        client = HTTPClient(policy, pool_maxsize=workers)
        outcomes: list[_Outcome | None] = [None] * len(messages)
        futures: dict[concurrent.futures.Future[_Outcome], int] = {}
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="judge")
        try:
            futures = {pool.submit(self._request, client, m, deadline, stop): i for i, m in enumerate(messages)}
            try:
                for future in concurrent.futures.as_completed(futures, timeout=max(0.0, deadline - start)):
                    outcome = future.result()
                    outcomes[futures[future]] = outcome
                    if outcome.failed and self.on_failure == "raise":
                        raise RuntimeError(self._failure_message(outcome))
            except concurrent.futures.TimeoutError:
                pass
        finally:
            stop.set()  # workers still waiting stop retrying; queued ones never start
            pool.shutdown(wait=False, cancel_futures=True)
            if all(future.done() for future in futures):
                client.close()  # else a straggler's request still uses it, and garbage collection closes it
        elapsed = time.monotonic() - start
        for i, outcome in enumerate(outcomes):
            if outcome is None:
                outcome = outcomes[i] = _Outcome(
                    error=f"no answer within the batch deadline of {self.deadline_s:g} s "
                    f"(timeout_s * (max_retries + 1))",
                    hint=_DEADLINE_HINT,
                    latency_s=elapsed,
                )
                if self.on_failure == "raise":
                    raise RuntimeError(self._failure_message(outcome))
        return outcomes  # type: ignore[return-value]

    def _failure_message(self, outcome: _Outcome) -> str:
        return (
            f"judge request to {self.url} (model {self.model!r}) failed after {outcome.attempts} attempt(s): "
            f"{outcome.error}. {outcome.hint}"
        )

    def _request(self, client: HTTPClient, message: str, deadline: float, stop: threading.Event) -> _Outcome:
        """Send one judge request, retrying within the deadline."""
        payload = {
            "model": self.model,
            "messages": [{"role": "user", "content": message}],
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        start = time.monotonic()
        outcome = _Outcome(attempts=1)

        def count_retry(failure: RequestFailed, delay_s: float) -> None:
            outcome.attempts += 1

        try:
            response = client.request(
                "POST",
                self.url,
                timeout=self.timeout_s,
                json=payload,
                headers=headers,
                deadline=deadline,
                stop=stop,
                on_retry=count_retry,
            )
            outcome.verdict = parse_verdict(_reply_text(response.content))
        except RequestFailed as failure:
            outcome.attempts = failure.attempts
            outcome.error, outcome.hint = self._explain(failure)
        except _NotAChatCompletion as error:  # a retry would get the same
            outcome.error = str(error)
            outcome.hint = "Check that base_url points at an OpenAI-compatible server (e.g. `vllm serve`)."
        outcome.latency_s = time.monotonic() - start
        return outcome

    def _explain(self, failure: RequestFailed) -> tuple[str, str]:
        """The error and the hint of a failed request, in the judge's words."""
        if failure.response is None and failure.exception is None:
            return f"no answer within the batch deadline of {self.deadline_s:g} s", _DEADLINE_HINT
        if failure.response is not None:
            message = failure.describe(detail_chars=500)
            if failure.retryable:
                hint = "The judge server is overloaded or failing: check its logs, or lower max_concurrency."
            else:
                hint = _client_error_hint(failure.response.status_code, self.model, self.url)
        elif failure.timed_out:
            message = f"timed out after {failure.timeout_s:.3g} s"
            hint = "The judge server took too long: check it is not overloaded, or raise timeout_s."
        else:
            cause = failure.root_cause()
            message = f"{type(cause).__name__}: {cause}"
            hint = "Check that the judge server is running and reachable at base_url (host and port)."
        if failure.gave_up == "deadline":
            message += " (then the batch deadline was reached)"
        elif failure.gave_up == "stopped":
            message += " (then the batch was abandoned)"
        return message, hint


class _NotAChatCompletion(ValueError):
    """A 200 reply that is not an OpenAI chat completion (the URL reaches some other server)."""


def _reply_text(raw: bytes) -> str:
    """The message content of a chat-completion reply; _NotAChatCompletion if the reply is not one."""
    try:
        payload = json.loads(raw)
        return _content_text(payload["choices"][0]["message"].get("content"))
    except (ValueError, KeyError, IndexError, TypeError, AttributeError):
        snippet = raw[:200].decode("utf-8", "replace")
        raise _NotAChatCompletion(f"the response is not a chat completion: {snippet!r}") from None


def _client_error_hint(status: int, model: str, url: str) -> str:
    if status in (401, 403):
        return "Check api_key (or the OPENAI_API_KEY environment variable) against the server's --api-key."
    if status == 404:
        return f"Check base_url and model {model!r}: the server has no such route or model at {url}."
    return (
        f"Check that model {model!r} is the served model name (GET /v1/models lists them) and that the prompt plus "
        f"max_tokens fits its context."
    )
