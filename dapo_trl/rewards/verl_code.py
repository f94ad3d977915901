"""verl's code scorer for its code data sources (`codecontests`, `apps`, `codeforces`, `taco`) on SandboxFusion.

With a sandbox URL, verl's `default_compute_score` scores a code response by running it on a SandboxFusion service
against the row's test cases (`verl/utils/reward_score/sandbox_fusion`, `continuous=True`): the share of the first
10 test cases whose output matches. This module gives the same score (differential corpus:
tests/data/verl_code_corpus.jsonl, produced by running verl's scorer against the same service):

- the code is the last ```` ```python ```` block, else the first ```` ``` ```` block (a language word on its first
  line dropped); a response without a block scores 0;
- the ground truth is verl's test-case JSON: `inputs` (each sent as the program's stdin) and `outputs`, or
  `assert_case` (code appended to the program), with `fn_name` for LeetCode-style functions (the program is wrapped
  so that each stdin line is a JSON argument and the return value is printed);
- a case passes when the service says Success / Finished and stdout equals the expected output up to trailing
  newlines (no expected output: any finished run passes); malformed test cases score 0.

Differences from verl, on purpose: a batch in which not one request reached the service stops the run with an
error naming the URL (verl scores every such response 0 and trains on it), and requests are retried on 429 / 502 /
503 / 504 (verl: 504 only). Without a sandbox URL verl runs the code in the trainer's own processes (`prime_code`);
here such rows are refused with the fix.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ..utils.http import RETRY_STATUSES, HTTPClient, RequestFailed, RetryPolicy

logger = logging.getLogger(__name__)

CASES_SCORED = 10  # verl's continuous score: the pass rate of the first 10 test cases
RUN_TIMEOUT_S = 10  # verl's per-case compile and run timeout
MEMORY_LIMIT_MB = 1024  # verl's reward_model.sandbox_fusion.memory_limit_mb default
MAX_CONCURRENCY = 64  # verl's reward_model.sandbox_fusion.max_concurrent default

# The program a LeetCode-style response (`fn_name`) runs as: the response, then a main that reads one JSON argument
# per stdin line, calls `fn_name` (a function, or a method of `Solution`) and prints its result (JSON for
# containers, None and booleans; str() otherwise). The star imports are the names verl's wrapper makes available.
_STAR_IMPORTS = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
    "builtins",
    "typing",
)
_FUNCTION_MAIN = """
_DAPO_FN_NAME = {name!r}


def _dapo_call():
    text = sys.stdin.read()
    arguments = []
    if text.strip():
        try:
            arguments = [json.loads(line) for line in text.split("\\n")]
        except json.JSONDecodeError as error:
            sys.stderr.write(f"invalid JSON input for {{_DAPO_FN_NAME!r}}: {{error}}\\n")
            return None, True
    try:
        target = None
        if _DAPO_FN_NAME in globals():
            target = globals()[_DAPO_FN_NAME]
        elif "Solution" in globals():
            target = getattr(globals()["Solution"](), _DAPO_FN_NAME)
        if not target:
            sys.stderr.write(f"function or method {{_DAPO_FN_NAME!r}} not found\\n")
            return None, True
        return target(*arguments), False
    except Exception:
        sys.stderr.write(traceback.format_exc())
        return None, True


if __name__ == "__main__":
    _dapo_result, _dapo_failed = _dapo_call()
    if not _dapo_failed:
        if isinstance(_dapo_result, (dict, list, tuple, bool)) or _dapo_result is None:
            print(json.dumps(_dapo_result))
        else:
            print(str(_dapo_result))
"""


def function_program(code: str, fn_name: str) -> str:
    """`code` wrapped to be called as `fn_name` with JSON arguments from stdin (verl's LeetCode-style harness)."""
    header = "import traceback\n" + "".join(f"from {module} import *\n" for module in _STAR_IMPORTS)
    header += "".join(f"import {module}\n" for module in _STAR_IMPORTS if module not in ("builtins", "typing"))
    return f"\n{header}\n{code}\n" + _FUNCTION_MAIN.format(name=fn_name)


def extract_code(response: str) -> str | None:
    """The code verl runs: the last ```` ```python ```` block, else the first fenced block (a one-word language
    line dropped), else None."""
    if "```python" in response:
        return response.split("```python")[-1].split("```")[0]
    if "```" not in response:
        return None
    block = response.split("```")[1]
    if "\n" in block:
        first_line, rest = block.split("\n", 1)
        if first_line.strip().isalpha():
            return rest
    return block


@dataclass(frozen=True)
class TestCases:
    """verl's test-case JSON, checked: one stdin, expected output and appended assert code per case."""

    inputs: list[Any]
    outputs: list[Any]
    asserts: Sequence[str]
    fn_name: Any = None


def read_test_cases(ground_truth: Any) -> TestCases | None:
    """The test cases of a code row, or None where verl's scorer gives 0 for the row whatever the response."""
    cases = ground_truth
    if not isinstance(cases, dict):
        try:
            cases = json.loads(cases)
        except (TypeError, ValueError):
            return None
    if not isinstance(cases, dict) or not cases:
        return None
    if isinstance(cases.get("assert_case"), list):
        cases = {"inputs": [""] * len(cases["assert_case"]), "outputs": [None] * len(cases["assert_case"]), **cases}
    if "inputs" not in cases or "outputs" not in cases:
        return None
    inputs, outputs = cases["inputs"], cases["outputs"]
    try:
        count = len(inputs)
        asserts = cases.get("assert_case", [""] * count)
        if count == 0 or len(outputs) != count or len(asserts) != count:
            return None
        if not all(isinstance(code, str) for code in asserts):
            return None
        return TestCases(list(inputs), list(outputs), asserts, cases.get("fn_name"))
    except TypeError:  # unsized inputs, outputs or asserts
        return None


class SandboxUnreachable(RuntimeError):
    """Not one request of a batch reached the SandboxFusion service."""


class SandboxFusionScorer:
    """Scores code responses on a SandboxFusion service as verl's `sandbox_fusion.compute_score(continuous=True)`.

    `run_code_url`: the service's run_code URL (`dapo_trl.tools.remote.run_code_url` builds it from a base URL).
    Requests from all responses of a batch share one pool of `max_concurrency` threads.
    """

    def __init__(
        self,
        run_code_url: str,
        memory_limit_mb: int = MEMORY_LIMIT_MB,
        run_timeout_s: int = RUN_TIMEOUT_S,
        max_concurrency: int = MAX_CONCURRENCY,
        max_retries: int = 2,
    ) -> None:
        self.url = run_code_url
        self.memory_limit_mb = memory_limit_mb
        self.run_timeout_s = run_timeout_s
        self.max_concurrency = max_concurrency
        policy = RetryPolicy(max_retries=max_retries, backoff_s=1.0, retry_statuses=RETRY_STATUSES)
        self.http = HTTPClient(policy, pool_maxsize=max_concurrency)
        self._lock = threading.Lock()
        self.api_errors = 0

    def request_body(self, code: str, stdin: Any) -> dict[str, Any]:
        return {
            "compile_timeout": self.run_timeout_s,
            "run_timeout": self.run_timeout_s,
            "code": code,
            "stdin": None if stdin is None else str(stdin),
            "memory_limit_MB": self.memory_limit_mb,
            "language": "python",
            "files": {},
            "fetch_files": [],
        }

    def run_case(self, code: str, stdin: Any, expected: Any) -> bool | None:
        """Whether one case passes; None when the request never got an answer from the service."""
        timeout = 2 * self.run_timeout_s + 10  # compile + run + verl's API allowance
        try:
            reply = self.http.request("POST", self.url, timeout=timeout, json=self.request_body(code, stdin)).json()
        except (RequestFailed, ValueError) as error:
            logger.warning("sandbox service at %s failed: %s", self.url, error)
            return None
        run = reply.get("run_result") if isinstance(reply, dict) else None
        if not isinstance(reply, dict) or reply.get("status") != "Success" or not isinstance(run, dict):
            return False  # an error reply, or one that is not SandboxFusion's (a proxy's page): not passed, as verl
        if run.get("status") != "Finished":
            return False
        stdout = run.get("stdout")
        return expected is None or str("" if stdout is None else stdout).rstrip("\n") == str(expected).rstrip("\n")

    def score(self, responses: Sequence[str], ground_truths: Sequence[Any]) -> list[float]:
        """Each response's pass rate over the first CASES_SCORED test cases of its row (0 without code or cases)."""
        jobs: list[tuple[int, str, Any, Any]] = []
        counted = [0] * len(responses)
        for index, (response, truth) in enumerate(zip(responses, ground_truths, strict=True)):
            code, cases = extract_code(response), read_test_cases(truth)
            if code is None or cases is None:
                continue
            counted[index] = min(len(cases.inputs), CASES_SCORED)
            for case in range(counted[index]):
                program = code + "\n\n" + cases.asserts[case]
                if cases.fn_name:
                    program = function_program(program, cases.fn_name)
                jobs.append((index, program, cases.inputs[case], cases.outputs[case]))
        if not jobs:
            return [0.0] * len(responses)
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(jobs))) as pool:
            results = list(pool.map(lambda job: self.run_case(*job[1:]), jobs))
        unanswered = sum(result is None for result in results)
        with self._lock:
            self.api_errors += unanswered
        if unanswered == len(jobs):
            raise SandboxUnreachable(
                f"the SandboxFusion service at {self.url} answered none of {len(jobs)} requests (see the warnings "
                "above): start it, or fix --sandbox_url (verl: reward_model.sandbox_fusion.url)"
            )
        passed = [0] * len(responses)
        for (index, *_), result in zip(jobs, results, strict=True):
            passed[index] += result is True
        return [passed[i] / counted[i] if counted[i] else 0.0 for i in range(len(responses))]

    def close(self) -> None:
        self.http.close()
