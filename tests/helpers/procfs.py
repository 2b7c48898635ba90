"""What a process holds, read from /proc: its resident memory and its open descriptors.

The hardening tests of the tier's listener measure a real ``serve`` process with these
(``rss_bytes(server.proc.pid)`` before and during an attack), never the test's own.
"""

from __future__ import annotations

import os

__all__ = ["open_fds", "rss_bytes"]


def rss_bytes(pid: int) -> int:
    """The resident set size of ``pid`` now (VmRSS)."""
    with open(f"/proc/{pid}/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    """How many descriptors ``pid`` holds open now."""
    return len(os.listdir(f"/proc/{pid}/fd"))
