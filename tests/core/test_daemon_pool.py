"""cachekeeper.daemon_pool: ThreadPoolExecutor's submit/shutdown, with daemon threads."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest

from cachekeeper.daemon_pool import DaemonPool


def test_runs_calls_and_hands_back_results_and_errors() -> None:
    with DaemonPool(3) as pool:
        squares = [pool.submit(lambda n: n * n, n) for n in range(20)]
        failed = pool.submit(lambda: 1 / 0)
        assert [f.result() for f in squares] == [n * n for n in range(20)]
        with pytest.raises(ZeroDivisionError):
            failed.result()
    with pytest.raises(RuntimeError):
        pool.submit(print)


def test_at_most_max_workers_run_at_once() -> None:
    running, most = 0, 0
    lock = threading.Lock()

    def task() -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1

    with DaemonPool(2) as pool:
        for f in [pool.submit(task) for _ in range(10)]:
            f.result()
    assert most == 2


def test_cancel_futures_drops_queued_work() -> None:
    gate = threading.Event()
    pool = DaemonPool(1)
    first = pool.submit(gate.wait)
    queued = pool.submit(lambda: "ran")
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    assert first.result(timeout=5) is True
    assert queued.cancelled()


def test_a_stuck_worker_does_not_keep_the_process_alive() -> None:
    """ThreadPoolExecutor joins its threads at exit; a DaemonPool's are left behind."""
    code = (
        "import time; from cachekeeper.daemon_pool import DaemonPool\n"
        "pool = DaemonPool(2); pool.submit(time.sleep, 60); time.sleep(0.1)\n"
    )
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], timeout=30)
    assert proc.returncode == 0
    assert time.monotonic() - started < 10
