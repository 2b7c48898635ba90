"""Which snapshots a node's keys vouch for: the server checks every signature itself.

A node with a trust list sends the public keys it trusts with its resolve
(``ResolveRequest.trusted_keys``: the keys themselves, not their ids). For each snapshot
resolve considers, ``NodeTrust.problem`` reads the stored manifest and checks its
signature against the node's key that the manifest's ``key_id`` names
(``cachekeeper.snapshot.signing.signature_problem_of``): a claimed key id earns nothing by itself,
and since the signature covers the manifest's ``stats`` and ``source``, a snapshot's
``verified`` is the key's claim too (a signed manifest whose verify statistics were
changed no longer matches its signature). The catalog's ``signed`` column is read only to
refuse at once a snapshot published without a signature; a stored manifest that no longer
has its snapshot's id (changed on the server's disk) is refused for that. The check
parses the stored JSON and makes its canonical form only when a trusted key is named (a
few milliseconds for thousands of files), not a full ``Manifest``: the bytes were
validated at publish, and their sha256 must still be the id.

Verdicts are kept in a bounded memory shared by every request (``Verdicts``), keyed by
the snapshot's row (id, publication time, verified flag) and the node's keys: a signed
snapshot's stored manifest never changes (the catalog only ever adds a signature to an
unsigned one, and an unsigned one is refused without a look; one deleted and published
again is a new row), so a kept verdict never goes stale, and a fleet
asking with the same keys pays one check per snapshot; later requests read no manifest.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from cachekeeper.environment.fingerprint import canonical_json
from cachekeeper.snapshot.manifest import claims_verified
from cachekeeper.snapshot.signing import TrustedKey, signature_problem_of, trusted_key_from_wire
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
        if not summary.signed:  # the server set it from the manifest it took: no signature
            return Verdict(problem="unsigned")
        # A snapshot's stored manifest changes only from unsigned to signed (the one
        # update the catalog makes, Transaction.sign_snapshot), and one deleted and
        # published again is a new row (its created_at): the row names its bytes, so a
        # verdict kept under it never goes stale.
        row = f"{summary.id}:{summary.created_at}:{int(summary.verified)}"
        memo = (row.encode(), self._keys_memo)
        known = self._verdicts.get(memo)
        if known is None:
            text = self._manifest_text(summary.id)
            if text is None:
                return Verdict(problem="its manifest is not on the server")
            known = self._judge(summary, text.encode())
            self._verdicts.put(memo, known)
        return known

    def _judge(self, summary: Summary, raw: bytes) -> Verdict:
        """The stored manifest's signature against the node's keys. It was validated at
        publish; what is signed is its canonical JSON without the signature, the bytes whose
        sha256 is the snapshot's id, so checking that id proves these are those bytes."""
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return Verdict(problem="its stored manifest is not a JSON object")
        signature = body.pop("signature", None)
        signed: list[bytes] = []

        def signed_bytes() -> bytes:  # made only when a trusted key is named
            signed.append(canonical_json(body).encode())
            return signed[0]

        problem = signature_problem_of(signature, signed_bytes, self.keys)
        if signed and hashlib.sha256(signed[0]).hexdigest() != summary.id:
            return Verdict(
                problem="its stored manifest no longer has its id (changed on the server)"
            )
        if problem is not None:
            return Verdict(problem=problem)
        verified = claims_verified(source=body.get("source"), stats=body.get("stats"))
        if verified != summary.verified:
            return Verdict(problem="the catalog's verified flag is not the one its key signed")
        return Verdict(problem=None, key_id=str(signature.get("key_id")), verified=verified)
