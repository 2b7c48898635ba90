"""Damage one page of a real SQLite file, for tests of a corrupt catalog.

    pages = leaf_pages(db_path, "job_reports")     # the table's b-tree leaves, in key order
    smash_page(db_path, pages[len(pages) // 2])    # garbage over one of them

``leaf_pages`` reads SQLite's own ``dbstat`` table (compiled into the sqlite3 module that
CPython ships here; a build without it fails the test, never skips it). ``smash_page``
writes seeded random bytes over the whole page in the main database file: run it on a
checkpointed file (``checkpoint``), or the WAL may still hold a good copy of the page.
"""

from __future__ import annotations

import random
import sqlite3
from pathlib import Path

__all__ = ["checkpoint", "leaf_pages", "smash_page"]


def checkpoint(path: Path) -> None:
    """Move everything in the WAL into the main file and truncate the WAL."""
    conn = sqlite3.connect(path)
    try:
        busy, _log, _done = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        assert busy == 0, f"{path}: the checkpoint was blocked by a reader"
    finally:
        conn.close()


def leaf_pages(path: Path, table: str) -> list[int]:
    """The page numbers of ``table``'s b-tree leaves, in key order."""
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute(
            "SELECT pageno FROM dbstat WHERE name = ? AND pagetype = 'leaf' ORDER BY path",
            [table],
        ).fetchall()
    finally:
        conn.close()
    return [int(r[0]) for r in rows]


def smash_page(path: Path, page: int, *, seed: int = 32) -> None:
    """Write random bytes over page ``page`` (1-based) of the database at ``path``."""
    conn = sqlite3.connect(path)
    try:
        size = int(conn.execute("PRAGMA page_size").fetchone()[0])
    finally:
        conn.close()
    garbage = random.Random(seed).randbytes(size)
    with open(path, "r+b") as fh:
        fh.seek((page - 1) * size)
        fh.write(garbage)
        fh.flush()
