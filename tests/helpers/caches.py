"""A small cache dir for tests that snapshot, push, pull or restore one (stdlib only)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["make_cache"]


def make_cache(root: Path) -> None:
    """A small cache-like dir: a few nested files, one of them large enough to stream."""
    (root / "fxgraph" / "ab" / "key1").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "key1" / "entry").write_bytes(b"graph entry " * 100)
    (root / "cd").mkdir()
    (root / "cd" / "kernel.py").write_text("def kernel():\n    pass\n" * 50)
    (root / "cd" / "kernel.so").write_bytes(os.urandom(3 << 20))
    (root / "aotautograd" / "ef").mkdir(parents=True)
    (root / "aotautograd" / "ef" / "entry").write_bytes(b"aot" * 1000)
