"""The workloads resource (``/v1/workloads``): the workload files agents build; its service
``Workloads`` and its queries (the ``workloads`` table).

A workload is registered by name with its TOML text and digest (the route checks the file
and the caller's scope); re-registering identical text changes nothing, not even
``updated_at`` (the fleet status compares a snapshot's workload digest with it). Each
registration is checked against the table's bound in the same transaction as its row
(``server/budgets.py``).
"""

from __future__ import annotations

from cachekeeper.errors import WorkloadNotFound
from cachekeeper.server.budgets import Budgets
from cachekeeper.server.catalog import Catalog, Transaction
from cachekeeper.wire import WorkloadInfo, utc_now

__all__ = ["Workloads", "delete_workload", "list_workloads", "put_workload", "workload_toml"]


class Workloads:
    """The registered workloads as the routes see them."""

    def __init__(self, *, catalog: Catalog, budgets: Budgets) -> None:
        self.catalog = catalog
        self.budgets = budgets

    def list_all(self) -> list[WorkloadInfo]:
        return list_workloads(self.catalog)

    def put(self, *, name: str, toml: str, digest: str) -> WorkloadInfo:
        with self.catalog.writing() as tx:
            self.budgets.admit_workload(tx, name=name)
            return put_workload(tx, name=name, toml=toml, digest=digest)

    def toml(self, name: str) -> str:
        found = workload_toml(self.catalog, name)
        if found is None:
            raise WorkloadNotFound(f"no workload {name!r} is registered")
        return found

    def delete(self, name: str) -> None:
        with self.catalog.writing() as tx:
            if not delete_workload(tx, name):
                raise WorkloadNotFound(f"no workload {name!r} is registered")

    def has(self, name: str) -> bool:
        return workload_toml(self.catalog, name) is not None


# -- queries: the workloads table ------------------------------------------------------


def put_workload(tx: Transaction, *, name: str, toml: str, digest: str) -> WorkloadInfo:
    """Register or replace; ``updated_at`` moves only when the text changes (an identical
    re-registration changes nothing)."""
    tx.db.execute(
        "INSERT INTO workloads (name, toml, digest, updated_at) VALUES (?, ?, ?, ?)"
        " ON CONFLICT(name) DO UPDATE SET toml = excluded.toml,"
        " updated_at = CASE WHEN workloads.digest = excluded.digest"
        " THEN workloads.updated_at ELSE excluded.updated_at END,"
        " digest = excluded.digest",
        [name, toml, digest, utc_now()],
    )
    updated_at = tx.one("SELECT updated_at FROM workloads WHERE name = ?", [name])
    return WorkloadInfo(name=name, digest=digest, updated_at=updated_at)


def delete_workload(tx: Transaction, name: str) -> bool:
    return tx.db.execute("DELETE FROM workloads WHERE name = ?", [name]).rowcount > 0


def workload_toml(catalog: Catalog, name: str) -> str | None:
    found = catalog.rows("SELECT toml FROM workloads WHERE name = ?", [name])
    return str(found[0]["toml"]) if found else None


def list_workloads(catalog: Catalog) -> list[WorkloadInfo]:
    rows = catalog.rows("SELECT name, digest, updated_at FROM workloads ORDER BY name")
    return [
        WorkloadInfo(name=r["name"], digest=r["digest"], updated_at=r["updated_at"]) for r in rows
    ]
