"""Triton's group files, whose absolute child paths must follow a cache to its new root.

Triton writes, next to the kernels of one compilation, a ``__grp__<name>.json`` file::

    {"child_paths": {"kernel.cubin": "/old/root/triton/0/<hash>/kernel.cubin", ...}}

A relocated Triton cache misses unless those paths point into the new root. On restore,
after the original bytes are verified against their digest, every child path is rewritten:
its longest suffix that is a path of the manifest becomes ``<new root>/<that path>``;
paths with no such suffix are left as they were.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

__all__ = ["is_group_path", "rewrite_group", "looks_rewritten"]


def is_group_path(path: str) -> bool:
    """True for a manifest path naming a Triton group file."""
    name = path.rsplit("/", 1)[-1]
    return name.startswith("__grp__") and name.endswith(".json")


def _child_paths(data: bytes) -> tuple[dict[str, Any], dict[str, Any]] | None:
    try:
        doc = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("child_paths"), dict):
        return None
    return doc, doc["child_paths"]


def _relocate(child: Any, paths: Collection[str]) -> str | None:
    """The manifest path that is the longest suffix of ``child``, or None."""
    if not isinstance(child, str) or not child.startswith("/"):
        return None
    parts = child.split("/")
    for i in range(1, len(parts)):
        candidate = "/".join(parts[i:])
        if candidate in paths:
            return candidate
    return None


def rewrite_group(data: bytes, *, paths: Collection[str], root: Path) -> bytes:
    """``data`` with child paths moved under ``root``; unchanged when it is no group file."""
    parsed = _child_paths(data)
    if parsed is None:
        return data
    doc, children = parsed
    base = os.path.abspath(root)
    changed = False
    for name, child in list(children.items()):
        rel = _relocate(child, paths)
        if rel is not None:
            new = os.path.join(base, rel)
            if new != child:
                children[name] = new
                changed = True
    if not changed:
        return data
    return json.dumps(doc).encode()


def looks_rewritten(data: bytes, *, paths: Collection[str], root: Path) -> bool:
    """True for a group file that a restore into ``root`` already rewrote.

    That is: rewriting it again would change nothing, and at least one child path points
    at ``root/<manifest path>``. This is how a re-restore recognises the group file as
    present (its bytes no longer match the original digest, by design).
    """
    parsed = _child_paths(data)
    if parsed is None:
        return False
    base = os.path.abspath(root) + "/"
    inside = any(
        isinstance(child, str) and child.startswith(base) and child[len(base) :] in paths
        for child in parsed[1].values()
    )
    return inside and rewrite_group(data, paths=paths, root=root) == data
