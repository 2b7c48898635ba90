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
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cachekeeper.restore.marker import STATE_DIR, state_dir
from cachekeeper.restore.writer import links_above

__all__ = ["SetAside", "plan_set_aside"]


@dataclass(frozen=True)
class SetAside:
    """Which conflicting files a repair moves, and where; nothing moves before ``execute``."""

    cache_dir: Path
    folder: Path  # cache_dir/.cachekeeper/set-aside/<UTC time>
    paths: tuple[str, ...]  # regular files that differ from the snapshot: moved
    kept: tuple[str, ...]  # links, folders, files below a link: left as they are

    def execute(self) -> list[str]:
        """Move each file aside (a rename on the same filesystem); returns those moved.

        A file gone since the plan is skipped; one that cannot be moved raises OSError
        naming it, with the files moved so far already aside (a rerun plans again).
        """
        moved = []
        aside = self.folder.relative_to(self.cache_dir / STATE_DIR).as_posix()
        # Every folder on the way is opened from a descriptor without following a link
        # (marker.StateDir): a link planted in .cachekeeper/ cannot send a file elsewhere.
        with state_dir(self.cache_dir, create=True) as state:
            for rel in self.paths:
                folder, _, name = f"{aside}/{rel}".rpartition("/")
                try:
                    os.rename(self.cache_dir / rel, name, dst_dir_fd=state.folders(folder))
                except FileNotFoundError:
                    continue
                moved.append(rel)
        return moved


def plan_set_aside(cache_dir: Path, conflicts: Iterable[str]) -> SetAside:
    """Plan moving the regular files at ``conflicts`` (a restore's) out of the way."""
    root = Path(cache_dir)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    movable, kept = [], []
    verdicts: dict[str, bool] = {}
    for rel in sorted(set(conflicts)):
        try:
            regular = stat.S_ISREG(os.lstat(root / rel).st_mode)
        except OSError:
            regular = False
        if regular and not links_above(root, rel, verdicts):
            movable.append(rel)
        else:
            kept.append(rel)
    folder = root / STATE_DIR / "set-aside" / stamp
    return SetAside(cache_dir=root, folder=folder, paths=tuple(movable), kept=tuple(kept))
