"""Build `verl_default_corpus.jsonl`: responses, ground truths and data sources with the results of verl's own scorers.

The expected values come from RUNNING verl's `verl/utils/reward_score` package (kept outside this repository and
loaded from the checkout given on the command line), never from this repository's code: `default_compute_score` for
every routed case, and `math_verify.compute_score` (the override verl recommends for the MATH sets) for the
`math_verify` cases. The shipped corpus was produced from volcengine/verl at commit
b178a3cd56f58b2d502255daba591e92833930a7:

    mkdir -p /tmp/verlref && git --git-dir=<verl>.git archive b178a3cd verl/utils/reward_score \\
        verl/utils/import_utils.py verl/utils/py_functional.py | tar x -C /tmp/verlref
    python tests/data/make_verl_default_corpus.py --verl /tmp/verlref

(`verl/__init__.py` and `verl/utils/__init__.py` are replaced by empty packages so that loading the scorers does not
import the rest of verl.) Each line is one case: `kind`, `scorer` ("default_compute_score" or "math_verify"),
`data_source`, `response`, `ground_truth`, and either verl's result, `score` with `acc` and `pred` where verl
returns them, or `error`: the exception's type name. `tests/test_verl_default_reference.py` checks
`dapo_trl.rewards.verl_default` against every line. Cases are generated deterministically (fixed seed).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import random
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 20260124
OUTPUT = Path(__file__).resolve().parent / "verl_default_corpus.jsonl"
DAPO_CORPUS = Path(__file__).resolve().parent / "dapo_math_corpus.jsonl"
WINDOW = 300

GSM8K_ANSWERS = [
    "#### 72",
    "####72",
    "#### 7,200",
    "#### 7,2,00",
    "#### -5",
    "#### - 5",
    "#### 3.50",
    "#### 3.5",
    "#### .5",
    "#### 72.",
    "#### $72",
    "#### 72$",
    "####  72",
    "##### 72",
    "#### 72 dollars",
    "#### 1,000,000",
    "#### ٧٢",
    "#### ７２",
    "#### 72\n#### 73",
    "#### 73\n#### 72",
    "#### 7 2",
    "The answer is 72.",
    "72",
    "#### ",
    "####",
    "#### ,",
    "#### -",
    "#### 0",
    "#### 00",
    "#### 072",
    "#### 72,",
    "#### 1e3",
    "#### −5",
    "#### 72\r\n",
    "**#### 72**",
    "\\boxed{72}",
    "Answer: 72",
]
GSM8K_TRUTHS = ["72", "7200", "-5", "3.50", "3.5", ".5", "72.", "1000000", "0", "072", "1000", "72 "]

MATH_ANSWERS = [
    "5",
    "42",
    "-7",
    "\\frac{1}{2}",
    "\\frac12",
    "\\dfrac{1}{2}",
    "\\tfrac12",
    "0.5",
    ".5",
    "1/2",
    "3/4",
    "03/4",
    "+3/4",
    "3 / 4",
    "\\frac{3}{4}",
    "\\frac34",
    "\\frac3{4}",
    "\\frac{3}4",
    "\\frac 3 4",
    "\\frac",
    "\\frac1",
    "x\\frac",
    "\\sqrt2",
    "\\sqrt{2}",
    "2\\sqrt3",
    "\\sqrt",
    "\\sqrt{18}",
    "3\\sqrt{2}",
    "k = 5",
    "k=5",
    "abc = 5",
    "x = y = 5",
    "10\\text{ cm}",
    "10 \\text{ cm}",
    "10\\text{ cm}\\text{ m}",
    "10\\text{cm}",
    "90^\\circ",
    "90^{\\circ}",
    "90",
    "50\\%",
    "50\\\\%",
    "50",
    "\\$5",
    "5",
    "\\left( 1, 2 \\right)",
    "(1,2)",
    "(1, 2)",
    "1,\\!000",
    "1000",
    "1{,}000",
    "\\infty",
    "\\pi",
    "2\\pi",
    "\\text{(A)}",
    "(A)",
    "A",
    "\\{1,2\\}",
    "a\nb",
    "ab",
    "",
    " ",
    "5.",
    " .5",
    "{.5}",
    "{0.5}",
    "x",
    "x^2+1",
    "x^2 + 1",
    "\\\\frac{1}{2}",
    "\\!5",
    "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
    "\\begin{pmatrix}1\\\\2\\end{pmatrix}",
]
MATH_TRUTHS = [
    "5",
    "-7",
    "\\frac{1}{2}",
    "\\frac{3}{4}",
    "\\sqrt{2}",
    "3\\sqrt{2}",
    "5",
    "10",
    "90",
    "50",
    "(1,2)",
    "1000",
    "\\text{(A)}",
    "A",
    "\\infty",
    "2\\pi",
    "x^2+1",
    "0.5",
    ".5",
    "k = 5",
    "10\\text{ cm}",
    "\\sqrt",
    "\\frac",
    "",
    "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}",
]
MATH_WRAPPERS = [
    "\\boxed{{{a}}}",
    "So the answer is $\\boxed{{{a}}}$.",
    "\\boxed {a}$",
    "\\boxed {a}",
    "\\fbox{{{a}}}",
    "\\boxed{{{a}}} and \\boxed{{0}}",
    "\\boxed{{0}} then \\boxed{{{a}}}",
    "\\boxed{{{a}",
    "$\\boxed{{{a}}}$ \\boxed 0$",
    "{a}",
    "\\boxed{{\\boxed{{{a}}}}}",
    "}} \\boxed{{{a}}} {{",
    "\\boxed{{{{{a}}}}}",
]
MATH_SOURCES = ["lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"]
DAPO_SOURCES = ["math_dapo", "math", "math_dapo_reasoning", "aime2024", "aime2025", "aime", "aime_x"]
UNKNOWN_SOURCES = ["gsm8k", "openai/GSM8K", "MATH", "lighteval/math", "Math_dapo", "AIME2024", "custom", "", " aime"]
MATH_VERIFY_CASES = [
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("The answer is $0.5$", "\\frac{1}{2}"),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}"),
    ("$x = 5$", "5"),
    ("5", "5"),
    ("five", "5"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("The result is 42.", "42"),
    ("\\boxed{\\pi}", "\\pi"),
    ("\\boxed{2\\pi}", "\\pi"),
    ("\\boxed{\\infty}", "\\infty"),
    ("", "5"),
    ("\\boxed{}", "5"),
    ("\\boxed{x^2+1}", "1+x^2"),
    ("\\boxed{50\\%}", "0.5"),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}"),
    ("Answer: 12", "12"),
    ("\\boxed{12} wait \\boxed{13}", "13"),
    ("\\boxed{12} wait \\boxed{13}", "12"),
    ("$\\frac{3}{4}$", "0.75"),
    ("$\\sqrt{2}$", "1.414"),
    ("\\boxed{E}", "E"),
    ("\\boxed{\\text{(C)}}", "C"),
    ("\\boxed{-7}", "-7"),
    ("\\boxed{7}", "-7"),
    ("\\boxed{\\frac{1}{3}}", "0.333"),
]


def load_scorers(root: Path) -> tuple[Any, Any]:
    """verl's reward_score package from `root` (a folder holding verl/utils/reward_score), without verl's heavy
    package __init__ files: `verl` and `verl.utils` become empty packages pointing at the folders."""
    for name, folder in (("verl", root / "verl"), ("verl.utils", root / "verl" / "utils")):
        package = types.ModuleType(name)
        package.__path__ = [str(folder)]
        sys.modules[name] = package
    scores = importlib.import_module("verl.utils.reward_score")
    return scores.default_compute_score, importlib.import_module("verl.utils.reward_score.math_verify").compute_score


def gsm8k_cases(rng: random.Random) -> Iterator[tuple[str, str, str, str]]:
    for answer in GSM8K_ANSWERS:
        for truth in GSM8K_TRUTHS:
            yield "gsm8k", "openai/gsm8k", f"Natalia sold 48 clips.\n{answer}", truth
    filler = "".join(rng.choice("abc 123,.\n") for _ in range(2 * WINDOW))
    for shift in range(-3, 12):  # "#### 72" straddling the 300-character window
        tail = "x" * (WINDOW - len("#### 72") + shift)
        yield "gsm8k-window", "openai/gsm8k", filler + "#### 72" + tail, "72"
        yield "gsm8k-window", "openai/gsm8k", filler + "#### 72" + tail, "2"


def math_cases() -> Iterator[tuple[str, str, str, str]]:
    for index, answer in enumerate(MATH_ANSWERS):
        source = MATH_SOURCES[index % len(MATH_SOURCES)]
        for truth in MATH_TRUTHS:
            yield "math", source, f"Thus \\boxed{{{answer}}}", truth
        for wrapper in MATH_WRAPPERS:
            yield "math-boxes", source, wrapper.format(a=answer), "5" if index % 2 else answer
    yield "math-no-box", "lighteval/MATH", "The answer is 5", "5"
    yield "math-no-box", "lighteval/MATH", "", ""


def dapo_cases(rng: random.Random) -> Iterator[tuple[str, str, str, str]]:
    lines = DAPO_CORPUS.read_text(encoding="ascii").splitlines()
    for line in rng.sample(lines, 140):
        case = json.loads(line)
        yield "dapo", rng.choice(DAPO_SOURCES), case["response"], case["ground_truth"]


def unknown_cases() -> Iterator[tuple[str, str, str, str]]:
    for source in UNKNOWN_SOURCES:
        yield "unknown-source", source, "#### 72\n\\boxed{72}\nAnswer: 72", "72"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verl", type=Path, required=True, help="a folder holding verl/utils/reward_score")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    default_compute_score, math_verify_score = load_scorers(args.verl)
    rng = random.Random(SEED)
    cases = [("default_compute_score", *case) for case in gsm8k_cases(rng)]
    cases += [("default_compute_score", *case) for case in math_cases()]
    cases += [("default_compute_score", *case) for case in dapo_cases(rng)]
    cases += [("default_compute_score", *case) for case in unknown_cases()]
    cases += [("math_verify", "math-verify", "lighteval/MATH", r, t) for r, t in MATH_VERIFY_CASES]
    seen: set[tuple[str, ...]] = set()
    lines = []
    for scorer, kind, source, response, truth in cases:
        if (scorer, source, response, truth) in seen:
            continue
        seen.add((scorer, source, response, truth))
        record: dict[str, Any] = {"kind": kind, "scorer": scorer, "data_source": source, "response": response}
        record["ground_truth"] = truth
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # verl's MATH scorer prints its exceptions
                if scorer == "math_verify":
                    result = math_verify_score(response, truth)
                else:
                    result = default_compute_score(source, response, truth)
        except Exception as error:  # noqa: BLE001 - the reference's failure is the expected result
            record["error"] = type(error).__name__
        else:
            if isinstance(result, dict):
                record.update(score=float(result["score"]), acc=bool(result["acc"]), pred=result["pred"])
            else:
                record["score"] = float(result)
        lines.append(json.dumps(record, ensure_ascii=True))
    args.output.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"{len(lines)} cases -> {args.output}")


if __name__ == "__main__":
    main()
