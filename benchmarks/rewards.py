"""Scoring throughput of `math_verify_reward`'s worker pool against plain sequential math-verify, in one run.

What is measured
----------------
`--n` (default 4096) synthetic responses of step-by-step math, several thousand characters each (prose, inline
and display LaTeX, intermediate results), generated with a fixed seed. Their endings are mixed like a training batch:
a right "Answer:" line, a right box in an equivalent form (0.5 for 1/2, \\sqrt{18} for 3\\sqrt{2}, 1\\,000), a wrong
answer, a box revised by a later "Answer:" line, no answer (none, the echoed template, an empty line), an
unparseable one (truncated or broken box), and `--towers` pathological power towers (`\\boxed{3^{3^{3^{3^{3^{100}}}}}}`,
each with its own base and truth so that none is judged twice) that make sympy run for minutes. Ground truths are
mostly integers (DAPO-Math-17k), some fractions and roots.

Three scorers judge the same batch, one after the other:

- `plain math-verify, sequential`: what TRL's `accuracy_reward` does, in this process: `verify(parse(truth),
  parse(response))` with math-verify's defaults (its own 5 s signal timeouts, usable here in the main thread).
- `pool, 1 worker`: `score_math_verify` with a 1-worker `KillableProcessPool`: the committed answer is extracted here
  and judged in the worker, under the 5 s deadline. Separates what the extraction saves from what parallelism adds.
- `pool, N workers`: the same with the default pool size (usable CPUs, `--workers` to change).

Each pool is new (no warm caches) and started before its timer; startup (fork server + workers) is reported apart.
Per-response latency: plain: the wall time of its parse + verify; pool: the seconds its call ran in a worker
(dispatch to result), 0 for responses decided in this process (no answer, unreadable); `max` shows the towers
bounded by the deadline. `speed-up` = plain time / this time. `agree` = share of responses whose +1 / -1 equals
plain math-verify's (they differ where plain math-verify has the pitfalls the pool fixes).

Run from the repository root (about 1.5 min on 2 idle CPU cores with the defaults):

    python benchmarks/rewards.py
    python benchmarks/rewards.py --quick     # 64 responses, no tower: the suite's check, seconds
    python benchmarks/rewards.py --n 1024 --towers 2
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dapo_trl.rewards import Verdict, math_verify_pool, score_math_verify  # noqa: E402
from dapo_trl.utils.killable_pool import DEFAULT_TIMEOUT_S, default_num_workers  # noqa: E402

# (truth, equivalent forms a response may box) for the non-integer truths
_EQUIVALENT_FORMS = [
    ("\\frac{1}{2}", ["0.5", "\\dfrac{1}{2}", "\\frac{2}{4}"]),
    ("3\\sqrt{2}", ["\\sqrt{18}", "3\\sqrt{2}", "3√2"]),
    ("\\frac{1}{3}", ["0.\\overline{3}", "\\frac{2}{6}"]),
    ("1000", ["1\\,000", "1{,}000", "10^3"]),
    ("-3", ["−3", "-\\frac{6}{2}"]),
    ("\\frac{3}{4}", ["¾", "0.75"]),
]
_CONNECTIVES = ["First,", "Next,", "Then", "Now", "So", "Therefore,", "Note that", "Hence", "Recall that", "Thus"]


def _step(rng: random.Random, k: int) -> str:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(1, 12)
    kind = rng.randrange(6)
    if kind == 0:
        body = f"we multiply ${a} \\cdot {b} = {a * b}$, and adding {c} gives ${a * b + c}$."
    elif kind == 1:
        body = f"the fraction $\\frac{{{a}}}{{{b}}}$ reduces by the gcd of {a} and {b}, which is $\\gcd({a},{b})$."
    elif kind == 2:
        body = f"squaring both sides, \\[ (x + {c})^2 = x^2 + {2 * c}x + {c * c}, \\] so the linear term is ${2 * c}x$."
    elif kind == 3:
        body = f"the discriminant is $b^2 - 4ac = {b}^2 - 4 \\cdot {c} \\cdot {a} = {b * b - 4 * a * c}$."
    elif kind == 4:
        body = f"by the triangle inequality the third side lies between {abs(a - b)} and {a + b}, exclusive."
    else:
        body = f"there are $\\binom{{{c + 3}}}{{2}}$ ways to choose the pair, and each contributes {a} to the total."
    return f"Step {k}: {rng.choice(_CONNECTIVES)} {body}"


def _steps(rng: random.Random) -> str:
    return "\n".join(_step(rng, k) for k in range(1, rng.randint(25, 55)))


def _response(rng: random.Random, kind: str, truth: str, forms: list[str]) -> str:
    steps = _steps(rng)
    right = rng.choice(forms) if forms else truth
    wrong = str(rng.randint(1, 999)) if truth.lstrip("-").isdigit() else "\\frac{2}{7}"
    endings = {
        "answer_right": f"\n\nPutting it together, the result is {right}.\nAnswer: {right}",
        "boxed_right": f"\n\nTherefore the final answer is $\\boxed{{{right}}}$.",
        "wrong": rng.choice([f"\nAnswer: {wrong}", f"\nSo the answer is \\boxed{{{wrong}}}."]),
        "revised": f"\nSo \\boxed{{{wrong}}}. Wait, step 3 was off by one; redoing it:\n{steps[:600]}\nAnswer: {right}",
        "no_answer": rng.choice(["\nI could not finish the computation.", "\nAnswer: $Answer", "\nAnswer:"]),
        "unparseable": rng.choice(
            ["\nThe answer is \\boxed{\\frac{3}{", "\nAnswer: \\frac{{}}}{", "\n\\boxed{\\left(}"]
        ),
    }
    return "Let me solve this step by step.\n" + steps + endings[kind]


def make_batch(n: int, towers: int, seed: int = 0) -> tuple[list[str], list[str], Counter]:
    """`n` responses and truths, `towers` of them pathological, shuffled with a fixed seed."""
    rng = random.Random(seed)
    kinds = rng.choices(
        ["answer_right", "boxed_right", "wrong", "revised", "no_answer", "unparseable"],
        weights=[30, 15, 30, 5, 12, 8],
        k=n - towers,
    )
    responses, truths = [], []
    for kind in kinds:
        if kind in ("boxed_right", "revised") and rng.random() < 0.6:
            truth, forms = rng.choice(_EQUIVALENT_FORMS)
        else:
            truth, forms = str(rng.randint(1, 999)), []
        responses.append(_response(rng, kind, truth, forms))
        truths.append(truth)
    for k in range(towers):
        base = 2 + k
        tower = f"{base}^{{{base}^{{{base}^{{{base}^{{{base}^{{100}}}}}}}}}}"
        responses.append(f"Let me solve this step by step.\n{_steps(rng)}\nSo the answer is \\boxed{{{tower}}}.")
        truths.append(str(17 + k))
    order = list(range(n))
    rng.shuffle(order)
    return [responses[i] for i in order], [truths[i] for i in order], Counter(kinds) + Counter(tower=towers)


def plain_math_verify(responses: list[str], truths: list[str]) -> tuple[list[float], list[float]]:
    """Sequential plain math-verify with its defaults: rewards (+1 / -1) and per-response seconds."""
    from math_verify import parse, verify

    rewards, seconds = [], []
    for response, truth in zip(responses, truths, strict=True):
        started = time.perf_counter()
        correct = verify(parse(truth), parse(response))
        seconds.append(time.perf_counter() - started)
        rewards.append(1.0 if correct else -1.0)
    return rewards, seconds


def pooled(responses: list[str], truths: list[str], workers: int) -> tuple[list[float], list[float], float, float, int]:
    """`score_math_verify` on a fresh pool: rewards, per-response seconds, run time, startup time, timeouts."""
    started = time.perf_counter()
    pool = math_verify_pool(workers, shared=False)
    pool.start()
    startup = time.perf_counter() - started
    try:
        started = time.perf_counter()
        scored = score_math_verify(responses, truths, pool=pool)
        elapsed = time.perf_counter() - started
    finally:
        pool.close()
    timeouts = sum(s.verdict == Verdict.TIMEOUT for s in scored)
    return [s.reward for s in scored], [s.seconds for s in scored], elapsed, startup, timeouts


def _quantile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=1000, method="inclusive")[round(q * 1000) - 1]


def _row(name: str, elapsed: float, seconds: list[float], base: float, agree: float, timeouts: int, n: int) -> str:
    return (
        f"| {name} | {elapsed:.2f} | {n / elapsed:.0f} | {base / elapsed:.2f}x | {1e3 * _quantile(seconds, 0.5):.2f} "
        f"| {1e3 * _quantile(seconds, 0.99):.2f} | {max(seconds):.2f} | {timeouts} | {agree:.1%} |"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="64 responses, no power tower: a check, no figure")
    parser.add_argument("--n", type=int, default=4096, help="responses in the batch")
    parser.add_argument("--towers", type=int, default=4, help="pathological power towers among them")
    parser.add_argument("--workers", type=int, default=None, help="workers of the parallel pool (default: CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.towers = 64, 0
    logging.disable(logging.WARNING)  # math-verify's and the pool's per-timeout warnings; the table counts them
    workers = args.workers or default_num_workers()

    responses, truths, kinds = make_batch(args.n, args.towers, args.seed)
    mean_chars = statistics.mean(len(r) for r in responses)
    print(f"{args.n} responses, mean {mean_chars:.0f} characters; endings: {dict(sorted(kinds.items()))}")
    print(f"deadline {DEFAULT_TIMEOUT_S:.0f} s; {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}\n")

    started = time.perf_counter()
    plain_rewards, plain_seconds = plain_math_verify(responses, truths)
    plain_elapsed = time.perf_counter() - started
    plain_timeouts = sum(s >= DEFAULT_TIMEOUT_S for s in plain_seconds)
    runs = [
        (f"pool, {w} worker{'s' if w > 1 else ''}", pooled(responses, truths, w)) for w in dict.fromkeys([1, workers])
    ]

    print("| scorer | time (s) | responses/s | speed-up | p50 (ms) | p99 (ms) | max (s) | timeouts | agree |")
    print("|---|---|---|---|---|---|---|---|---|")
    print(
        _row("plain math-verify, sequential", plain_elapsed, plain_seconds, plain_elapsed, 1.0, plain_timeouts, args.n)
    )
    for name, (rewards, seconds, elapsed, _, timeouts) in runs:
        agree = sum(a == b for a, b in zip(rewards, plain_rewards, strict=True)) / args.n
        print(_row(name, elapsed, seconds, plain_elapsed, agree, timeouts, args.n))
    startups = ", ".join(f"{name}: {run[3]:.1f} s" for name, run in runs)
    print(f"\npool startup, not timed above: {startups}; load average after {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
