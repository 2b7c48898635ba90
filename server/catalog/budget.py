"""The catalog's budget queries: how much each client-written table holds, what one token
filed in a window, and the deletes that keep each table within its bound and retention.

The rules (which bound, which retention, what is refused) are ``server/budgets.py``'s; this
module only counts and deletes. Deletes go oldest first (by rowid, the order of insertion,
whatever the clock said) in batches of ``BATCH`` rows, so one pass holds the write lock
for a bounded time. Mixed into ``Transaction`` (``server/catalog/database.py``).
"""

from __future__ import annotations

from .base import BATCH, Writes

__all__ = ["BudgetWrites", "KEPT_EVENTS_SQL"]

# Each (workload, fingerprint digest)'s newest agent event: the status is decided from it,
# so no bound or retention ever removes it.
KEPT_EVENTS_SQL = "SELECT MAX(id) FROM agent_events GROUP BY workload, fingerprint_digest"


class BudgetWrites(Writes):
    """Counts and deletes for the budgets, inside one ``Catalog.writing()`` block."""

    # -- what a table holds ---------------------------------------------------------------
    def usage(self, table: str) -> tuple[int, int]:
        """(rows, bytes) of ``job_reports`` or ``agent_events`` (``table_usage``)."""
        row = self.db.execute("SELECT rows, bytes FROM table_usage WHERE name = ?", [table])
        found = row.fetchone()
        return (0, 0) if found is None else (int(found[0]), int(found[1]))

    def recount_usage(self) -> None:
        """Count ``table_usage`` again where its rows disagree with the table's (start-up: a
        catalog rebuilt by ``sqlite3 .recover`` keeps totals of rows it lost). Counting rows
        reads an index (40 ms for a million reports); summing bytes reads the table (0.6 s),
        so only a table whose count is off is summed."""
        for table in ("job_reports", "agent_events"):
            rows = int(self._one(f"SELECT COUNT(*) FROM {table}"))
            if rows != self.usage(table)[0]:
                self.db.execute(
                    f"UPDATE table_usage SET rows = ?, bytes ="
                    f" (SELECT COALESCE(SUM(size_bytes), 0) FROM {table}) WHERE name = ?",
                    [rows, table],
                )

    def row_count(self, table: str) -> int:
        """Rows of a small table (agents, workloads, snapshots): one pass over its smallest index."""
        return int(self._one(f"SELECT COUNT(*) FROM {table}"))

    def catalog_bytes(self) -> int:
        """The database's size in bytes less its free pages (WAL content included)."""
        page = int(self._one("PRAGMA page_size"))
        return page * (
            int(self._one("PRAGMA page_count")) - int(self._one("PRAGMA freelist_count"))
        )

    def exists(self, table: str, column: str, value: str) -> bool:
        return self._one(f"SELECT 1 FROM {table} WHERE {column} = ?", [value]) is not None

    # -- one token's reports in a window ------------------------------------------------------
    def token_window(self, token_id: str | None, *, since: str) -> list[tuple[str, str]]:
        """(received at, job key) of each report ``token_id`` (None: the anonymous callers
        of a server with auth off) filed at or after ``since``, oldest first. The job key
        is the status's (``node|job``; ``report:<id>`` for a report without a job)."""
        rows = self.db.execute(
            "SELECT at, CASE WHEN job IS NULL THEN 'report:' || id ELSE node || '|' || job END"
            " FROM job_reports WHERE at >= ? AND token_id IS ? ORDER BY at, id",
            [since, token_id],
        )
        return [(str(r[0]), str(r[1])) for r in rows]

    def harvested_count(self, parent: str, *, fingerprint_digest: str) -> int:
        sql = (
            "SELECT COUNT(*) FROM snapshots WHERE parent = ? AND source = 'harvest'"
            " AND fingerprint_digest = ?"
        )
        return int(self._one(sql, [parent, fingerprint_digest]))

    # -- deletes --------------------------------------------------------------------------
    def drop_oldest(self, table: str, *, rows: int, keep_sql: str | None = None) -> int:
        """Delete up to ``rows`` of ``table``'s oldest rows (not those ``keep_sql`` selects
        by id); the number deleted."""
        keep = f" WHERE id NOT IN ({keep_sql})" if keep_sql else ""
        gone = 0
        while gone < rows:
            step = min(BATCH, rows - gone)
            cursor = self.db.execute(
                f"DELETE FROM {table} WHERE id IN (SELECT id FROM {table}{keep}"
                " ORDER BY id LIMIT ?)",
                [step],
            )
            gone += cursor.rowcount
            if cursor.rowcount < step:
                break
        return gone

    def drop_before(
        self, table: str, *, column: str, cutoff: str, limit: int, keep_sql: str | None = None
    ) -> int:
        """Delete up to ``limit`` rows of ``table`` whose ``column`` is before ``cutoff``,
        oldest first (not those ``keep_sql`` selects by rowid); the number deleted. An index
        on ``column`` makes it cost what it deletes, not the table's size."""
        keep = f" AND rowid NOT IN ({keep_sql})" if keep_sql else ""
        cursor = self.db.execute(
            f"DELETE FROM {table} WHERE rowid IN (SELECT rowid FROM {table}"
            f" WHERE {column} < ?{keep} ORDER BY {column} LIMIT ?)",
            [cutoff, limit],
        )
        return int(cursor.rowcount)

    def drop_oldest_bytes(self, table: str, *, over_bytes: int, keep_sql: str | None = None) -> int:
        """Delete ``table``'s oldest rows until ``over_bytes`` of ``size_bytes`` are gone (or
        none is left to delete); the number deleted."""
        keep = f" AND id NOT IN ({keep_sql})" if keep_sql else ""
        gone = 0
        freed = 0
        while freed < over_bytes:
            rows = self.db.execute(
                f"SELECT id, COALESCE(size_bytes, 0) FROM {table} WHERE 1{keep}"
                " ORDER BY id LIMIT ?",
                [BATCH],
            ).fetchall()
            if not rows:
                break
            chosen = []
            for row_id, size in rows:
                chosen.append(row_id)
                freed += int(size)
                if freed >= over_bytes:
                    break
            marks = ",".join("?" * len(chosen))
            gone += self.db.execute(f"DELETE FROM {table} WHERE id IN ({marks})", chosen).rowcount
        return gone
