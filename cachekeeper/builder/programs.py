"""Where a command's program is: one rule for the allowlist that judges it and the run that
starts it (``cachekeeper.builder.allowlist``, ``cachekeeper.builder.commands``).

The allowlist admits a program by its path and ``run_command`` runs the file at that path,
so both find it here, the same way: ``program_path`` for a command's ``argv[0]``,
``canonical`` for a path already absolute (an allowlist entry's program).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["canonical", "program_path"]


def canonical(path: str) -> str:
    """``path`` (absolute) with its folder resolved to its real path and its name kept."""
    head, name = os.path.split(path)
    if name in ("", ".", ".."):
        return os.path.realpath(path)
    return os.path.join(os.path.realpath(head or os.sep), name)


def program_path(argv0: str, *, cwd: Path | str, path: str | None) -> str | None:
    """Where ``argv0`` runs from, as the allowlist judges it and ``run_command`` runs it:
    a bare name found on ``path`` (relative entries from ``cwd``), a relative path from
    ``cwd``; the folder resolved to its real path, the name kept. None when not found."""
    cwd = os.fspath(cwd)
    if os.sep not in argv0:
        entries = (path if path is not None else os.defpath).split(os.pathsep)
        search = os.pathsep.join(os.path.join(cwd, entry or ".") for entry in entries)
        found = shutil.which(argv0, path=search)
        return canonical(found) if found is not None else None
    return canonical(os.path.join(cwd, os.path.expanduser(argv0)))
