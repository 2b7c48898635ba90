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

import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial

from cachekeeper import remote_tier
from cachekeeper.environment.fingerprint import DriverPolicy, Fingerprint, compare
from cachekeeper.errors import did_you_mean
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.settings import Settings
from cachekeeper.server.trust import NodeTrust, Verdicts
from cachekeeper.snapshot.manifest import built_by
from cachekeeper.snapshot.signing import TrustedKey
from cachekeeper.wire import Mismatch, NearMiss, ResolveAnswer, Summary

from .snapshots import SUMMARY_COLUMNS, Snapshots, manifest_text, stored_fingerprint, summary_of
from .workloads import list_workloads

__all__ = [
    "NEAR_MISSES",
    "Candidate",
    "Resolver",
    "Vouch",
    "candidates",
    "harvested_deltas",
    "miss_reason",
    "rank",
    "unknown_workload",
]

NEAR_MISSES = 3
# Why the node's keys do not vouch for a snapshot (a short phrase), or None when they do.
Vouch = Callable[[Summary], str | None]


@dataclass(frozen=True)
class Candidate:
    """A snapshot as resolve compares it: its summary and its full fingerprint."""

    summary: Summary
    fingerprint: Fingerprint
    # The order of publication (SQLite's rowid): newer is larger. Resolve ranks by it, not
    # by ``created_at``, which a server clock that jumped back would turn around.
    seq: int = 0
    built_by: str | None = None  # manifest.built_by of its stats (a cpu mismatch's advice)


class Resolver:
    """Resolve as the routes see it: a node's fingerprint in, the best snapshot out."""

    def __init__(self, *, settings: Settings, catalog: Catalog, snapshots: Snapshots) -> None:
        self.settings = settings
        self.catalog = catalog
        self.snapshots = snapshots
        self._verdicts = Verdicts()  # signature checks for nodes' trusted keys (server/trust.py)

    def node_trust(self, keys: list[TrustedKey]) -> NodeTrust:
        """A node's trust (the public keys it sent), checked against stored manifests."""
        return NodeTrust(
            keys, manifest_text=partial(manifest_text, self.catalog), verdicts=self._verdicts
        )

    def resolve(
        self,
        *,
        fingerprint: Fingerprint,
        workload: str | None,
        driver_policy: DriverPolicy = "newer",
        devices: list[str] | None = None,
        trust: NodeTrust | None = None,
    ) -> ResolveAnswer:
        """The best snapshot for a node (see the module docstring); marks the hit used.

        With ``trust`` (the node's keys), only a snapshot whose signature the server
        checked against one of them ranks, and only such deltas are offered after it.
        """
        found_candidates = candidates(self.catalog, workload)
        found = rank(
            found_candidates,
            fingerprint=fingerprint,
            driver_policy=driver_policy,
            devices=devices,
            vouch=None if trust is None else trust.problem,
            trusted_key_ids=() if trust is None else trust.key_ids,
        )
        if found.snapshot is None:
            unknown = (
                None if found_candidates or workload is None else self.unknown_workload(workload)
            )
            untrusted = any(
                [m.field for m in near.mismatches] == ["signature"] for near in found.near_misses
            )
            reason = miss_reason(
                workload, has_snapshots=bool(found_candidates), unknown=unknown, untrusted=untrusted
            )
            return replace(found, reason=reason)
        self.snapshots.touch(found.snapshot.id)
        hit = found.snapshot
        if trust is not None:
            found = replace(found, signed_by=trust.verdict(hit).key_id)
        url = self.snapshots.archive_url(hit.id)
        if url is not None:
            found = replace(found, archive_url=url)
        if not self.settings.serve_harvested:
            return found
        deltas = harvested_deltas(self.catalog, hit.id, fingerprint_digest=hit.fingerprint_digest)
        if trust is not None:  # offered to a trusting node only when its keys signed them
            deltas = [d for d in deltas if trust.problem(d) is None]
        return replace(found, deltas=tuple(deltas))

    def resolve_for_job(
        self,
        *,
        fingerprint: Fingerprint,
        switches: Mapping[str, str],
        workload: str | None,
        driver_policy: DriverPolicy = "newer",
        devices: list[str] | None = None,
        trust: NodeTrust | None = None,
    ) -> tuple[ResolveAnswer, dict[str, str]]:
        """``resolve`` for a job that will export the per-key tier's ``switches``: ranked
        for the environment the job runs in (``remote_tier.with_key_switches``). A snapshot
        built before the tier was on (without the key-relevant switches) still serves it:
        then the job runs without them. (answer, the switches the job must export)."""
        keyed = remote_tier.key_switches(switches)
        answer = self.resolve(
            fingerprint=remote_tier.with_key_switches(fingerprint, keyed),
            workload=workload,
            driver_policy=driver_policy,
            devices=devices,
            trust=trust,
        )
        if answer.snapshot is not None or not keyed:
            return answer, dict(switches)
        older = self.resolve(
            fingerprint=remote_tier.with_key_switches(fingerprint, {}),
            workload=workload,
            driver_policy=driver_policy,
            devices=devices,
            trust=trust,
        )
        if older.snapshot is None:
            return answer, dict(switches)
        return older, {k: v for k, v in switches.items() if k not in keyed}

    def unknown_workload(self, name: str) -> str | None:
        """Why ``name`` names nothing here, with a did-you-mean; None when it is known."""
        named = bool(candidates(self.catalog, name, limit=1))
        registered = [w.name for w in list_workloads(self.catalog)]
        return unknown_workload(name, registered=registered, named=named)


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


# -- queries: what resolve compares ----------------------------------------------------


def candidates(catalog: Catalog, workload: str | None, *, limit: int = 2000) -> list[Candidate]:
    """Snapshots of a workload with what resolve compares, newest published first."""
    sql = (
        f"SELECT {SUMMARY_COLUMNS}, fingerprint, rowid AS seq, stats FROM snapshots"
        " WHERE workload IS ? AND source IS NULL ORDER BY rowid DESC LIMIT ?"
    )
    parsed: dict[str, Fingerprint] = {}  # one parse per distinct fingerprint
    out = []
    for row in catalog.rows(sql, [workload, limit]):
        fingerprint = parsed.get(row["fingerprint_digest"])
        if fingerprint is None:
            fingerprint = parsed[row["fingerprint_digest"]] = stored_fingerprint(row["fingerprint"])
        out.append(
            Candidate(
                summary=summary_of(row),
                fingerprint=fingerprint,
                seq=row["seq"],
                built_by=built_by(json.loads(row["stats"] or "null")),
            )
        )
    return out


def harvested_deltas(
    catalog: Catalog, parent_id: str, *, fingerprint_digest: str, limit: int = 32
) -> list[Summary]:
    """Summaries of the harvested deltas of ``parent_id`` for one environment, oldest first."""
    rows = catalog.rows(
        f"SELECT {SUMMARY_COLUMNS} FROM snapshots WHERE parent = ? AND source = 'harvest'"
        " AND fingerprint_digest = ? ORDER BY rowid LIMIT ?",
        [parent_id, fingerprint_digest, limit],
    )
    return [summary_of(r) for r in rows]
