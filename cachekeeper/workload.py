"""Workload files, by their public import path (docs/python-api.md).

``load_workload(path)`` / ``parse_workload(text, source=...)`` return a ``Workload``, or
raise ``WorkloadInvalid`` naming the field. The parser is the builder's
(``cachekeeper.builder.workload``); this module keeps the name a user's script imports.
"""

from __future__ import annotations

from cachekeeper.builder.workload import LIMITS, Workload, load_workload, parse_workload

__all__ = ["LIMITS", "Workload", "load_workload", "parse_workload"]
