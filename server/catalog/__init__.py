"""The server's metadata database: one SQLite file (WAL mode) through sqlite-utils.

This package is the catalog layer's one import point (``Catalog``, ``Transaction``,
``chunks``, ``agent_id_for``). It holds the database, not the queries: each resource keeps
its own SQL beside its service (``server/resources/``), as functions over a ``Catalog``
(reads) or a ``Transaction`` (inside ``Catalog.writing()``), and the budgets keep theirs
in ``server/budgets.py``.

    server/catalog/database.py  Catalog (connections, transactions, a corrupt file met and
                                refused) and Transaction (one write); ``IN (...)`` batches
    server/catalog/schema.py    the tables (drawn there), indexes and the steps of the
                                schema's versions; the agents table's key; start-up upkeep
"""

from __future__ import annotations

from .database import BATCH, Catalog, Transaction, chunks, is_corruption
from .schema import agent_id_for

__all__ = ["BATCH", "Catalog", "Transaction", "agent_id_for", "chunks", "is_corruption"]
