"""Two DAPO steps with the sandboxed code_interpreter on the tiny model: tool replies reach the model, are masked
out of the loss and its token count, hostile programs end as tool errors, and the steps go on."""

import json
import sys

import pytest
from transformers import AutoTokenizer

from dapo_trl.builtin_models import build_tiny_model

from .helpers import SCRIPTS, run_command

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LocalSandbox is Linux-only"),
]


@pytest.fixture(scope="module")
def tool_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("tool_run")
    run_command([sys.executable, str(SCRIPTS / "tool_run.py"), str(out), "2"], timeout=600)
    trained = [json.loads(line) for line in (out / "trained_rank0.jsonl").read_text().splitlines()]
    calls = [json.loads(line) for line in (out / "tool_calls_rank0.jsonl").read_text().splitlines()]
    return {
        "trained": trained,
        "calls": calls,
        "history": json.loads((out / "log_history.json").read_text()),
        "peak": json.loads((out / "peak_in_flight.json").read_text()),
    }


def test_two_steps_complete_with_tool_metrics(tool_run):
    steps = [entry for entry in tool_run["history"] if "loss" in entry]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(entry["tools/executions"] > 0 for entry in steps)
    assert sum(entry["tools/timeout_rate"] + entry["tools/error_rate"] for entry in steps) > 0
    assert all(0 < entry["tools/responses_with_tool_use"] <= 0.5 for entry in steps)


def test_the_model_reads_each_programs_outcome(tool_run):
    # a reply TRL rolled back (it would overflow the completion budget) leaves its code without a reply
    pairs = [zip(record["codes"], record["replies"], strict=False) for record in tool_run["calls"]]
    replies = {code: reply for pair in pairs for code, reply in pair}
    assert replies["x = 6 * 7\nx"] == "42\n"
    assert replies["print(sum(range(101)))"] == "5050\n"
    assert replies["while True:\n    pass"] == "Error: timed out after 2 s."
    assert replies["raise ValueError('boom')"].rstrip().endswith("ValueError: boom")
    killer = next(reply for code, reply in replies.items() if code.startswith("import os\nfor p in"))
    assert killer.rstrip().endswith("still here")  # neither init nor the trainer could be signalled


def test_prefetch_runs_a_turns_calls_in_parallel(tool_run):
    assert tool_run["peak"] >= 2


def test_tool_reply_tokens_are_masked_out_of_the_loss(tool_run):
    tokenizer = AutoTokenizer.from_pretrained(build_tiny_model())
    rows_with_tools = 0
    for batch in tool_run["trained"]:
        for ids, completion, tool, loss in zip(
            batch["completion_ids"], batch["completion_mask"], batch["tool_mask"], batch["loss_mask"], strict=True
        ):
            assert loss == [c * t for c, t in zip(completion, tool, strict=True)]
            masked = [i for i, c, t in zip(ids, completion, tool, strict=True) if c and not t]
            kept = [i for i, c, t in zip(ids, completion, tool, strict=True) if c and t]
            assert "<tool_response>" not in tokenizer.decode(kept)
            if masked:
                rows_with_tools += 1
                text = tokenizer.decode(masked)
                assert text.count("<tool_response>") == text.count("</tool_response>") >= 1
                assert "<tool_call>" in tokenizer.decode(kept)  # the model's own call is trained on
    assert rows_with_tools >= 2
