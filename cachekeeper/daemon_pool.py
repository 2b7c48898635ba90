"""A thread pool whose threads never hold the process open: ``DaemonPool``.

``concurrent.futures.ThreadPoolExecutor`` joins its threads when the interpreter exits, so
one worker blocked on an object store that trickles bytes, or on a hung filesystem, keeps
the process alive past any deadline. The pre-job hook promises to end in time (``prejob
--timeout T`` ends within T + 1 s), so the pools that run inside it (the object store's
ranged reads, the restore's writers) use this one instead: the same ``submit`` and
``shutdown``, with daemon threads. A worker abandoned at exit is stopped mid-task; the
restore rules make that harmless (only complete, verified files ever become visible).

Stdlib only: the hook imports it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

__all__ = ["DaemonPool"]

T = TypeVar("T")
_Work = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


class DaemonPool:
    """At most ``max_workers`` daemon threads running submitted calls in order."""

    def __init__(self, max_workers: int, *, name: str = "ck-pool") -> None:
        if max_workers < 1:
            raise ValueError("max_workers must be at least 1")
        self._max_workers = max_workers
        self._name = name
        self._work: queue.SimpleQueue[_Work | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._idle = 0
        self._closed = False

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        future: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("cannot submit to a pool that was shut down")
            self._work.put((future, fn, args, kwargs))
            if self._idle == 0 and len(self._threads) < self._max_workers:
                thread = threading.Thread(
                    target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
            else:
                self._idle = max(0, self._idle - 1)
        return future

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            future, fn, args, kwargs = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)
                del future, fn, args, kwargs
            with self._lock:
                self._idle += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """No more work; with ``cancel_futures`` queued calls are cancelled; with ``wait``,
        return once every thread finished what it runs."""
        with self._lock:
            self._closed = True
            threads = list(self._threads)
        if cancel_futures:
            while True:
                try:
                    item = self._work.get_nowait()
                except queue.Empty:
                    break
                if item is not None:
                    item[0].cancel()
        for _ in threads:
            self._work.put(None)
        if wait:
            for thread in threads:
                thread.join()

    def __enter__(self) -> DaemonPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown(wait=True)
