"""Tool-use pieces without a trainer: the ReTool reward rule, output formatting, the gate, prefetching, the CLI."""

import threading

import pytest

from dapo_trl.rewards import REWARD_FUNCTIONS, make_tool_aware_reward, retool_shaped_score, tool_turns
from dapo_trl.tools import ExecutionGate, ExecutionResult, ExecutionStatus, LocalSandbox, SandboxLimits, TokenBucket
from dapo_trl.tools.code_interpreter import CodeInterpreter, format_tool_output, truncate_middle


def _conversation(tool_rounds: int, answer: str = "\\boxed{5}") -> list[dict]:
    messages = []
    for round_ in range(tool_rounds):
        call = {"type": "function", "function": {"name": "code_interpreter", "arguments": {"code": str(round_)}}}
        messages += [{"role": "assistant", "content": "", "tool_calls": [call, call]}]  # two parallel calls
        messages += [{"role": "tool", "name": "code_interpreter", "content": "0"}] * 2
    return messages + [{"role": "assistant", "content": answer}]


@pytest.mark.parametrize("rounds", [0, 1, 2, 3, 4, 7])
def test_tool_turns_counts_like_verls_agent_loop(rounds):
    # verl: num_turns = user_turns (tool rounds) + assistant_turns + 1 (the prompt)
    assert tool_turns(_conversation(rounds)) == rounds + (rounds + 1) + 1


def test_retool_rule_against_the_paper_formula():
    for score in (-1.0, 1.0):
        for turns in range(2, 20, 2):
            expected = score if score >= 0 else min(-0.6, score + (turns - 2) / 2 * 0.1)
            assert retool_shaped_score(score, turns) == pytest.approx(expected)
    assert retool_shaped_score(-1.0, 2) == -1.0
    assert retool_shaped_score(-1.0, 4) == pytest.approx(-0.9)
    assert retool_shaped_score(-1.0, 20) == -0.6  # capped


def test_retool_reward_scores_the_models_text_not_the_tool_output():
    reward = REWARD_FUNCTIONS["retool"]
    right, wrong = _conversation(2, "\\boxed{5}"), _conversation(2, "\\boxed{4}")
    printed_by_tool = _conversation(1, "no idea")
    printed_by_tool[1]["content"] = "\\boxed{5}"  # the program printed the answer; the model did not write it
    scores = reward(completions=[right, wrong, printed_by_tool, "\\boxed{4}"], solution=["5"] * 4)
    assert scores == pytest.approx([1.0, -0.8, -0.9, -1.0])


def test_tool_aware_wrapper_keeps_none_and_logs_rounds():
    logged = {}
    base = lambda completions, **kwargs: [None, -1.0]  # noqa: E731
    reward = make_tool_aware_reward(base, "shaped")
    assert reward.__name__ == "shaped"
    out = reward(completions=[_conversation(0), _conversation(2)], log_metric=logged.__setitem__)
    assert out == [None, pytest.approx(-0.8)] and logged["rewards/shaped/tool_rounds_mean"] == 1.0


def test_truncate_middle_keeps_head_and_tail():
    text = "head-" + "x" * 5000 + "-tail"
    short = truncate_middle(text, 200)
    assert len(short) <= 200 and short.startswith("head-") and short.endswith("-tail") and "truncated" in short
    assert truncate_middle("abc", 200) == "abc"


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        (ExecutionResult(ExecutionStatus.OK, "42\n"), "42\n"),
        (ExecutionResult(ExecutionStatus.OK), "(no output)"),
        (ExecutionResult(ExecutionStatus.ERROR, "a\n", "Traceback\nValueError: x\n"), "a\nTraceback\nValueError: x\n"),
        (ExecutionResult(ExecutionStatus.TIMEOUT, message="timed out after 30 s"), "Error: timed out after 30 s."),
        (ExecutionResult(ExecutionStatus.OUTPUT_LIMIT, "xx", message="output exceeded 9 bytes"), "xx\nError: output"),
        (ExecutionResult(ExecutionStatus.SANDBOX_ERROR, message="down"), "Error: the code could not be run (down)."),
    ],
)
def test_tool_output_is_what_the_model_needs(result, expected):
    assert format_tool_output(result).startswith(expected)


def test_token_bucket_with_a_fake_clock():
    now = [0.0]
    sleeps = []

    def sleep(seconds):
        sleeps.append(seconds)
        now[0] += seconds

    bucket = TokenBucket(rate=2.0, burst=2, clock=lambda: now[0], sleep=sleep)
    for _ in range(6):
        bucket.acquire()
    assert now[0] == pytest.approx(2.0)  # 2 at once, then one every 0.5 s
    with pytest.raises(ValueError, match="rate"):
        TokenBucket(rate=0)


def test_gate_caps_concurrency_across_threads():
    gate = ExecutionGate(max_concurrency=3)
    release = threading.Event()

    def hold():
        with gate.admit():
            release.wait(5)

    threads = [threading.Thread(target=hold) for _ in range(10)]
    for thread in threads:
        thread.start()
    threading.Event().wait(0.3)
    assert gate.in_flight == 3
    release.set()
    for thread in threads:
        thread.join()
    assert gate.peak_in_flight == 3 and gate.in_flight == 0


def test_prefetched_execution_is_consumed_once_and_counted_once():
    interpreter = CodeInterpreter(LocalSandbox(SandboxLimits(timeout_s=10)), max_output_chars=256)
    interpreter.prefetch("print(7 * 6)")
    interpreter.prefetch("print(7 * 6)")
    interpreter.prefetch("print('never asked')")
    assert interpreter.tool("print(7 * 6)") == "42\n"
    assert interpreter.tool(code="print(7 * 6)") == "42\n"
    assert interpreter.discard_prefetched() == 1
    assert interpreter.tool("1/0").endswith("ZeroDivisionError: division by zero\n")
    stats = interpreter.stats()
    assert stats["calls"] == 3 and stats["ok"] == 2 and stats["error"] == 1
    assert interpreter.stats()["calls"] == 0  # reset
    interpreter.close()


def test_tool_schema_is_what_trl_renders():
    from transformers.utils import get_json_schema

    interpreter = CodeInterpreter(LocalSandbox(SandboxLimits(timeout_s=5)))
    schema = get_json_schema(interpreter.tool)["function"]
    assert schema["name"] == "code_interpreter"
    assert schema["parameters"]["required"] == ["code"]
    assert "sandbox" in schema["description"]


def test_cli_names_the_fix_for_bad_tool_flags(tmp_path, capsys):
    """train_dapo.py's own entry point, in this process (each case stops before training): exit status 2 and an
    error line naming the fix."""
    from dapo_trl.cli import main

    base = ["--output_dir", str(tmp_path), "--max_steps", "1", "--report_to", "none"]
    for extra, message in [
        (["--tools", "python"], "unknown tool; available: code_interpreter"),
        (["--tools", "code_interpreter", "--sandbox", "remote"], "needs sandbox_url"),
        (["--tools", "code_interpreter", "--sandbox", "cloud"], "use 'local'"),
        (["--tools", "code_interpreter"], "--chat_template qwen2_5"),
        (["--chat_template", "no_such_template"], "not a file nor a TRL template"),
    ]:
        try:
            status = main(base + extra)
        except SystemExit as exit:  # argparse's choices
            status = exit.code
        error = capsys.readouterr().err
        assert status == 2 and message in error, (extra, error[-2000:])
