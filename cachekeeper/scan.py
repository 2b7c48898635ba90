"""Which files of a cache dir a snapshot takes (see ``cachekeeper.snapshot``'s docstring).

Its own module, stdlib only, so that ``cachekeeper postjob`` can list a cache dir without
importing the snapshot stack (archive, signing, zstandard): the hook's start-up budget.
"""

from __future__ import annotations

import os
from pathlib import Path

from cachekeeper.errors import LinkInCacheDir

__all__ = ["is_excluded", "scan_dir"]


def is_excluded(name: str, *, is_dir: bool) -> bool:
    """True for a directory entry name that never enters a snapshot (see module docstring)."""
    if name.startswith("."):
        return True
    if is_dir:
        return name == "locks"
    return name.endswith((".lock", ".tmp", ".partial"))


def scan_dir(root: Path) -> list[tuple[str, Path, int]]:
    """``(relative posix path, absolute path, mode)`` of every file a snapshot takes.

    Raises LinkInCacheDir for a symbolic link, naming it.
    """
    root = Path(root)
    if root.is_symlink():
        raise LinkInCacheDir(f"cache dir {root} is itself a symbolic link")
    if not root.is_dir():
        raise FileNotFoundError(f"cache dir {root} does not exist or is not a directory")
    found: list[tuple[str, Path, int]] = []
    stack: list[tuple[Path, str]] = [(root, "")]
    while stack:
        folder, prefix = stack.pop()
        with os.scandir(folder) as entries:
            for entry in entries:
                rel = prefix + entry.name
                if entry.is_symlink():
                    raise LinkInCacheDir(f"{rel} in {root} is a symbolic link; refusing to follow")
                is_dir = entry.is_dir(follow_symlinks=False)
                if is_excluded(entry.name, is_dir=is_dir):
                    continue
                if is_dir:
                    stack.append((Path(entry.path), rel + "/"))
                elif entry.is_file(follow_symlinks=False):
                    mode = entry.stat(follow_symlinks=False).st_mode & 0o777
                    found.append((rel, Path(entry.path), mode))
    found.sort()
    return found
