"""The catalog's database: ``Catalog`` (connections, transactions, corruption) and
``Transaction`` (one write). Part of the catalog layer; callers import ``server.catalog``
(the package), whose docstring draws the layer.

No resource's queries are here: each resource keeps its own SQL beside its service
(``server/resources/``), as functions over a ``Catalog`` (reads) or a ``Transaction``
(inside a write), and callers get frozen dataclasses, never row dicts. Each thread gets its
own connection (``check_same_thread=False``, opened lazily); WAL is enabled once by
``Catalog.create``. Every write goes through ``Catalog.writing()``: one real transaction
(``BEGIN IMMEDIATE`` ... ``COMMIT``, ``ROLLBACK`` on any exception) under ``write_lock``,
so writes are serialized in-process, never wait on SQLite's busy timeout, and a
multi-statement operation (publish, delete, pin, GC) is all or nothing: a query function
that takes a ``Transaction`` can only run inside one.

Adding a table: a step appended to ``server/catalog/schema.py``'s list (the catalog's
schema version counts them), and its queries in the module of the resource it holds.

A corrupt catalog is never served as if it were whole. ``Catalog.create`` runs SQLite's
``quick_check`` (every page of every table and index is read and its structure checked;
``integrity_check`` also cross-checks each index against its table, about five times
slower: ``check``) and refuses with ``CatalogCorrupt``, in one line naming the file and the
way back. A page that goes bad while the server runs is met by the first query that reads
it: that query, and every later one, answers 503 ``catalog_corrupt`` (``broken`` is sticky:
SQLite only reports a bad page when it reads it, so "it answered this time" proves nothing
about the next), and ``probe`` (``/healthz``) reads the first and last row of every table,
so a server whose catalog cannot answer stops passing its health check.
"""

from __future__ import annotations

import logging
import random
import sqlite3
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import sqlite_utils

from cachekeeper.errors import CatalogCorrupt, InsufficientStorage

from .schema import check_version, ensure_schema, recount_usage

__all__ = ["BATCH", "Catalog", "Transaction", "chunks", "is_corruption"]

BATCH = 500  # rows per multi-row statement, well under SQLite's 999 variables


def chunks(items: list[str]) -> Iterator[tuple[list[str], str]]:
    """``items`` in batches with their ``?,?,...`` placeholder text."""
    for start in range(0, len(items), BATCH):
        part = items[start : start + BATCH]
        yield part, ",".join("?" * len(part))


_log = logging.getLogger("cachekeeper.server")
PROBE_SAMPLES = 2  # random rows per table each /healthz reads, besides the first and last
_CORRUPT = {sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB}
# What to do about a corrupt catalog: docs/operations.md, "A corrupt catalog".
_WAY_BACK = (
    "stop it, then restore the last backup, or rebuild the file from what SQLite can still"
    " read with the sqlite3 shell's .recover (docs/operations.md, 'A corrupt catalog',"
    " gives the commands)"
)


def is_corruption(exc: BaseException) -> bool:
    """Whether ``exc`` is SQLite saying the file is damaged (a malformed page, not a database)."""
    if not isinstance(exc, sqlite3.DatabaseError):
        return False
    code = getattr(exc, "sqlite_errorcode", None)
    return code in _CORRUPT or "malformed" in str(exc) or "not a database" in str(exc)


def _disk_full(exc: sqlite3.OperationalError) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    return code == sqlite3.SQLITE_FULL or "database or disk is full" in str(exc)


class Transaction:
    """One ``Catalog.writing()`` block: its statements run on ``db`` (reads see its writes)
    and commit together; and what runs once it committed."""

    def __init__(self, db: sqlite_utils.Database) -> None:
        self.db = db
        self.after_commit_actions: list[Callable[[], object]] = []

    def after_commit(self, action: Callable[[], object]) -> None:
        """Run ``action`` once this transaction committed, still under the write lock
        (deleting files whose rows it deleted: pointers before blobs)."""
        self.after_commit_actions.append(action)

    def one(self, sql: str, params: Iterable[Any] = ()) -> Any:
        """The first column of the first row ``sql`` selects, or None."""
        row = self.db.execute(sql, list(params)).fetchone()
        return None if row is None else row[0]


class Catalog:
    """Connections to the metadata database; reads here, writes in ``writing()``."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.write_lock = threading.Lock()
        self._local = threading.local()
        # Why the catalog cannot answer, once a query met a damaged page (sticky).
        self.broken: str | None = None

    @classmethod
    def create(cls, path: Path, *, check: str = "quick") -> Catalog:
        """Open (creating if needed) the database at ``path``, check it (``check``:
        ``quick``, ``full`` or ``off``), enable WAL, run the schema steps past its version
        (``schema.py``). CatalogCorrupt, naming the file and the way back, when SQLite finds
        it damaged; CatalogTooNew, writing nothing, when a newer cachekeeper wrote it."""
        path.parent.mkdir(parents=True, exist_ok=True)
        catalog = cls(path)
        try:
            if check != "off":
                catalog._check(full=check == "full")
            check_version(catalog.db(), name=str(path))  # a newer one's: refused, unwritten
            catalog.db().enable_wal()
            with catalog.writing() as tx:
                found, now = ensure_schema(tx.db, name=str(path))
                recount_usage(tx.db)  # after a restore or a .recover, the triggers' totals
            if found != now:
                new = " (new, or written before versions)" if found == 0 else ""
                _log.info("catalog %s: schema version %d -> %d%s", path, found, now, new)
        except CatalogCorrupt:
            raise
        except sqlite3.DatabaseError as exc:
            if not is_corruption(exc):
                raise
            raise CatalogCorrupt(catalog._refusal(str(exc))) from exc
        return catalog

    def _check(self, *, full: bool) -> None:
        pragma = "integrity_check" if full else "quick_check"
        try:
            found = [str(r[0]) for r in self.db().conn.execute(f"PRAGMA {pragma}(5)")]
        except sqlite3.DatabaseError as exc:  # a page it cannot even walk
            if not is_corruption(exc):
                raise
            found = [str(exc)]
        if found != ["ok"]:
            raise CatalogCorrupt(self._refusal(f"PRAGMA {pragma}: {'; '.join(found)}"))

    def _refusal(self, problem: str) -> str:
        problem = " ".join(problem.split())[:300]
        return (
            f"catalog {self.path} is corrupt ({problem}); the server will not serve it: "
            + _WAY_BACK
        )

    # -- when the catalog cannot answer ------------------------------------------------------
    def met(self, exc: sqlite3.DatabaseError) -> CatalogCorrupt:
        """Mark the catalog broken by ``exc`` (a corruption) and say so to the caller."""
        if self.broken is None:
            self.broken = (
                f"the server's catalog ({self.path.name}) is corrupt: {exc}; the operator"
                " must restore it (docs/operations.md, 'A corrupt catalog')"
            )
            _log.error("%s", self._refusal(f"{exc}, met by a query while serving"))
        return CatalogCorrupt(self.broken)

    # -- reads (a write's are its Transaction's) ---------------------------------------------
    def rows(self, sql: str, params: Iterable[Any] = ()) -> list[dict[str, Any]]:
        """The rows ``sql`` selects, as dicts, on this thread's connection; CatalogCorrupt
        (and the catalog marked broken) when it meets a damaged page."""
        if self.broken is not None:
            raise CatalogCorrupt(self.broken)
        try:
            return list(self.db().query(sql, list(params)))
        except sqlite3.DatabaseError as exc:
            if is_corruption(exc):
                raise self.met(exc) from exc
            raise

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

    def catalog_bytes(self) -> int:
        """The database's size in bytes less its free pages (WAL content included): what
        ``max_catalog_bytes`` bounds."""
        row = self.rows(
            "SELECT (SELECT page_size FROM pragma_page_size()) * ((SELECT page_count FROM"
            " pragma_page_count()) - (SELECT freelist_count FROM pragma_freelist_count())) AS n"
        )[0]
        return int(row["n"])

    def probe(self, *, samples: int = PROBE_SAMPLES) -> str | None:
        """Why the catalog cannot answer now, or None.

        Every table's first and last row are read, and ``samples`` rows at random rowids
        between them: each a root-to-leaf walk, a few pages however big the table (well
        under a millisecond for the whole catalog: docs/operations.md). A damaged page
        among thousands is found by the first query that reads it, which marks the catalog
        broken for every later probe; the random rows make the probes themselves find one
        sooner or later, at no more cost per probe.
        """
        if self.broken is not None:
            return self.broken
        conn = self.db().conn
        try:
            tables = [
                str(r[0])
                for r in conn.execute(
                    "SELECT name FROM sqlite_master WHERE type = 'table'"
                    " AND name NOT LIKE 'sqlite_%'"
                )
            ]
            for table in tables:
                ends = [
                    conn.execute(
                        f'SELECT rowid, * FROM "{table}" ORDER BY rowid{order} LIMIT 1'
                    ).fetchone()
                    for order in ("", " DESC")
                ]
                if ends[0] is None or ends[1] is None:
                    continue
                for _ in range(samples):
                    at = random.randint(int(ends[0][0]), int(ends[1][0]))
                    sql = f'SELECT * FROM "{table}" WHERE rowid >= ? ORDER BY rowid LIMIT 1'
                    conn.execute(sql, [at]).fetchall()
        except sqlite3.DatabaseError as exc:
            if is_corruption(exc):
                return self.met(exc).detail
            return f"the server's catalog ({self.path.name}) cannot answer: {exc}"
        return None

    def db(self) -> sqlite_utils.Database:
        """This thread's connection (opened on first use).

        ``isolation_level=None``: Python's sqlite3 module opens no transaction on its own,
        so the only transactions are the ``BEGIN IMMEDIATE`` of ``writing()``. Inside one,
        sqlite-utils' ``execute`` and ``insert``/``insert_all`` commit nothing themselves
        (they see ``conn.in_transaction`` and use a savepoint); outside, each statement
        commits alone.
        """
        db = getattr(self._local, "db", None)
        if db is None:
            conn = sqlite3.connect(
                self.path, check_same_thread=False, timeout=30.0, isolation_level=None
            )
            conn.execute("PRAGMA synchronous=NORMAL")
            db = sqlite_utils.Database(conn)
            self._local.db = db
        return db

    @contextmanager
    def writing(self) -> Iterator[Transaction]:
        """One write transaction: everything in the block commits together or not at all.

        Holds ``write_lock`` (one writer at a time in this process) and SQLite's write
        lock (``BEGIN IMMEDIATE``) for the block; any exception rolls back the whole block.
        A full disk (SQLITE_FULL) is raised as InsufficientStorage (507), after rollback.
        """
        if self.broken is not None:
            raise CatalogCorrupt(self.broken)
        conn = self.db().conn
        with self.write_lock:
            try:
                conn.execute("BEGIN IMMEDIATE")
                tx = Transaction(self.db())
                try:
                    yield tx
                    conn.execute("COMMIT")
                finally:
                    if conn.in_transaction:  # an exception in the block, or in COMMIT
                        conn.execute("ROLLBACK")
            except sqlite3.DatabaseError as exc:
                if isinstance(exc, sqlite3.OperationalError) and _disk_full(exc):
                    raise InsufficientStorage(
                        f"the server's metadata disk is full ({exc}); nothing was changed"
                    ) from exc
                if is_corruption(exc):
                    raise self.met(exc) from exc
                raise
            for action in tx.after_commit_actions:
                action()
