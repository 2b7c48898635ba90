"""The verify's judge, from outside: what a cache dir gained, and whether its entries were read.

The processes of a verify report their own cache counters, and a process can say anything
about itself (write its own evidence, end before it wrote any). What it cannot hide is
what happened to the cache dir, which the verify looks at from its own process:

- **gained**: Inductor writes an FX graph entry (``fxgraph/<2>/<key>/<file>``) for every
  cacheable FX miss and an AOTAutograd entry (``aotautograd/<key>/<file>``) for every
  AOTAutograd miss. So a file under either folder that is new, or whose size, mtime or
  inode changed, after the run means a miss, whatever the counters say.
- **read** (``mark_reads``, only on a copy the verify made itself): before the run every
  entry's access time is set to the epoch; a hit reads its entry, which moves the access
  time (``relatime``: an atime older than the mtime is always updated). So after the run
  the entries whose atime moved were read. A filesystem mounted ``noatime`` records no
  reads: a probe file tells, and ``read`` is then None (not measured).

A verify against the user's own dir (device runs) only watches for gains: its atimes are
not ours to reset.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cachekeeper.builder.verdicts import CacheWatch

__all__ = ["ENTRY_FOLDERS", "Watch", "entries_of"]

ENTRY_FOLDERS = ("fxgraph", "aotautograd")
_SHOWN = 20  # gained paths a report keeps


def entries_of(cache_dir: Path) -> dict[str, tuple[int, int, int]]:
    """Every FX graph and AOTAutograd entry file: relative path -> (size, mtime_ns, inode)."""
    found: dict[str, tuple[int, int, int]] = {}
    for folder in ENTRY_FOLDERS:
        root = cache_dir / folder
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                rel = os.path.relpath(path, cache_dir)
                found[rel] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return found


def _records_reads(folder: Path) -> bool:
    """Whether reading a file in ``folder`` moves its access time (not ``noatime``)."""
    probe = folder / f".cachekeeper-atime-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"probe")
        os.utime(probe, ns=(0, probe.stat().st_mtime_ns))
        probe.read_bytes()
        return probe.stat().st_atime_ns > 0
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


@dataclass
class Watch:
    """Started before a run (``Watch.start``), finished after it (``finish``)."""

    cache_dir: Path
    before: dict[str, tuple[int, int, int]]
    marked: bool

    @classmethod
    def start(cls, cache_dir: Path, *, mark_reads: bool) -> Watch:
        """Record the entries; with ``mark_reads`` (a copy the verify owns), reset their
        access times, when this filesystem records reads."""
        cache_dir = Path(cache_dir)
        before = entries_of(cache_dir)
        marked = mark_reads and bool(before) and _records_reads(cache_dir.parent)
        if marked:
            for rel, (_size, mtime_ns, _ino) in before.items():
                try:
                    os.utime(cache_dir / rel, ns=(0, mtime_ns), follow_symlinks=False)
                except OSError:
                    marked = False
                    break
        return cls(cache_dir, before, marked)

    def finish(self) -> CacheWatch:
        after = entries_of(self.cache_dir)
        gained = sorted(rel for rel, facts in after.items() if self.before.get(rel) != facts)
        read = None
        if self.marked:
            read = 0
            for rel in self.before:
                try:
                    if os.lstat(self.cache_dir / rel).st_atime_ns > 0:
                        read += 1
                except OSError:
                    continue
        return CacheWatch(
            entries=len(self.before),
            gained=tuple(gained[:_SHOWN]),
            gained_count=len(gained),
            read=read,
        )
