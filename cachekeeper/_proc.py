"""Process helpers: whether a process is alive (the restore's and the agent's cleanup of what
dead runs left), and a process's live descendants (the build supervisor, cachekeeper/builder/_supervisor.py)."""

from __future__ import annotations

import os

__all__ = ["pid_alive", "descendants", "process_name"]


def pid_alive(pid: int) -> bool:
    """True when a process with this id exists on this host (ours or another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stat_fields(pid: str) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            raw = stat.read().decode("ascii", "replace")
    except OSError:
        return None
    # pid (comm) state ppid ...: comm may hold spaces and parentheses
    return raw[raw.rfind(")") + 2 :].split()


def descendants(root: int) -> list[int]:
    """``root``'s live descendants (from /proc, zombies left out), children before their
    own children."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = _stat_fields(entry)
        if fields and len(fields) > 1 and fields[1].isdigit() and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    out: list[int] = []
    queue = [root]
    while queue:
        for child in children.get(queue.pop(0), []):
            out.append(child)
            queue.append(child)
    return out


def process_name(pid: int) -> str:
    """A process's command line (first 120 characters), or ``pid N`` once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            words = cmdline.read().split(b"\0")
    except OSError:
        return f"pid {pid}"
    line = " ".join(w.decode("utf-8", "replace") for w in words if w)
    return f"{line[:120]} (pid {pid})" if line else f"pid {pid}"
