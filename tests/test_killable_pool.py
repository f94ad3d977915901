"""`ScoringPool`: hard per-call deadlines in killable workers, from any thread, surviving crashes."""

import os
import threading
import time

import pytest

from dapo_trl.utils import killable_pool as scoring
from dapo_trl.utils.killable_pool import CallResult, default_num_workers
from dapo_trl.utils.killable_pool import KillableProcessPool as ScoringPool


# Calls run in the workers: module-level so that they pickle by name (the workers import this module first).
def double(x: int) -> int:
    return 2 * x


def sleep_then_return(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def crash() -> None:
    os._exit(3)  # a segfault or the OOM killer, as far as the pool can tell


def fail() -> None:
    raise ZeroDivisionError("in the worker")


def unpicklable_result() -> object:
    return lambda: None


@pytest.fixture(scope="module")
def pool():
    with ScoringPool(2, preload=(__name__,)) as pool:
        pool.start()
        yield pool


def test_results_keep_the_order_of_the_calls(pool):
    assert [r.value for r in pool.map(double, [(i,) for i in range(50)], timeout=5)] == [2 * i for i in range(50)]
    assert pool.map(double, [], timeout=5) == []


def test_calls_run_in_parallel(pool):
    started = time.monotonic()
    results = pool.map(sleep_then_return, [(0.5,), (0.5,)], timeout=5)
    assert all(r.ok for r in results)
    assert time.monotonic() - started < 0.95


def test_a_call_past_its_deadline_is_abandoned_and_its_worker_replaced(pool):
    pids_before = {worker.process.pid for worker in pool._workers}
    replaced = pool.replaced_workers
    started = time.monotonic()
    results = pool.map(sleep_then_return, [(60,), (0.01,), (0.01,), (0.01,)], timeout=0.5)
    elapsed = time.monotonic() - started
    assert results[0].timed_out and not results[0].ok and results[0].value is None
    assert 0.5 <= results[0].seconds < 2.0
    assert [r.value for r in results[1:]] == [0.01] * 3  # the other worker went on
    assert elapsed < 2.0
    assert pool.replaced_workers == replaced + 1
    assert len({worker.process.pid for worker in pool._workers} - pids_before) == 1
    assert pool.map(double, [(1,), (2,)], timeout=5)[1].value == 4  # the replacement works


def test_the_deadline_holds_when_called_from_a_worker_thread(pool):
    box: list[list[CallResult]] = []
    thread = threading.Thread(target=lambda: box.append(pool.map(sleep_then_return, [(60,), (0.0,)], timeout=0.5)))
    started = time.monotonic()
    thread.start()
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - started < 2.0
    assert box[0][0].timed_out and box[0][1].value == 0.0


def test_concurrent_callers_take_turns(pool):
    outputs: dict[int, list[int]] = {}

    def call(k: int) -> None:
        outputs[k] = [r.value for r in pool.map(double, [(k,), (k + 1,)], timeout=5)]

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert outputs == {k: [2 * k, 2 * k + 2] for k in range(4)}


def test_crashes_and_exceptions_are_results_not_errors(pool):
    results = pool.map(crash, [()], timeout=5) + pool.map(fail, [()], timeout=5)
    assert results[0].error == "worker died"
    assert results[1].error == "ZeroDivisionError"
    assert pool.map(unpicklable_result, [()], timeout=5)[0].error.startswith("unpicklable result")
    assert pool.map(double, [(lambda: 0,)], timeout=5)[0].error.startswith("unpicklable call")
    assert pool.map(double, [(21,)], timeout=5)[0].value == 42


def test_invalid_use():
    pool = ScoringPool(1)
    pool._owner_pid = -1  # as if this were a forked copy of the pool: its workers belong to another process
    with pytest.raises(RuntimeError, match="forked child"):
        pool.map(double, [(1,)], timeout=1)
    pool._owner_pid = os.getpid()
    with pytest.raises(ValueError, match="timeout must be > 0"):
        pool.map(double, [(1,)], timeout=0)
    pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.map(double, [(1,)], timeout=1)
    with pytest.raises(ValueError, match="num_workers"):
        ScoringPool(0)


def test_default_size_shares_the_cpus_among_the_ranks_of_a_node(monkeypatch):
    monkeypatch.delenv(scoring.WORKERS_ENV, raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    alone = default_num_workers()
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_num_workers() == max(1, alone // 2)
    monkeypatch.setenv(scoring.WORKERS_ENV, "3")
    assert default_num_workers() == 3
    monkeypatch.setenv(scoring.TIMEOUT_ENV, "2.5")
    assert scoring.default_timeout() == 2.5


def test_shared_pool_is_per_process_and_per_settings():
    assert scoring.shared_pool(1) is scoring.shared_pool(1)
    assert scoring.shared_pool(1) is not scoring.shared_pool(2)
