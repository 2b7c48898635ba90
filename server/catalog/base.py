"""What the catalog's query modules share: ``IN (...)`` batches, and
the two bases their query classes build on (``Reads`` for ``Catalog``, ``Writes`` for
``Transaction``). Part of the catalog layer (the package ``server/catalog/`` is its one
import point).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from typing import Any

import sqlite_utils

__all__ = ["BATCH", "Reads", "Writes", "chunks"]

BATCH = 500  # rows per multi-row statement, well under SQLite's 999 variables


def chunks(items: list[str]) -> Iterator[tuple[list[str], str]]:
    """``items`` in batches with their ``?,?,...`` placeholder text."""
    for start in range(0, len(items), BATCH):
        part = items[start : start + BATCH]
        yield part, ",".join("?" * len(part))


class Reads:
    """Reads outside a write block, on this thread's connection (``Catalog.db``)."""

    def db(self) -> sqlite_utils.Database:
        raise NotImplementedError  # Catalog opens one connection per thread

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Several reads that see one consistent state (a deferred read transaction)."""
        conn = self.db().conn
        if conn.in_transaction:  # already inside writing(): its view is consistent
            yield
            return
        conn.execute("BEGIN")
        try:
            yield
        except BaseException:
            with suppress(sqlite3.Error):  # never hide what went wrong inside
                conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")

    def _rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        return list(self.db().query(sql, list(params)))


class Writes:
    """Writes inside one ``Catalog.writing()`` block, on its connection (``db``), and what
    runs once it committed."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db
        self.after_commit_actions: list[Callable[[], object]] = []

    def after_commit(self, action: Callable[[], object]) -> None:
        """Run ``action`` once this transaction committed, still under the write lock
        (deleting files whose rows it deleted: pointers before blobs)."""
        self.after_commit_actions.append(action)

    def _one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        row = self.db.execute(sql, list(params)).fetchone()
        return None if row is None else row[0]
