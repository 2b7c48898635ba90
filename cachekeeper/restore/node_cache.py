"""The hook's per-fingerprint cache dirs on a node: see them, and prune the ones no job uses.

``cachekeeper prejob`` without ``--cache-dir`` (and no ``TORCHINDUCTOR_CACHE_DIR``) restores
into a dir per environment fingerprint, so a torch upgrade starts a new one and the old one
stays behind::

    $CACHEKEEPER_HOME/inductor/
      <fingerprint digest[:16]>/     # one environment's TORCHINDUCTOR_CACHE_DIR
        .cachekeeper/restored/<id>   # what restores left (restore/marker.py)
        .cachekeeper/job.json        # the last job's id and time (client/job_reports.py)

Scan -> plan -> execute, as huggingface_hub's cache manager does: ``scan_node_dirs`` returns
frozen ``NodeDir`` rows, ``plan_prune`` a frozen ``PrunePlan`` with the bytes it frees, and
only ``PrunePlan.execute()`` deletes. Only folders named by 16 hex digits directly under
``<home>/inductor`` are ever considered (what the hook makes), never a link, never the dir
of this node's environment (at any thread count from 1 to the node's CPUs, however it was
set: torchrun's ranks run with ``OMP_NUM_THREADS=1``, a job may set ``MKL_NUM_THREADS`` or
run under ``taskset``; the digest leaves out where a count came from, so one name per
count), and never a dir in use: a process has it as its
``TORCHINDUCTOR_CACHE_DIR`` or holds a file, or its working dir, under it (``/proc``), or a
restore holds its lock. ``execute`` checks "in use" again just before each deletion.

"Last use" is the newest modification time of anything in the dir, the hooks' own files
included (a restore's marker, a job's id, postjob's count); a job that only reads a dir
changes no time there unless its hooks ran.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cachekeeper import config
from cachekeeper.environment import cpu
from cachekeeper.environment.fingerprint import collect, digest_of, with_cpu
from cachekeeper.restore.marker import STATE_DIR, read_markers

__all__ = ["NodeDir", "PrunePlan", "scan_node_dirs", "plan_prune", "node_digests"]

_NAME = re.compile(r"^[0-9a-f]{16}$")


@dataclass(frozen=True)
class NodeDir:
    """One per-fingerprint cache dir, as ``cache ls`` shows it."""

    path: Path
    fingerprint: str  # the fingerprint digest's first 16 characters (the dir's name)
    size_bytes: int
    file_count: int
    last_used_at: datetime | None  # newest mtime in the dir (None: empty)
    snapshot_id: str | None  # the snapshot the newest restore here left its marker for
    matches_node: bool  # this node's environment (at some thread count) uses it
    in_use: str | None  # why it is in use now (a process, the lock), else None
    dev: int = 0  # the folder the scan saw (device, inode): a prune deletes only that one
    ino: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "size_bytes": self.size_bytes,
            "file_count": self.file_count,
            "last_used_at": self.last_used_at.isoformat() if self.last_used_at else None,
            "snapshot_id": self.snapshot_id,
            "matches_node": self.matches_node,
            "in_use": self.in_use,
        }


@dataclass(frozen=True)
class PrunePlan:
    """Which dirs a prune deletes and the bytes that frees; nothing goes before ``execute``."""

    dirs: tuple[NodeDir, ...]
    kept: tuple[tuple[NodeDir, str], ...] = field(default=())  # (dir, why it stays)

    @property
    def bytes_freed(self) -> int:
        return sum(d.size_bytes for d in self.dirs)

    def execute(self) -> list[NodeDir]:
        """Delete each planned dir that is still the folder the scan saw and still not in
        use; returns the ones deleted.

        Deletion is relative to a descriptor of ``<home>/inductor``: the dir's name is
        ``fstatat``-ed there without following a link and must be the scanned folder
        (device and inode), and ``shutil.rmtree`` runs from that descriptor (it opens
        every level with ``O_NOFOLLOW``), so a dir swapped for a link after the plan
        deletes nothing outside it.
        """
        gone = []
        for node_dir in self.dirs:
            try:
                parent_fd = os.open(node_dir.path.parent, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            try:
                name = node_dir.path.name
                try:
                    st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISDIR(st.st_mode) or (st.st_dev, st.st_ino) != (
                    node_dir.dev,
                    node_dir.ino,
                ):
                    continue  # a link, or another folder, since the plan
                if _in_use(node_dir.path, _process_uses()) is not None:
                    continue  # a job started on it since the plan
                try:
                    shutil.rmtree(name, dir_fd=parent_fd)
                except OSError as exc:  # its names are relative to the descriptor: name it
                    where = node_dir.path.parent / os.fsdecode(exc.filename or name)
                    raise OSError(exc.errno, exc.strerror, str(where)) from exc
            finally:
                os.close(parent_fd)
            gone.append(node_dir)
        return gone

    def to_dict(self) -> dict[str, Any]:
        return {
            "dirs_removed": [str(d.path) for d in self.dirs],
            "bytes_freed": self.bytes_freed,
            "kept": [{"path": str(d.path), "why": why} for d, why in self.kept],
        }


def node_digests(environ: Mapping[str, str] | None = None) -> set[str]:
    """The dir names (digest[:16]) this node's environment uses: its fingerprint as the
    shell has it, and at each thread count from 1 to the node's CPUs (a hook run under
    torchrun, in a workload's ``[process]``, with ``MKL_NUM_THREADS`` or under ``taskset``
    fingerprints with one of those; ``os.cpu_count``, not this process's affinity, since a
    prune run under ``taskset`` must not forget the jobs' counts). Before issue 31 the
    digest held where the count came from, and a dir a hook made with ``MKL_NUM_THREADS=1``
    or under ``taskset -c 0`` was "another environment" that prune deleted."""
    fingerprint = collect(environ=os.environ if environ is None else environ)
    names = {digest_of(fingerprint)[:16]}
    state = fingerprint.get("cpu")
    if state is not None:
        cpus = max(len(os.sched_getaffinity(0)), os.cpu_count() or 1)
        for threads in range(1, cpus + 1):
            variant = with_cpu(fingerprint, cpu.with_threads(state, threads))
            names.add(digest_of(variant)[:16])
    return names


def scan_node_dirs(environ: Mapping[str, str] | None = None) -> list[NodeDir]:
    """Every per-fingerprint dir under ``<home>/inductor``, most recently used first."""
    env = os.environ if environ is None else environ
    root = config.home(env) / "inductor"
    try:
        names = sorted(n for n in os.listdir(root) if _NAME.match(n))
    except OSError:
        return []
    ours = node_digests(env)
    uses = _process_uses()
    rows = []
    for name in names:
        path = root / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode):
            continue  # a link or a file: not a dir the hook made
        size, count, newest = _walk(path)
        rows.append(
            NodeDir(
                path=path,
                fingerprint=name,
                size_bytes=size,
                file_count=count,
                last_used_at=datetime.fromtimestamp(newest, UTC) if newest else None,
                snapshot_id=_restored_snapshot(path),
                matches_node=name in ours,
                in_use=_in_use(path, uses),
                dev=st.st_dev,
                ino=st.st_ino,
            )
        )
    epoch = datetime.fromtimestamp(0, UTC)
    rows.sort(key=lambda r: r.last_used_at or epoch, reverse=True)
    return rows


def _restored_snapshot(path: Path) -> str | None:
    """The snapshot the newest restore into ``path`` left its marker for (files changed
    since, or used by a job, still count: this is what was restored there)."""
    for _mtime, body in reversed(read_markers(path)):
        if isinstance(body.get("id"), str):
            return str(body["id"])
    return None


def plan_prune(
    rows: Iterable[NodeDir],
    *,
    older_than_s: float,
    names: Iterable[str] = (),
    now: float | None = None,
) -> PrunePlan:
    """Plan deleting the dirs not used for ``older_than_s`` (or those ``names`` pick, by
    fingerprint prefix or path), keeping this node's environment's and any in use."""
    wanted = [n for n in names if n]
    now = time.time() if now is None else now
    prune, kept = [], []
    for row in rows:
        if wanted and not any(row.fingerprint.startswith(n) or str(row.path) == n for n in wanted):
            continue
        if row.in_use is not None:
            kept.append((row, f"in use: {row.in_use}"))
        elif row.matches_node:
            kept.append((row, "this node's environment uses it"))
        elif not wanted and row.last_used_at and now - row.last_used_at.timestamp() < older_than_s:
            kept.append((row, f"used {_ago(now - row.last_used_at.timestamp())} ago"))
        else:
            prune.append(row)
    return PrunePlan(dirs=tuple(prune), kept=tuple(kept))


def _walk(path: Path) -> tuple[int, int, float]:
    """(bytes, files, newest mtime) of everything under ``path``, links not followed."""
    size = count = 0
    newest = 0.0
    for folder, dirs, files in os.walk(path):
        for name in files + dirs:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            newest = max(newest, st.st_mtime)
            if stat.S_ISREG(st.st_mode):
                size += st.st_size
                count += 1
    return size, count, newest


def _process_uses() -> list[tuple[int, set[str]]]:
    """(pid, real paths it uses: TORCHINDUCTOR_CACHE_DIR, cwd, open files) of every
    process this user may inspect in /proc (others' are not visible: they cannot be told
    apart). Every path is a real path (links resolved), as ``_in_use`` compares them: a
    job that names its dir through a link (a home that is a link) uses the same dir."""
    out: list[tuple[int, set[str]]] = []
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in pids:
        if pid == os.getpid():
            continue
        paths: set[str] = set()
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            paths.add(cwd)
            raw = Path(f"/proc/{pid}/environ").read_bytes()
            for item in raw.split(b"\0"):
                if item.startswith(b"TORCHINDUCTOR_CACHE_DIR="):
                    value = os.fsdecode(item.split(b"=", 1)[1])
                    if value:  # relative to the process's own working dir, not ours
                        paths.add(os.path.realpath(os.path.join(cwd, value)))
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    paths.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:
            continue
        out.append((pid, paths))
    return out


def _in_use(path: Path, uses: list[tuple[int, set[str]]]) -> str | None:
    where = os.path.realpath(path)  # /proc's links and _process_uses' paths are real paths
    for pid, paths in uses:
        for used in paths:
            if used == where or used.startswith(where + os.sep):
                return f"process {pid} uses {used}"
    lock = path / STATE_DIR / "lock"
    try:
        with open(lock, "rb") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f"a restore holds {lock}"
    except OSError:
        pass
    return None


def _ago(seconds: float) -> str:
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h"
    return f"{seconds / 86400:.0f} days"
