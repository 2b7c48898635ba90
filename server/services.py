"""The services of one server: one per resource, over one catalog and one blob backend.

``Services`` is what the routes reach through ``server/deps.py`` (``ServicesDep``) and what
``server/app.py`` (the composition root) builds once per app: each route calls the service
of its resource (``services.snapshots.publish``, ``services.agents.register``...), and each
service keeps its own queries beside it (``server/resources/``). They share the catalog
(``server/catalog/``: the database and its transactions), the blob backend and its direct
access (asked once, here), and the budgets of the client-written tables
(``server/budgets.py``: one instance, whose counters ``/metrics`` shows).

The per-key tier is not here: it has its own blob backend and is off unless
``resp_port`` is set (``app.state.tier``, ``server/resources/tier.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from cachekeeper.backends.base import BlobBackend

from .budgets import Budgets
from .catalog import Catalog
from .resources.agents import Agents
from .resources.blobs import Blobs
from .resources.fleet import Fleet
from .resources.gc import Collector
from .resources.reports import Reports
from .resources.resolve import Resolver
from .resources.snapshots import Snapshots
from .resources.workloads import Workloads
from .settings import Settings

__all__ = ["Services"]


@dataclass(frozen=True)
class Services:
    """The server's resources, each behind its service (module docstring)."""

    settings: Settings
    catalog: Catalog
    budgets: Budgets
    blobs: Blobs
    snapshots: Snapshots
    resolver: Resolver
    workloads: Workloads
    agents: Agents
    reports: Reports
    fleet: Fleet
    gc: Collector

    @classmethod
    def build(cls, *, settings: Settings, catalog: Catalog, backend: BlobBackend) -> Services:
        """The services over ``catalog`` and ``backend`` (nothing is read or written yet)."""
        direct = backend.direct_access()  # asked once: None for a local directory
        budgets = Budgets(settings)
        snapshots = Snapshots(
            settings=settings, catalog=catalog, backend=backend, direct=direct, budgets=budgets
        )
        return cls(
            settings=settings,
            catalog=catalog,
            budgets=budgets,
            blobs=Blobs(settings=settings, catalog=catalog, backend=backend, direct=direct),
            snapshots=snapshots,
            resolver=Resolver(settings=settings, catalog=catalog, snapshots=snapshots),
            workloads=Workloads(catalog=catalog, budgets=budgets),
            agents=Agents(catalog=catalog, budgets=budgets),
            reports=Reports(catalog=catalog, budgets=budgets),
            fleet=Fleet(settings=settings, catalog=catalog),
            gc=Collector(catalog=catalog, blobs=backend, direct=direct, settings=settings),
        )
