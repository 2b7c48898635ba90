"""A small Triton cache on disk for restore tests: one kernel folder and its group file,
whose child paths (absolute, as Triton writes them) a restore rewrites to the new root."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["make_triton_cache"]


def make_triton_cache(root: Path, *, outside_child: str | None = None) -> dict[str, str]:
    """``root/triton/0/HASH/`` with ``k.cubin``, ``k.json`` and ``__grp__k.json`` naming
    both (plus a child ``elsewhere`` at ``outside_child``, when given); the group's children."""
    folder = root / "triton" / "0" / "HASH"
    folder.mkdir(parents=True)
    children = {}
    for name in ("k.cubin", "k.json"):
        (folder / name).write_bytes(b"kernel " + name.encode())
        children[name] = str((folder / name).absolute())
    if outside_child is not None:
        children["elsewhere"] = outside_child
    (folder / "__grp__k.json").write_text(json.dumps({"child_paths": children}))
    return children
