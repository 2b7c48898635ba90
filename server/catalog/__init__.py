"""The server's metadata, and ALL of its SQL: one SQLite file (WAL mode) through sqlite-utils.

This package is the catalog layer's one import point (``Catalog``, ``Transaction``,
``agent_id_for``); no module of the server outside it holds SQL:

    server/catalog/database.py    Catalog (connections, transactions) and the snapshot, blob,
                              workload and start-up check queries
    server/catalog/fleet.py   agents, their build events, job reports, the fleet's facts
                              (mixed into Catalog and Transaction)
    server/catalog/tier.py    the per-key tier's key table (mixed in the same way)
    server/catalog/budget.py  what the budgets count and delete (server/budgets.py decides)
    server/catalog/base.py    ``IN (...)`` batches, the Reads/Writes bases
    server/catalog/schema.py  the tables (drawn there), indexes and in-place migrations

The frozen dataclasses the queries return are in ``server/records.py`` (shared with the
resolver, the fleet and storage).
"""

from __future__ import annotations

from .database import Catalog, Transaction, is_corruption
from .fleet import agent_id_for

__all__ = ["Catalog", "Transaction", "agent_id_for", "is_corruption"]
