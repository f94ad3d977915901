"""Every process fails together (`dapo_trl.training.faults.fail_together`): an exception on one process ends every
process with that exception's message within seconds, also when the failing process stays alive (as a peer stuck in
an NCCL collective would: gloo alone would let the others wait in theirs for its 30-minute timeout)."""

import threading
import time

import pytest
import torch.distributed as dist

from dapo_trl.training.faults.fail_together import FailTogether, PeerProcessFailed

from .helpers import SCRIPTS, python_command, run_unchecked


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    return lambda: dist.TCPStore("127.0.0.1", server.port, is_master=False)


def fail(exc: BaseException):
    raise exc


def test_a_failure_stops_a_process_stuck_in_a_collective_with_its_message(store, capsys):
    exited, cleaned, release = threading.Event(), threading.Event(), threading.Event()
    waiting = FailTogether(
        0,
        2,
        store,
        on_peer_failure=cleaned.set,
        exit_process=lambda code: exited.set(),
        poll_seconds=0.01,
        own_exit_seconds=0.05,
    )
    failing = FailTogether(1, 2, store, poll_seconds=0.01)
    stuck = threading.Thread(target=waiting.run, args=(lambda: release.wait(30),))  # never returns by itself
    stuck.start()
    try:
        with pytest.raises(ValueError, match="bad reward"):  # the failing process raises its own error
            failing.run(lambda: fail(ValueError("bad reward")))
        assert exited.wait(10) and cleaned.is_set()
    finally:
        release.set()
        stuck.join()
    error = capsys.readouterr().err
    assert "error: process 0 stops because process 1 failed: ValueError: bad reward (test_fail_together.py:" in error


def test_a_process_whose_collective_raises_reports_the_first_failure_not_its_own(store):
    """Gloo notices a closed socket at once: that process raises the first failure's message and is not exited."""
    failing = FailTogether(1, 2, store, poll_seconds=0.01)
    exits = []
    peer = FailTogether(0, 2, store, exit_process=exits.append, poll_seconds=0.01, own_exit_seconds=5)
    with pytest.raises(KeyError):
        failing.run(lambda: fail(KeyError("answer")))
    with pytest.raises(PeerProcessFailed, match="process 1 failed: KeyError: 'answer'") as raised:
        peer.run(lambda: fail(RuntimeError("Connection closed by peer")))
    assert isinstance(raised.value.__cause__, RuntimeError) and not exits
    assert peer.run(lambda: 7) == 7  # the next train() has its own record


def test_a_peer_killed_without_a_word_is_named_as_such_not_as_a_socket_error(store):
    """A peer killed -9 records nothing: the survivor's collective breaks (gloo's socket error) and it says that
    another process ended without a word, how that happens, and where the launcher names it; other errors stay as
    they are."""
    survivor = FailTogether(0, 2, store, exit_process=lambda code: None, poll_seconds=0.01)
    broken = "[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:5005: Connection reset by peer"
    with pytest.raises(PeerProcessFailed, match="another process ended without a word while process 0") as raised:
        survivor.run(lambda: fail(RuntimeError(broken)))
    assert "kill -9" in str(raised.value) and broken in str(raised.value)
    with pytest.raises(RuntimeError, match="^shape mismatch$"):  # not a vanished peer: raised as it is
        survivor.run(lambda: fail(RuntimeError("shape mismatch")))


def test_one_process_or_no_launcher_runs_train_as_is():
    for process in (FailTogether(0, 1, lambda: None), FailTogether(0, 2, None)):
        assert not process.enabled and process.run(lambda: "trained") == "trained"


@pytest.mark.e2e
@pytest.mark.parametrize(
    "fail_in, extra",
    [
        ("reward", ()),
        ("decode", ()),
        ("evaluation", ("eval_strategy=steps", "eval_steps=1", "per_device_eval_batch_size=4")),
        ("engine", ()),
    ],
)
def test_one_process_failing_ends_both_with_its_message(tmp_path, fail_in, extra):
    """Two processes, streaming from the fake engine; one fails at step 2 and stays alive. The other stops with the
    failing one's message and the launcher ends the run, well before any collective timeout. The engine fails on
    the main process; the other process gets its error with the streamed wave."""
    out = tmp_path / "run"
    options = ("rollout_streaming=true", f"fail_in={fail_in}", "hold_failed=true", *extra)
    command = python_command(str(SCRIPTS / "streaming_run.py"), str(out), "4", "3", *options, num_processes=2)
    started = time.monotonic()
    # The warm launcher stops the held process as torch elastic does; the first case runs under elastic itself.
    result = run_unchecked(command, timeout=120, warm=fail_in != "reward")
    assert result.returncode != 0 and time.monotonic() - started < 60, result.stderr[-3000:]
    if fail_in == "engine":
        assert "TimeoutError: the engine did not answer" in (out / "error_rank1.txt").read_text()
        return
    cause = {
        "reward": "ValueError: injected failure in the reward on process 1",
        "evaluation": "ValueError: injected failure in the reward on process 1",
        "decode": "UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff",
    }[fail_in]
    assert cause in (out / "error_rank1.txt").read_text()
    assert f"error: process 0 stops because process 1 failed: {cause}" in result.stderr, result.stderr[-3000:]
    assert not (out / "error_rank0.txt").exists()  # it was stuck in a collective: the watcher ended it
