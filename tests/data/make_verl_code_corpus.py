"""Build `verl_code_corpus.jsonl`: code responses and test cases with the scores of verl's SandboxFusion scorer.

The expected scores come from RUNNING verl's own scorer, `default_compute_score(source, response, test_cases,
sandbox_fusion_url=...)` (`verl/utils/reward_score/sandbox_fusion`, kept outside this repository, loaded as in
make_verl_default_corpus.py), against the SandboxFusion stand-in the tests use (`tests.helpers.fusion_execute`: the
request's Python program run with its stdin, under its run timeout). The tests run `dapo_trl.rewards.verl_code`
against the same stand-in, so both sides see the same service. Produced from volcengine/verl at commit
b178a3cd56f58b2d502255daba591e92833930a7:

    python tests/data/make_verl_code_corpus.py --verl /tmp/verlref   # the folder make_verl_default_corpus.py names

Each line: `data_source`, `response`, `ground_truth` (verl's test-case JSON, as text or as an object) and `score`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]
from make_verl_default_corpus import load_scorers  # noqa: E402

from tests.helpers import StubServer, fusion_execute  # noqa: E402

OUTPUT = HERE / "verl_code_corpus.jsonl"
SOURCES = ["codecontests", "apps", "codeforces", "taco"]


def block(code: str, fence: str = "```python") -> str:
    return f"Here is my solution.\n{fence}\n{code}\n```\nIt reads the input."


DOUBLE = "n = int(input())\nprint(n * 2)"
PLUS_TWO = "n = int(input())\nprint(n + 2)"
IO_CASES = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["2\n", "4\n", "6\n"]}
ADD = "def add(a, b):\n    return a + b"
ADD_CASES = {"fn_name": "add", "inputs": ["1\n2", "3\n4", "[1]\n[2]"], "outputs": ["3", "7", "[1, 2]"]}


def cases() -> list[tuple[str, Any]]:
    twelve = {"inputs": [f"{i}\n" for i in range(12)], "outputs": [f"{2 * i}\n" for i in range(10)] + ["x", "y"]}
    return [
        (block(DOUBLE), json.dumps(IO_CASES)),
        (block(DOUBLE), IO_CASES),  # test cases as an object, not text
        (block(PLUS_TWO), json.dumps(IO_CASES)),  # passes 1 of 3
        (block(DOUBLE), json.dumps(twelve)),  # only the first 10 count: 1.0
        (block("n = int(input())\nprint(n * 2 if n < 5 else 0)"), json.dumps(twelve)),  # 5 of the first 10
        ("print(int(input()) * 2)", json.dumps(IO_CASES)),  # no code block
        (block(DOUBLE, "```"), json.dumps(IO_CASES)),  # a bare fence
        (block(DOUBLE, "```py"), json.dumps(IO_CASES)),  # a one-word language line is dropped
        (block(DOUBLE, "```python3"), json.dumps(IO_CASES)),  # "python3" is not alphabetic: it stays, a NameError
        ("```\nprint(1)\n```\n```\nprint(2)\n```", json.dumps({"inputs": [""], "outputs": ["1"]})),  # the first
        (block("print(0)") + block(DOUBLE), json.dumps(IO_CASES)),  # the last ```python block
        (block(DOUBLE) + "\n```python\nprint(", json.dumps(IO_CASES)),  # an unclosed last block
        (block("n = int(input())\nprint(n * 2, end='')"), json.dumps(IO_CASES)),  # trailing newlines are ignored
        (block("n = int(input())\nprint(n * 2, end=' \\n')"), json.dumps(IO_CASES)),  # a trailing space is not
        (block("print(int(input()) * 2)\n\n\n"), json.dumps({"inputs": ["4"], "outputs": ["8\n\n\n"]})),
        (block("import sys\nsys.exit(3)"), json.dumps({"inputs": ["1"], "outputs": [""]})),  # non-zero exit
        (block("raise ValueError('no')"), json.dumps(IO_CASES)),
        (block("print(input())"), json.dumps({"inputs": [None, 5, "x"], "outputs": ["", "5", "x"]})),
        (block("print('hi')"), json.dumps({"inputs": ["", ""], "outputs": [None, "hi"]})),
        (block(ADD), json.dumps(ADD_CASES)),
        (block("class Solution:\n    def add(self, a, b):\n        return a - b"), json.dumps(ADD_CASES)),
        (
            block("def pair(a):\n    return [a, str(a)]"),
            json.dumps({"fn_name": "pair", "inputs": ["1"], "outputs": ["[1, '1']"]}),
        ),
        (
            block("def root(x):\n    return sqrt(x)"),
            json.dumps({"fn_name": "root", "inputs": ["16"], "outputs": ["4.0"]}),
        ),  # star-imported sqrt
        (
            block("def flag(x):\n    return x > 1"),
            json.dumps({"fn_name": "flag", "inputs": ["2", "0"], "outputs": ["true", "false"]}),
        ),
        (block("def other(x):\n    return x"), json.dumps({"fn_name": "f", "inputs": ["1"], "outputs": ["1"]})),
        (block(ADD), json.dumps({"fn_name": "add", "inputs": ["1\n2\n"], "outputs": ["3"]})),  # "" is not JSON
        (block("def f(x):\n    return x + 1"), json.dumps({"assert_case": ["assert f(1) == 2", "assert f(2) == 4"]})),
        (
            block("def f(x):\n    return x + 1"),
            json.dumps({"assert_case": ["assert f(1) == 2"], "inputs": ["7"], "outputs": [None]}),
        ),
        (block(DOUBLE), "not json"),
        (block(DOUBLE), "[]"),
        (block(DOUBLE), "{}"),
        (block(DOUBLE), "null"),
        (block(DOUBLE), "5"),
        (block(DOUBLE), json.dumps({"inputs": [], "outputs": []})),
        (block(DOUBLE), json.dumps({"inputs": ["1"], "outputs": []})),
        (block(DOUBLE), json.dumps({"inputs": ["1"]})),
        (block(DOUBLE), json.dumps({"inputs": 5, "outputs": 5})),
        (block(DOUBLE), json.dumps({"inputs": ["1\n"], "outputs": ["2\n"], "assert_case": [1]})),
        (block(DOUBLE), json.dumps({"inputs": ["1\n"], "outputs": ["2\n"], "assert_case": "x"})),
        (block(DOUBLE), json.dumps({"inputs": ["1\n"], "outputs": ["2\n"], "assert_case": ["", ""]})),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", type=Path, required=True, help="a folder holding verl/utils/reward_score")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    default_compute_score, _ = load_scorers(args.verl)
    logging.disable(logging.CRITICAL)  # verl logs every failed case
    lines = []
    with StubServer(fusion_execute) as server:
        for index, (response, truth) in enumerate(cases()):
            source = SOURCES[index % len(SOURCES)]
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                score = default_compute_score(
                    source, response, truth, sandbox_fusion_url=f"{server.base_url}/run_code", memory_limit_mb=1024
                )
            record = {"data_source": source, "response": response, "ground_truth": truth, "score": float(score)}
            lines.append(json.dumps(record, ensure_ascii=True))
    args.output.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"{len(lines)} cases -> {args.output}")


if __name__ == "__main__":
    main()
