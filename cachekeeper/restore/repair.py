"""Repairing a cache dir against a snapshot: set aside what differs, then restore it.

A restore never overwrites (the restore rules): a file at a snapshot path whose bytes differ
from the manifest's (a corrupt entry, or someone's own version) is kept and reported as a
conflict, and the entry keeps missing. ``cachekeeper restore SNAPSHOT --repair`` first asks
the restore itself which paths conflict (a dry run: the restore's own classification, Triton
group files included), moves each of those that is a regular file, with no link above it,
to a folder of its own, and then restores, which writes the verified bytes in their place.
Nothing is deleted: the old files stay, as they were, in::

    cache_dir/.cachekeeper/set-aside/<UTC time>/<path>

A link, a folder or anything else at a snapshot path is left where it is (a restore never
writes through what it did not create), and stays a conflict. Scan -> plan -> execute, as
the stores do: ``plan_set_aside`` touches nothing, ``SetAside.execute`` moves.

Between the plan and the move, the dir may change under our feet (another local user who
can write there swaps a folder for a link, hoping the move takes a file from elsewhere).
So ``execute`` moves relative to descriptors: each folder from the cache dir down is
opened with ``O_NOFOLLOW | O_DIRECTORY``, the file is ``fstatat``-ed in its folder without
following a link, and only the very file the plan saw (device and inode) is renamed, from
that folder's descriptor into the set-aside folder's. Anything else stays where it is.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cachekeeper.restore.marker import STATE_DIR, state_dir
from cachekeeper.restore.writer import links_above

__all__ = ["SetAside", "plan_set_aside"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class SetAside:
    """Which conflicting files a repair moves, and where; nothing moves before ``execute``."""

    cache_dir: Path
    folder: Path  # cache_dir/.cachekeeper/set-aside/<UTC time>
    paths: tuple[str, ...]  # regular files that differ from the snapshot: moved
    kept: tuple[str, ...]  # links, folders, files below a link: left as they are
    identities: tuple[tuple[int, int], ...] = ()  # (device, inode) of each of ``paths``

    def execute(self) -> list[str]:
        """Move each file aside (a rename on the same filesystem); returns those moved.

        A file gone since the plan, or no longer the one it saw (another file, a link, a
        link or a file above it), is left where it is; one that cannot be moved raises
        OSError naming it, with the files moved so far already aside (a rerun plans again).
        """
        moved = []
        aside = self.folder.relative_to(self.cache_dir / STATE_DIR).as_posix()
        identities = dict(zip(self.paths, self.identities, strict=True))
        # Every folder on the way is opened from a descriptor without following a link,
        # on both sides: the cache dir's (_Walk) and .cachekeeper's (marker.StateDir).
        with state_dir(self.cache_dir, create=True) as state, _Walk(self.cache_dir) as walk:
            for rel in self.paths:
                source = walk.folder_of(rel)
                if source is None:
                    continue  # a link or a file above it now: not what the plan saw
                src_fd, name = source
                try:
                    st = os.stat(name, dir_fd=src_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != identities[rel]:
                    continue  # replaced since the plan: the restore reports it, as it is
                folder, _, aside_name = f"{aside}/{rel}".rpartition("/")
                try:
                    os.rename(name, aside_name, src_dir_fd=src_fd, dst_dir_fd=state.folders(folder))
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise OSError(exc.errno, exc.strerror, str(self.cache_dir / rel)) from exc
                moved.append(rel)
        return moved


class _Walk:
    """Folders of a cache dir, each opened from its parent's descriptor without following
    a link (one walk per folder, kept open until ``close``)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.root_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self._fds: dict[str, int | None] = {"": self.root_fd}

    def folder_of(self, rel: str) -> tuple[int, str] | None:
        """(descriptor of the folder holding ``rel``, its name), or None past a link."""
        folder, _, name = rel.rpartition("/")
        fd = self._open(folder)
        return None if fd is None else (fd, name)

    def _open(self, rel_dir: str) -> int | None:
        if rel_dir in self._fds:
            return self._fds[rel_dir]
        parent, _, name = rel_dir.rpartition("/")
        parent_fd = self._open(parent)
        fd = None
        if parent_fd is not None:
            try:
                fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
                    raise OSError(exc.errno, exc.strerror, str(self.root / rel_dir)) from exc
        self._fds[rel_dir] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            if fd is not None:
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> _Walk:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def plan_set_aside(cache_dir: Path, conflicts: Iterable[str]) -> SetAside:
    """Plan moving the regular files at ``conflicts`` (a restore's) out of the way."""
    root = Path(cache_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    movable, kept, identities = [], [], []
    verdicts: dict[str, bool] = {}
    for rel in sorted(set(conflicts)):
        try:
            st = os.lstat(root / rel)
        except OSError:
            st = None
        if st is not None and stat.S_ISREG(st.st_mode) and not links_above(root, rel, verdicts):
            movable.append(rel)
            identities.append((st.st_dev, st.st_ino))
        else:
            kept.append(rel)
    folder = root / STATE_DIR / "set-aside" / stamp
    return SetAside(
        cache_dir=root,
        folder=folder,
        paths=tuple(movable),
        kept=tuple(kept),
        identities=tuple(identities),
    )
