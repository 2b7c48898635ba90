"""Resolve: the best snapshot for a node, or a miss with the nearest misses.

Ranking among compatible snapshots: verified before unverified, exact (same driver)
before driver-compatible, newest first. Newest means last published (``Candidate.seq``,
the catalog's order of insertion), never ``created_at``: a server clock that jumped back
would otherwise prefer an older snapshot. Near misses are the incompatible snapshots of the
workload with the fewest mismatching fields (newest first among equals), each with its
field-by-field mismatches so the node can say why it missed. A miss is a value
(``snapshot`` None), never an error, with a ``reason`` (``miss_reason``).

With a node's trust (``vouch``: ``server/trust.py``'s check of the signature against the
keys the node sent), a compatible snapshot ranks only when its signature checks out;
the compatible ones ranked above it that do not (unsigned, signed by another key, changed
after signing) are near misses with one ``signature`` mismatch that says why, and so are
the near misses of other environments that the node's keys do not vouch for. Without
trust, signatures are not looked at (the ranking before issue 32).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from cachekeeper.server.records import Candidate

from cachekeeper.errors import did_you_mean
from cachekeeper.fingerprint import DriverPolicy, Fingerprint, compare
from cachekeeper.wire import Mismatch, NearMiss, ResolveAnswer, Summary

__all__ = ["NEAR_MISSES", "Vouch", "miss_reason", "rank", "unknown_workload"]

NEAR_MISSES = 3
# Why the node's keys do not vouch for a snapshot (a short phrase), or None when they do.
Vouch = Callable[[Summary], str | None]


def rank(
    candidates: Iterable[Candidate],
    *,
    fingerprint: Fingerprint,
    driver_policy: DriverPolicy = "newer",
    devices: list[str] | None = None,
    vouch: Vouch | None = None,
    trusted_key_ids: Sequence[str] = (),
) -> ResolveAnswer:
    """The resolution of ``fingerprint`` among ``candidates`` (see the module docstring).

    ``vouch``: the node's trust (None: signatures are not looked at); ``trusted_key_ids``
    name its keys in a ``signature`` mismatch.

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
            misses.append(((len(mismatches), candidate.seq), summary, mismatches))
    best: tuple[tuple[int, int, int], Summary] | None = None
    for ranked, summary in sorted(hits, key=lambda h: h[0], reverse=True):
        problem = None if vouch is None else vouch(summary)
        if problem is None:
            best = (ranked, summary)
            break
        misses.append(((1, ranked[2]), summary, [_signature(problem, trusted_key_ids)]))
    near = sorted(misses, key=lambda m: (m[0][0], -m[0][1]))[:NEAR_MISSES]
    if vouch is not None:  # other environments' snapshots: say whether the keys vouch too
        for _key, summary, mismatches in near:
            if all(m.field != "signature" for m in mismatches):
                problem = vouch(summary)
                if problem is not None:
                    mismatches.append(_signature(problem, trusted_key_ids))
        near.sort(key=lambda m: (len(m[2]), -m[0][1]))
    near_out = tuple(NearMiss(snapshot=s, mismatches=tuple(mm)) for _k, s, mm in near)
    if best is None:
        return ResolveAnswer(snapshot=None, verified=False, exact=False, near_misses=near_out)
    (verified, exact, _seq), found = best
    return ResolveAnswer(
        snapshot=found, verified=bool(verified), exact=bool(exact), near_misses=near_out
    )


def _signature(problem: str, trusted_key_ids: Sequence[str]) -> Mismatch:
    """The ``signature`` mismatch: the keys the node trusts, and what the snapshot has."""
    return Mismatch(field="signature", node=list(trusted_key_ids), snapshot=problem)


def miss_reason(
    workload: str | None, *, has_snapshots: bool, unknown: str | None, untrusted: bool = False
) -> str:
    """Why nothing was found: the workload is unknown (``unknown``, ``unknown_workload``'s
    sentence), has no snapshot, none matches, or some match (``untrusted``) but the node's
    keys vouch for none of them."""
    name = "no workload name" if workload is None else f"workload {workload!r}"
    if untrusted:
        return (
            f"no snapshot of {name} that matches this node is signed by a key it trusts"
            " (those that match are unsigned, signed by another key, or changed after signing)"
        )
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
