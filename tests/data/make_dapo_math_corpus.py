"""Build `dapo_math_corpus.jsonl`: responses and ground truths with the verdicts of DAPO's published scorer.

The expected values come from RUNNING the reference, never from this repository's code: verl's published
`verl/utils/reward_score/math_dapo.py` (`compute_score(solution_str, ground_truth)`, the Minerva path DAPO's recipe
uses: the last 300 characters, `strict_box_verify=False`), kept outside this repository and loaded from the path
given on the command line. The shipped corpus was produced from volcengine/verl at commit
b178a3cd56f58b2d502255daba591e92833930a7 (the file last changed in 00a10a8ef389556f957a2f36132b2358fd6a109f):

    git --git-dir=<verl>.git show b178a3cd:verl/utils/reward_score/math_dapo.py > /tmp/ref/math_dapo_ref.py
    python tests/data/make_dapo_math_corpus.py --reference /tmp/ref/math_dapo_ref.py

Each line is one case: `response`, `ground_truth`, a `kind` saying what it exercises, and the reference's full
result `score` (+1.0 / -1.0), `acc` (bool) and `pred` (the normalised prediction, "[INVALID]" when no "Answer:" line
is found). `tests/test_dapo_math_reference.py` checks `dapo_trl.rewards.dapo.dapo_math_score` against every line. The
cases are generated deterministically (fixed seed), so rerunning the script rewrites the same file.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

SEED = 20250317
OUTPUT = Path(__file__).resolve().parent / "dapo_math_corpus.jsonl"
WINDOW = 300  # compute_score reads the last 300 characters

# Whitespace around and after the answer: plain, Windows and Unicode forms, and line separators regex treats as text.
WHITESPACE = [
    "",
    " ",
    "  ",
    "\t",
    "\r",
    "\r\n",
    "\n",
    "\n\n",
    " \n",
    "\t\n",
    "\xa0",
    "\xa0\n",
    "\u3000",
    "\u2009",
    "\u200b",
    "\x0b",
    "\x0c",
    "\u2028",
    "\x85",
    " \r\n",
    "\r\r\n",
    "\n \n",
]
# Between "Answer" and ":" and between ":" and the answer.
GAPS = ["", " ", "  ", "\t", "\n", "\r\n", "\xa0", " \n ", "\n\n"]
LABELS = [
    "Answer",
    "answer",
    "ANSWER",
    "AnSwEr",
    "Final Answer",
    "**Answer**",
    "The answer",
    "Answers",
    "Anſwer",
    "ＡＮＳＷＥＲ",
    "Answer\u200b",
    "Ans",
]
COLONS = [":", "：", ": ", " :", "::", "-", "="]

# (answer as written, ground truth): Minerva normalisation's cases, equal and unequal after normalising.
NORMALISATION = [
    ("42", "42"),
    ("-7", "-7"),
    ("0", "0"),
    ("007", "7"),
    ("42.", "42"),
    ("42.0", "42"),
    ("+5", "5"),
    ("1,000", "1000"),
    ("1,000,000", "1000000"),
    ("1,00", "100"),
    ("1{,}000", "1000"),
    ("$1{,}000$", "1000"),
    ("1\\,000", "1000"),
    ("1\\;000", "1000"),
    ("1,\\!000", "1000"),
    ("1 000", "1000"),
    ("1\xa0000", "1000"),
    ("-1,000", "-1000"),
    ("1,000.5", "1000.5"),
    ("12,34", "1234"),
    ("$5$", "5"),
    ("$5$.", "5"),
    ("\\$5", "5"),
    ("$\\$5$", "5"),
    ("5 dollars", "5"),
    ("\\$5.00", "5"),
    ("12 cents", "12"),
    ("5 inches", "5"),
    ("5\\text{ inches}", "5"),
    ("\\text{5 inches}", "5"),
    ("5 cm", "5"),
    ("5 \\text{cm}", "5"),
    ("5\\mbox{ cm}", "5"),
    ("5 km", "5"),
    ("5\\text{m}", "5"),
    ("5 meters", "5"),
    ("60 mph", "60"),
    ("3 hours", "3"),
    ("7 feet", "7"),
    ("7 ft", "7"),
    ("10 points", "10"),
    ("24 ways", "24"),
    ("8 students", "8"),
    ("5 units", "5"),
    ("5 square units", "5"),
    ("5 \\text{units}^2", "5"),
    ("4 edges", "4"),
    ("3 digits", "3"),
    ("9 integers", "9"),
    ("2 pounds", "2"),
    ("15 minutes", "15"),
    ("90^\\circ", "90"),
    ("90^{\\circ}", "90"),
    ("90°", "90"),
    ("90 degrees", "90"),
    ("90\\text{ degrees}", "90"),
    ("50\\%", "50"),
    ("50%", "50"),
    ("50\\%", "50\\%"),
    ("0.5", "50\\%"),
    ("\\frac12", "\\frac{1}{2}"),
    ("\\frac{1}{2}", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac{1}{2}", "\\frac{1}{2}"),
    ("\\frac 1 2", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("0.5", "\\frac{1}{2}"),
    ("\\frac{3}{4}", "\\frac34"),
    ("\\frac{10}{3}", "\\frac103"),
    ("\\sqrt2", "\\sqrt{2}"),
    ("\\sqrt{2}", "\\sqrt2"),
    ("2\\sqrt{3}", "2\\sqrt3"),
    ("\\sqrt{18}", "3\\sqrt{2}"),
    ("x = 5", "5"),
    ("x=5", "5"),
    ("a = b = 3", "3"),
    ("5", "x = 5"),
    ("y = 2x + 1", "2x+1"),
    ("x \\le 3", "3"),
    ("\\boxed{5}", "5"),
    ("$\\boxed{5}$", "5"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{5", "5"),
    ("\\fbox{5}", "5"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed{5} and \\boxed{6}", "6"),
    ("\\textbf{5}", "5"),
    ("\\text{(A)}", "(A)"),
    ("(A)", "A"),
    ("\\textbf{(C)}", "C"),
    ("\\overline{3}", "3"),
    ("\\mathrm{5}", "5"),
    ("5\\mathrm{th}", "5"),
    ("5th", "5"),
    ("\\text{five}", "five"),
    ("\\pi", "\\pi"),
    ("2\\pi", "2 \\pi"),
    ("\\infty", "\\infty"),
    ("-\\infty", "-\\infty"),
    ("(1, 2)", "(1,2)"),
    ("[1, 2)", "[1,2)"),
    ("\\{1, 2\\}", "\\{1,2\\}"),
    ("1, 2, 3", "1,2,3"),
    ("1 \\text{ and } 2", "1,2"),
    ("1,\\text{and}2", "1,2"),
    ("3 \\ldots", "3"),
    ("1, 2, \\dots", "1,2,"),
    ("an apple", "apple"),
    ("a cat", "cat"),
    ("banana", "banana"),
    ("a", "a"),
    ('"5"', "5"),
    ('5"', "5"),
    ("-5", "−5"),
    ("−5", "-5"),
    ("½", "\\frac{1}{2}"),
    ("５", "5"),
    ("٣", "3"),
    ("²", "2"),
    ("Ⅻ", "12"),
    ("5 😀", "5"),
    ("5\u200b", "5"),
    ("\u200b5", "5"),
    ("e\u0301", "é"),
    ("x\\;y", "xy"),
    ("\\;5", "5"),
    ("5\\text{}^2", "5"),
    ("5\\text{s}", "5"),
    ("5\\text{.}", "5"),
    ("$", ""),
    ("$$", ""),
    ("dollars", ""),
    ("[INVALID]", "[INVALID]"),
    ("[invalid]", "[INVALID]"),
    ("Answer: 5", "5"),
    ("5 Answer: 6", "6"),
    ("3 = 4", "4"),
    ("=", ""),
    ("", ""),
    ("\\", "\\"),
    ("{5}", "5"),
    ("5$", "5"),
    ("$5", "5"),
    ("5.$", "5"),
    ("$5.$", "5"),
    ("\\$", ""),
    ("\\ 5", "5"),
    ("5\\ ", "5"),
    ("1.5", "\\frac{3}{2}"),
    ("3/2", "1.5"),
    ("10^{3}", "1000"),
    ("1e3", "1000"),
    ("2^{10}", "1024"),
    ("\\left(1, 2\\right)", "(1,2)"),
]
GROUND_TRUTHS = [
    "5",
    "42",
    "-7",
    "1000",
    "\\frac{1}{2}",
    "x = 5",
    " 5 ",
    "5\n",
    "5\r",
    "\\boxed{5}",
    "$5$",
    "5 dollars",
    "1,000",
    "",
    " ",
    "[INVALID]",
    "dollars",
    "A",
    "(A)",
    "\\text{5}",
    "90^\\circ",
    "50\\%",
    "\\sqrt{2}",
    "12\xa0",
    "\t42",
]
FILLER_WORDS = [
    "so",
    "we",
    "get",
    "the",
    "sum",
    "is",
    "then",
    "x",
    "=",
    "3",
    "+",
    "4",
    "\\frac{1}{2}",
    "$",
    "\\boxed{7}",
    "answer",
    "Answer",
    ":",
    "\n",
    "therefore",
    "let",
    "check",
    "(",
    ")",
    "{",
    "}",
    "1,000",
    "°",
    "é",
    "−",
]


def load_reference(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location("math_dapo_reference", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the reference from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def filler(rng: random.Random, length: int, decoys: bool = True) -> str:
    """Reasoning-like text of exactly `length` characters, with decoy "answer" words and boxes if `decoys`."""
    vocabulary = FILLER_WORDS if decoys else [word for word in FILLER_WORDS if word.lower() not in ("answer", ":")]
    words: list[str] = []
    size = 0
    while size < length:
        word = rng.choice(vocabulary)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:length].ljust(length)


def answer_line_cases() -> Iterator[tuple[str, str, str]]:
    """Every normalisation pair on a plain last line, then with each whitespace tail and gap."""
    for answer, truth in NORMALISATION:
        yield "normalisation", f"Let me work it out.\nAnswer: {answer}", truth
        yield "normalisation-no-space", f"Answer:{answer}", truth
    for tail in WHITESPACE:
        for answer, truth in [("1,000", "1000"), ("42", "42"), ("\\frac12", "\\frac{1}{2}"), ("5 dollars", "5")]:
            yield "whitespace-tail", f"Work.\nAnswer: {answer}{tail}", truth
        yield "whitespace-only-tail", f"Answer: 3\nAnswer:{tail}", "3"
        yield "whitespace-only-answer", f"Answer:{tail}", ""
        yield "whitespace-lead", f"Answer:{tail}42", "42"
    for before in GAPS:
        for after in GAPS:
            yield "gaps", f"Thus\nAnswer{before}:{after}17\n", "17"
    for label in LABELS:
        for colon in COLONS:
            yield "labels", f"Done.\n{label}{colon} 8", "8"


def repeated_line_cases() -> Iterator[tuple[str, str, str]]:
    """Empty, blank and repeated "Answer:" lines: which one counts."""
    responses = [
        "Answer: 3\nAnswer:",
        "Answer: 3\nAnswer:\n",
        "Answer: 3\nAnswer:\n\n",
        "Answer: 3\nAnswer: ",
        "Answer: 3\nAnswer: \n",
        "Answer: 3\nAnswer:\t\n",
        "Answer: 3\nAnswer:\r\n",
        "Answer: 3\nAnswer:\xa0",
        "Answer: 3\nAnswer:\n4",
        "Answer: 3\nAnswer:\n\n4",
        "Answer:\nAnswer: 3",
        "Answer:\n\nAnswer: 3",
        "Answer: Answer: 3",
        "Answer: 3 Answer: 4",
        "Answer: 3\nAnswer: 4",
        "Answer: 4\nAnswer: 3",
        "Answer: 3\nanswer: 4\nANSWER:",
        "Answer: 3\n\nWait, let me recheck.\n\nAnswer:",
        "Answer: $Answer",
        "Answer: $Answer\nAnswer: 3",
        "Answer: 3\nAnswer: $Answer",
        "Answer:",
        "Answer:\n",
        "Answer: ",
        "Answer::3",
        "Answer:\n:3",
        "The answer:3\nAnswer:",
        "Answer: 3\r\nAnswer:\r\n",
        "Answer: 3\u2028Answer:",
        "Answer: 3\nAnswer:\u2028",
        "\\boxed{3}\nAnswer:",
        "Answer: \\boxed{3}\nAnswer:\n",
    ]
    for response in responses:
        for truth in ["3", "4", "", "[INVALID]", "Answer:3", "$Answer", "3Answer:4"]:
            yield "repeated-lines", response, truth


def window_cases(rng: random.Random) -> Iterator[tuple[str, str, str]]:
    """The "Answer:" line straddling the 300-character window: just inside, cut, just outside."""
    for line in ["Answer: 12345", "Answer:12345", "answer :  12345"]:
        for shift in range(-4, len(line) + 4):
            # The window starts `shift` characters into the line (before it when negative).
            tail = "\n" + filler(rng, WINDOW - len(line) + shift - 1, decoys=False)
            yield "window", filler(rng, 60) + "\n" + line + tail, "12345"
    for offset in (WINDOW - 2, WINDOW - 1, WINDOW, WINDOW + 1, WINDOW + 2):
        head = "Answer: 7"
        response = head + "x" * (offset - len(head))  # the line's start sits `offset` characters from the end
        yield "window-edge", response, "7"
        yield "window-edge", response, "x" * (WINDOW - len(head))
    for length in (WINDOW - 1, WINDOW, WINDOW + 1):
        yield "window-answer-fills", "Answer: " + "9" * length, "9" * length
        yield "window-answer-fills", "Answer: " + "9" * length, "9" * (WINDOW - len("Answer: "))
        yield "window-answer-fills", "Answer: " + "9" * length, "9" * WINDOW


def boxed_cases() -> Iterator[tuple[str, str, str]]:
    """Boxes: the Minerva path reads only "Answer:" lines, and strips a box inside one."""
    boxes = [
        "\\boxed{5}",
        "\\boxed{{5}}",
        "\\boxed{\\frac{1}{2}}",
        "\\boxed{5",
        "\\boxed 5",
        "\\fbox{5}",
        "\\boxed{5}.",
        "$\\boxed{5}$",
        "\\boxed{\\text{5}}",
        "\\boxed{5} \\boxed{6}",
        "\\boxed{\\{1,2\\}}",
        "\\boxed{a{b}c}",
        "\\boxed{}",
        "\\boxed{\\boxed{5}}",
        "\\[\\boxed{5}\\]",
    ]
    for box in boxes:
        for truth in ["5", "\\frac{1}{2}", "{5}", "\\{1,2\\}", "abc", "a{b}c", ""]:
            yield "boxed-only", f"So the result is {box}", truth
            yield "boxed-answer-line", f"Answer: {box}", truth
        yield "boxed-then-line", f"{box}\nAnswer: 6", "6"
        yield "line-then-boxed", f"Answer: 6\n{box}", "5"


def ground_truth_cases() -> Iterator[tuple[str, str, str]]:
    """Ground truths with and without normalisable parts, against a few written answers."""
    answers = [
        "5",
        "42",
        "-7",
        "1000",
        "1,000",
        "\\frac12",
        "5 dollars",
        "$5$",
        "\\boxed{5}",
        "A",
        "(A)",
        "90",
        "50",
        "\\sqrt2",
        "x = 5",
        "",
    ]
    for truth in GROUND_TRUTHS:
        for answer in answers:
            yield "ground-truths", f"Answer: {answer}", truth
        yield "ground-truths-no-answer", "I could not solve it.", truth


def long_cases(rng: random.Random) -> Iterator[tuple[str, str, str]]:
    """Long responses: only the end is read."""
    for length in (2_000, 20_000):
        body = filler(rng, length)
        yield "long", body + "\nAnswer: 314", "314"
        yield "long", "Answer: 314\n" + body, "314"
        yield "long", body + "\nAnswer: 314" + "\n" * 400, "314"
        yield "long", body + "\nAnswer: 314\r\n", "314"
        yield "long", ("Answer: 1\n" * 2000) + "Answer: 2", "2"


def unicode_cases() -> Iterator[tuple[str, str, str]]:
    texts = [
        "Answer: −5",
        "Answer: ５",
        "Answer: ٣",
        "Answer: ½",
        "Answer: 3²",
        "Answer: 𝟓",
        "Answer: 5️⃣",
        "Ответ: 5\nAnswer: 5",
        "答案：5",
        "Answer: ５０",
        "Answer: 5\u0301",
        "Answer: \u202e5",
        "Answer: 5\ufeff",
        "Answer: 1\u066c000",
        "Answer: ①",
        "Answer: 5\udc80",
        "ANSWER: ſ",
        "Answer: K",
        "Answer: ß",
    ]
    for text in texts:
        for truth in ["5", "-5", "3", "50", "1000", "\\frac{1}{2}", "s", "ss", "k"]:
            yield "unicode", text, truth


def random_cases(rng: random.Random, count: int) -> Iterator[tuple[str, str, str]]:
    """Random mixtures of the pieces above, so combinations nobody listed are covered too."""
    for _ in range(count):
        answer, truth = rng.choice(NORMALISATION)
        if rng.random() < 0.3:
            truth = rng.choice(GROUND_TRUTHS)
        label = rng.choice(LABELS[:5])
        gap = rng.choice(GAPS)
        tail = rng.choice(WHITESPACE)
        line = f"{label}{rng.choice(COLONS[:4])}{gap}{answer}{tail}"
        extra = ""
        if rng.random() < 0.3:
            extra = rng.choice(["\nAnswer:", "\nAnswer: ", "\nAnswer:\n", "\nAnswer: 0", "\n\\boxed{0}", "\n"])
        prefix = filler(rng, rng.choice([0, 10, 100, WINDOW - len(line) - 3, WINDOW - len(line), WINDOW]))
        yield "random", prefix + "\n" + line + extra, truth


def cases(rng: random.Random) -> Iterator[tuple[str, str, str]]:
    yield from answer_line_cases()
    yield from repeated_line_cases()
    yield from window_cases(rng)
    yield from boxed_cases()
    yield from ground_truth_cases()
    yield from long_cases(rng)
    yield from unicode_cases()
    yield from random_cases(rng, 250)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, required=True, help="verl's math_dapo.py, outside this repository")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()
    reference = load_reference(args.reference)
    seen: set[tuple[str, str]] = set()
    lines = []
    for kind, response, truth in cases(random.Random(SEED)):
        if (response, truth) in seen:
            continue
        seen.add((response, truth))
        result = reference.compute_score(response, truth)
        case = {"kind": kind, "response": response, "ground_truth": truth}
        case.update(score=float(result["score"]), acc=bool(result["acc"]), pred=result["pred"])
        lines.append(json.dumps(case, ensure_ascii=True))
    args.output.write_text("\n".join(lines) + "\n", encoding="ascii")
    print(f"{len(lines)} cases -> {args.output}")


if __name__ == "__main__":
    main()
