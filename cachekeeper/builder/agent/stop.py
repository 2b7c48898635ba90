"""Stopping the agent: SIGTERM/SIGINT set a flag; during a build they abandon it.

Between rounds the agent wakes at once. During a build the signal raises ``AgentStopped``
in the main thread: it unwinds prewarm, whose ``finally`` kills every child process group,
and the push, whose publish is its last request, so no half-pushed snapshot is ever
published.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType

__all__ = ["AgentStopped", "StopSignal"]


class AgentStopped(BaseException):
    """Raised in the main thread by a stop signal to abandon a build or a wait.

    A BaseException, so that no ``except Exception`` on the way up swallows it.
    """


class StopSignal:
    """A stop request: set by SIGTERM/SIGINT (``install``) or by ``set()`` from any thread.

    Inside ``abandonable()`` (main thread), a signal also raises ``AgentStopped`` at once.
    ``set()`` from another thread only stops the agent between workloads and rounds.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._signalled = False  # set by the handler: no locks in a signal handler
        self._depth = 0
        self._raised = False

    def is_set(self) -> bool:
        return self._signalled or self._event.is_set()

    def set(self) -> None:
        self._event.set()

    def install(self) -> None:
        """Handle SIGTERM and SIGINT in this (the main) thread."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True
        # Raise once only: a second signal must not interrupt the unwinding of the first
        # (prewarm's ``finally`` that kills the children).
        if self._depth > 0 and not self._raised:
            self._raised = True
            raise AgentStopped(signal.Signals(signum).name)

    @contextlib.contextmanager
    def abandonable(self) -> Iterator[None]:
        """A block a signal interrupts (raising AgentStopped) instead of waiting for."""
        self._depth += 1
        try:
            if self.is_set():
                raise AgentStopped("stop requested")
            yield
        finally:
            self._depth -= 1

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less if a stop comes (returns, never raises)."""
        try:
            with self.abandonable():
                self._event.wait(seconds)
        except AgentStopped:
            pass
