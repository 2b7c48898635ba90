"""The environment fingerprint, by its public import path (docs/python-api.md).

``collect()`` (this machine's fingerprint, without importing torch), ``parse(raw)``,
``digest_of(fp)``, ``compare(node, snapshot, ...)``, ``with_cpu(fp, state)`` and the
``Fingerprint`` / ``Gpu`` / ``CpuState`` TypedDicts. The fingerprint is the environment's
(``cachekeeper.environment.fingerprint``, which says why it is what it is); this module
keeps the names a user's script imports.
"""

from __future__ import annotations

from cachekeeper.environment.fingerprint import (
    PROVENANCE,
    SCHEMA,
    CpuState,
    DriverPolicy,
    Fingerprint,
    Gpu,
    Mismatch,
    canonical_json,
    collect,
    compare,
    digest_of,
    format_mismatches,
    identity,
    is_compatible,
    json_digest,
    parse,
    unchecked,
    with_cpu,
)

__all__ = [
    "SCHEMA",
    "CpuState",
    "DriverPolicy",
    "Fingerprint",
    "Gpu",
    "Mismatch",
    "collect",
    "canonical_json",
    "digest_of",
    "identity",
    "json_digest",
    "PROVENANCE",
    "compare",
    "is_compatible",
    "format_mismatches",
    "parse",
    "unchecked",
    "with_cpu",
]
