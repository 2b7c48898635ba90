"""Which snapshots a node's keys vouch for: the server checks every signature itself.

A node with a trust list sends the public keys it trusts with its resolve
(``ResolveRequest.trusted_keys``: the keys themselves, not their ids). For each snapshot
resolve considers, ``NodeTrust.problem`` reads the stored manifest and checks its
signature against the node's key that the manifest's ``key_id`` names
(``cachekeeper.signing.signature_problem``): a claimed key id earns nothing by itself, the
catalog's ``signed`` column (set from what the publisher sent) is never read, and since the
signature covers the manifest's ``stats`` and ``source``, a snapshot's ``verified`` is the
key's claim too (a signed manifest whose verify statistics were changed no longer matches
its signature). A stored manifest that no longer has its snapshot's id (changed on the
server's disk) is refused for that.

Verdicts are kept in a bounded memory shared by every request (``Verdicts``), keyed by
the stored manifest's sha256 (with the row's id and verified flag) and the node's keys: the
same bytes and the same keys always get the same verdict, so a kept verdict never goes stale, and a fleet asking with the same
keys pays one Ed25519 check per snapshot.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cachekeeper.errors import InvalidManifest
from cachekeeper.manifest import Manifest
from cachekeeper.signing import TrustedKey, signature_problem, trusted_key_from_wire
from cachekeeper.wire import Summary

__all__ = ["NodeTrust", "Verdict", "Verdicts", "parse_trusted_keys"]

MAX_VERDICTS = 4096


@dataclass(frozen=True)
class Verdict:
    """What a node's keys make of one stored snapshot."""

    problem: str | None  # why it is not trusted (a short phrase), None when it is
    key_id: str | None = None  # the trusted key whose signature checked out
    verified: bool = False  # the verified claim of the manifest that key signed


class Verdicts:
    """A bounded memory of verdicts, safe to share between request threads."""

    def __init__(self, *, limit: int = MAX_VERDICTS) -> None:
        self._limit = limit
        self._kept: dict[tuple[bytes, bytes], Verdict] = {}
        self._lock = threading.Lock()

    def get(self, key: tuple[bytes, bytes]) -> Verdict | None:
        with self._lock:
            return self._kept.get(key)

    def put(self, key: tuple[bytes, bytes], verdict: Verdict) -> None:
        with self._lock:
            if len(self._kept) >= self._limit:  # forget the older half (insertion order)
                for old in list(self._kept)[: self._limit // 2]:
                    del self._kept[old]
            self._kept[key] = verdict


def parse_trusted_keys(texts: Iterable[str]) -> list[TrustedKey]:
    """The keys a node sent; ValueError names one that is not an Ed25519 public key."""
    return [trusted_key_from_wire(text) for text in texts]


class NodeTrust:
    """One resolve's trust: the node's keys, the stored manifests, the shared verdicts."""

    def __init__(
        self,
        keys: list[TrustedKey],
        *,
        manifest_text: Callable[[str], str | None],
        verdicts: Verdicts,
    ) -> None:
        self.keys = keys
        self.key_ids = tuple(sorted({k.key_id for k in keys}))
        self._keys_memo = b"".join(sorted({k.raw for k in keys}))
        self._manifest_text = manifest_text
        self._verdicts = verdicts

    def problem(self, summary: Summary) -> str | None:
        """Why the node's keys do not vouch for ``summary``'s snapshot; None when they do."""
        return self.verdict(summary).problem

    def verdict(self, summary: Summary) -> Verdict:
        text = self._manifest_text(summary.id)
        if text is None:
            return Verdict(problem="its manifest is not on the server")
        raw = text.encode()
        row = f"{summary.id}:{int(summary.verified)}".encode()
        memo = (hashlib.sha256(raw).digest() + row, self._keys_memo)
        known = self._verdicts.get(memo)
        if known is None:
            known = self._judge(summary, raw)
            self._verdicts.put(memo, known)
        return known

    def _judge(self, summary: Summary, raw: bytes) -> Verdict:
        try:
            manifest = Manifest.from_json(raw)
        except InvalidManifest as exc:
            return Verdict(problem=f"its stored manifest is invalid: {exc.detail}")
        if manifest.id != summary.id:
            return Verdict(
                problem="its stored manifest no longer has its id (changed on the server)"
            )
        problem = signature_problem(manifest, self.keys)
        if problem is not None:
            return Verdict(problem=problem)
        if manifest.verified != summary.verified:
            return Verdict(problem="the catalog's verified flag is not the one its key signed")
        key_id = str((manifest.signature or {}).get("key_id"))
        return Verdict(problem=None, key_id=key_id, verified=manifest.verified)
