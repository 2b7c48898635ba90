"""Resolve: the best snapshot for a node, or a miss with the nearest misses.

Ranking among compatible snapshots: verified before unverified, exact (same driver)
before driver-compatible, newest first. Newest means last published (``Candidate.seq``,
the catalog's order of insertion), never ``created_at``: a server clock that jumped back
would otherwise prefer an older snapshot. Near misses are the incompatible snapshots of the
workload with the fewest mismatching fields (newest first among equals), each with its
field-by-field mismatches so the node can say why it missed. A miss is a value
(``snapshot`` None), never an error, with a ``reason`` (``miss_reason``).
"""

from __future__ import annotations

from collections.abc import Iterable

from cachekeeper.errors import did_you_mean
from cachekeeper.fingerprint import DriverPolicy, Fingerprint, compare
from cachekeeper.wire import Mismatch, NearMiss, ResolveAnswer, Summary

from .records import Candidate

__all__ = ["NEAR_MISSES", "miss_reason", "rank", "unknown_workload"]

NEAR_MISSES = 3


def rank(
    candidates: Iterable[Candidate],
    *,
    fingerprint: Fingerprint,
    driver_policy: DriverPolicy = "newer",
    devices: list[str] | None = None,
) -> ResolveAnswer:
    """The resolution of ``fingerprint`` among ``candidates`` (see the module docstring).

    Raises TypeError, ValueError or AttributeError when a stored fingerprint cannot be
    compared (a row an older server took, checked then only as a JSON object).
    """
    hits: list[tuple[tuple[int, int, int], Summary]] = []
    misses: list[tuple[tuple[int, int], Summary, list[Mismatch]]] = []
    for candidate in candidates:
        summary = candidate.summary
        mismatches = compare(
            fingerprint,
            candidate.fingerprint,
            driver_policy=driver_policy,
            devices=list(summary.devices) or None,
            node_devices=devices,
            built_by=candidate.built_by,
        )
        if not mismatches:
            same_driver = fingerprint.get("driver") == candidate.fingerprint.get("driver")
            hits.append(((int(summary.verified), int(same_driver), candidate.seq), summary))
        else:
            key = (len(mismatches), candidate.seq)
            misses.append((key, summary, mismatches))
    near = sorted(misses, key=lambda m: (m[0][0], -m[0][1]))[:NEAR_MISSES]
    near_out = tuple(NearMiss(snapshot=s, mismatches=tuple(mm)) for _k, s, mm in near)
    if not hits:
        return ResolveAnswer(snapshot=None, verified=False, exact=False, near_misses=near_out)
    (verified, exact, _seq), best = max(hits, key=lambda h: h[0])
    return ResolveAnswer(
        snapshot=best, verified=bool(verified), exact=bool(exact), near_misses=near_out
    )


def miss_reason(workload: str | None, *, has_snapshots: bool, unknown: str | None) -> str:
    """Why nothing was found: the workload is unknown (``unknown``, ``unknown_workload``'s
    sentence), has no snapshot, or none matches."""
    name = "no workload name" if workload is None else f"workload {workload!r}"
    if has_snapshots:
        return f"no snapshot of {name} matches this node"
    return unknown or f"{name} has no snapshot yet"


def unknown_workload(workload: str, *, registered: list[str], named: bool) -> str | None:
    """``no workload 'x' is registered on this server (did you mean 'y'?), and no snapshot
    names it``, or None when ``workload`` is registered or a snapshot names it (``named``)."""
    if named or workload in registered:
        return None
    hint = did_you_mean(workload, registered)
    return f"no workload {workload!r} is registered on this server{hint}, and no snapshot names it"
