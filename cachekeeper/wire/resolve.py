"""``POST /v1/resolve``: what a node sends, and the answer it restores from (the hook's shapes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from ._core import Check, Digest, DriverPolicy, to_dict

# A node's wish for the per-key tier: "auto" = the server's default (remote_cache_default).
RemoteCacheWish = Literal["auto", "on", "off"]
BuiltBy = Literal["command", "workload"]
# A public key a node trusts: its 32 raw Ed25519 bytes in base64 (signing.TrustedKey.wire).
TrustedKeyText = Annotated[str, Check(pattern=r"^[A-Za-z0-9+/]{43}=$")]
MAX_TRUSTED_KEYS = 64

# -- resolve ----------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Mismatch:
    """One field on which a node and a snapshot's builder differ."""

    field: str
    node: Any = None
    snapshot: Any = None
    # For ``cpu``: how the snapshot's processes got their thread count, so the advice fits
    # the workload ("command": a [[command]]'s launcher; "workload": prewarm's children and
    # [process] omp_num_threads); None when not known (a pushed dir, an older server).
    built_by: BuiltBy | None = None

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


@dataclass(frozen=True, kw_only=True)
class Summary:
    """A stored snapshot as the API lists it (SUMMARY in docs/api.md)."""

    id: Digest
    workload: str | None
    fingerprint_digest: str
    devices: tuple[str, ...]
    verified: bool
    signed: bool
    size_bytes: int
    file_count: int
    created_at: str
    last_used_at: str | None
    pinned: bool
    source: str | None = None  # "harvest" for a harvested delta (postjob --push)
    parent: str | None = None  # a harvested delta's parent snapshot id


@dataclass(frozen=True, kw_only=True)
class ResolveRequest:
    """``POST /v1/resolve``."""

    fingerprint: dict[
        str, Any
    ]  # a cachekeeper.environment.fingerprint.Fingerprint (the route parses it)
    workload: str | None = None
    driver_policy: DriverPolicy = "newer"
    devices: Annotated[list[str], Check(max_length=1024)] | None = None
    # Sent by hooks that export the per-key tier's switches (cachekeeper.remote_tier): the
    # server then ranks snapshots for the environment the job will run in, switches
    # included, and answers ``remote_cache``. None (older hooks): ranked as sent.
    remote_cache: RemoteCacheWish | None = None
    # The public keys this node trusts (``--trust`` / CACHEKEEPER_TRUSTED_KEYS): the server
    # then ranks only snapshots whose signature it checked against one of them; the rest
    # are near misses with a ``signature`` mismatch. None or absent: signatures are not
    # looked at (older hooks, nodes without a trust list). An empty list trusts nothing.
    trusted_keys: Annotated[list[TrustedKeyText], Check(max_length=MAX_TRUSTED_KEYS)] | None = None


@dataclass(frozen=True, kw_only=True)
class RemoteCacheOffer:
    """The per-key tier as a server offers it to one node (``GET /v1/remote-cache``, and
    resolve's ``remote_cache``)."""

    port: int  # the RESP port, on the server's host
    use: bool  # whether this job uses it: the node's wish, else the server's default
    writable: bool  # whether this token's SETs are stored (else answered OK and dropped)
    # torch's switches the job runs with (cachekeeper.remote_tier.site_switches): with
    # ``use``, all of them and the tier's URL; without, only those in torch's keys.
    switches: dict[str, str]
    # Why this token's puts are dropped when ``writable`` is false: "read_only_token" (the
    # token has the read scope) or "signatures_required" (the server trusts signing keys,
    # so its tier is read-only). None when writable (and from old servers).
    write_refusal: str | None = None
    # The server serves the tier over HTTP too (``/v1/tier/...``), for cachekeeper's own
    # remote-cache backend; False from old servers (then only the RESP port).
    http: bool = False
    # The RESP port speaks TLS (the server's ``--tls-cert``): redis-py connects with
    # ``rediss://``.
    tls: bool = False


@dataclass(frozen=True, kw_only=True)
class NearMiss:
    """A snapshot of the workload this node cannot use, and why."""

    snapshot: Summary
    mismatches: tuple[Mismatch, ...]

    @property
    def snapshot_id(self) -> str:
        return self.snapshot.id


@dataclass(frozen=True, kw_only=True)
class ResolveAnswer:
    """The best snapshot for a node, or ``snapshot: None`` (a miss is a value)."""

    snapshot: Summary | None
    verified: bool
    exact: bool
    near_misses: tuple[NearMiss, ...]
    reason: str | None = None  # on a miss, why (one sentence); None on a hit and from old servers
    # On a hit from a server whose blobs are in an object store: a short-lived presigned GET
    # URL of the snapshot's archive (the format of GET /v1/snapshots/{id}/archive). None
    # from a local-dir server and from old servers: the node uses the archive route.
    archive_url: str | None = None
    # Harvested deltas of ``snapshot`` for this environment (oldest first), restored after
    # it; only from a server run with --serve-harvested, else empty.
    deltas: tuple[Summary, ...] = ()
    # The per-key tier, for a request that sent ``remote_cache``; None from a server that
    # serves none (and from old servers).
    remote_cache: RemoteCacheOffer | None = None
    # For a request with ``trusted_keys``: the id of the trusted key whose signature over
    # ``snapshot`` the server checked. None otherwise (and from old servers, which ignore
    # ``trusted_keys``: the node's restore checks the signature again either way).
    signed_by: str | None = None

    @property
    def snapshot_id(self) -> str | None:
        return None if self.snapshot is None else self.snapshot.id
