"""The per-key tier's queries: the ``tier_keys`` table (``server/catalog/schema.py``), as
functions over a ``Catalog`` (reads) or a ``Transaction`` (inside ``Catalog.writing()``).
The tier's service (``Tier``, ``server/resources/tier.py``) is their one caller.

One row per key torch wrote (its own key, as bytes, never rewritten): the digest of the
value in the tier's blob backend, its sizes, when it was written and last read, and who
wrote it (the writer's environment as JSON).

A row's own bytes are part of what the tier keeps: every byte a client makes the server
keep counts in ``remote_cache_max_bytes`` (before issue 32, keys and writer names did not,
and the catalog grew 189 MB under a 1 MiB cap). ``row_bytes`` is the key twice (the table
and its primary-key index), the writer's JSON, and ``ROW_BYTES`` for the other columns,
their two indexes and SQLite's own record overhead.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from cachekeeper.server.catalog import Catalog, Transaction

__all__ = [
    "ROW_BYTES",
    "TierEntry",
    "TierTotals",
    "delete_tier_keys",
    "put_tier_key",
    "tier_key",
    "tier_lru",
    "tier_totals",
    "touch_tier_keys",
    "unreferenced_tier_digests",
]

ROW_BYTES = 300  # digest (twice, indexed), three times (one indexed), sizes, record headers
_ROW_SQL = f"2 * length(key) + length(COALESCE(writer, '')) + {ROW_BYTES}"


@dataclass(frozen=True)
class TierEntry:
    key: bytes
    digest: str
    size_bytes: int  # the value's bytes
    stored_bytes: int  # as the blob backend holds them
    created_at: str
    last_used_at: str
    writer: dict[str, Any]
    row_bytes: int  # the row's own bytes: key, writer (module docstring)


@dataclass(frozen=True)
class TierTotals:
    keys: int
    stored_bytes: int  # the distinct values' stored bytes and every row's own bytes
    row_bytes: int  # the rows' part of it


def _entry(row: Mapping[str, Any]) -> TierEntry:
    return TierEntry(
        key=bytes(row["key"]),
        digest=row["digest"],
        size_bytes=int(row["size_bytes"]),
        stored_bytes=int(row["stored_bytes"]),
        created_at=row["created_at"],
        last_used_at=row["last_used_at"] or row["created_at"],
        writer=json.loads(row["writer"] or "{}"),
        row_bytes=2 * len(row["key"]) + len(row["writer"] or "") + ROW_BYTES,
    )


# -- writes ---------------------------------------------------------------------------


def put_tier_key(
    tx: Transaction,
    *,
    key: bytes,
    digest: str,
    size_bytes: int,
    stored_bytes: int,
    at: str,
    writer: Mapping[str, Any],
) -> str | None:
    """Point ``key`` at ``digest`` (a later write of a key wins); the digest it pointed
    at before, or None."""
    old = tx.one("SELECT digest FROM tier_keys WHERE key = ?", [key])
    tx.db.execute(
        "INSERT INTO tier_keys (key, digest, size_bytes, stored_bytes, created_at,"
        " last_used_at, writer) VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT(key) DO UPDATE SET"
        " digest = excluded.digest, size_bytes = excluded.size_bytes,"
        " stored_bytes = excluded.stored_bytes, created_at = excluded.created_at,"
        " last_used_at = excluded.last_used_at, writer = excluded.writer",
        [
            key,
            digest,
            size_bytes,
            stored_bytes,
            at,
            at,
            json.dumps(dict(writer), sort_keys=True),
        ],
    )
    return None if old is None or old == digest else str(old)


def touch_tier_keys(tx: Transaction, used: Mapping[bytes, str]) -> None:
    """Record the last use of each key (only ever later)."""
    tx.db.conn.executemany(
        "UPDATE tier_keys SET last_used_at = ? WHERE key = ? AND last_used_at < ?",
        [(at, key, at) for key, at in used.items()],
    )


def delete_tier_keys(tx: Transaction, keys: Iterable[bytes]) -> None:
    tx.db.conn.executemany("DELETE FROM tier_keys WHERE key = ?", [(k,) for k in keys])


def unreferenced_tier_digests(tx: Transaction, digests: Iterable[str]) -> list[str]:
    """The ``digests`` no key points at any more (their values may be deleted)."""
    return [
        d
        for d in sorted(set(digests))
        if tx.one("SELECT 1 FROM tier_keys WHERE digest = ? LIMIT 1", [d]) is None
    ]


# -- reads ----------------------------------------------------------------------------


def tier_key(catalog: Catalog, key: bytes) -> TierEntry | None:
    rows = catalog.rows("SELECT * FROM tier_keys WHERE key = ?", [key])
    return _entry(rows[0]) if rows else None


def tier_totals(catalog: Catalog) -> TierTotals:
    row = catalog.rows(
        "SELECT COUNT(*) AS n, COALESCE(SUM(stored_bytes), 0) AS b FROM"
        " (SELECT digest, MAX(stored_bytes) AS stored_bytes FROM tier_keys GROUP BY digest)"
    )[0]
    keys = catalog.rows(f"SELECT COUNT(*) AS n, COALESCE(SUM({_ROW_SQL}), 0) AS r FROM tier_keys")[
        0
    ]
    rows = int(keys["r"])
    return TierTotals(keys=int(keys["n"]), stored_bytes=int(row["b"]) + rows, row_bytes=rows)


def tier_lru(catalog: Catalog, *, limit: int) -> list[TierEntry]:
    """The ``limit`` least recently used keys, oldest first."""
    rows = catalog.rows(
        "SELECT * FROM tier_keys ORDER BY last_used_at, created_at LIMIT ?", [limit]
    )
    return [_entry(r) for r in rows]
