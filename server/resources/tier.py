"""The per-key tier's service: torch's own cache keys, each naming one value in a blob backend.

``Tier`` is what the protocol server (``server/resp/listener.py``) calls; it never sees SQL or
a backend type. A value is stored in the tier's ``BlobBackend`` by the sha256 of its bytes
(``<data>/tier-blobs`` beside the snapshots' ``<data>/blobs``, or ``PREFIX/tier/`` of the
object store: ``server/app.py`` picks it), and its key in the catalog's ``tier_keys``
table (``server/resources/tier_keys.py``) with its sizes, last use and writer. Keys are torch's
own (they already hash torch, Triton, CUDA, the GPU and the graph): never rewritten.

Bounds: a value over ``remote_cache_max_value_bytes`` is not stored; after each put the
least recently used keys are evicted until what the tier keeps fits in
``remote_cache_max_bytes`` (as bazel-remote bounds its cache): the distinct values' stored
bytes and each key's row, its key and writer included (``server/resources/tier_keys.py``), since
every byte a client makes the server keep counts. Last uses are kept in
memory and written in batches (``flush_uses``), so a GET never writes to the catalog.

Hot values: the most recently used values, up to ``remote_cache_memory_bytes``, are kept
in memory by digest once read back and checked (or once put: their digest is computed
from the bytes), so a GET of a hot value costs a catalog look-up and a copy, not a read,
a decompression and a hash (measured on the H200 host: 25 ms of server CPU for a 5.3 MB
value without it). Only this process writes the tier (one server per data dir), so
a value is dropped from memory when its blob is deleted.

``TierWriter`` is the one thread that stores the values the listener accepted (a SET is
answered before its value is stored), within a budget of bytes waiting, and writes the
last uses every two seconds.

Ordering rules that keep a crash harmless: a value becomes visible (the backend's atomic
put) before its key row points at it; eviction deletes rows first, then, after the
commit, only values no key points at any more. A row whose value is gone reads as a miss
and is dropped.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from cachekeeper import remote_tier
from cachekeeper.backends.base import BlobBackend
from cachekeeper.errors import BlobMissing
from cachekeeper.integrity import digest_of
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.metrics import Metrics
from cachekeeper.server.settings import Settings
from cachekeeper.wire import RemoteCacheOffer, utc_now

from .tier_keys import (
    TierEntry,
    delete_tier_keys,
    put_tier_key,
    tier_key,
    tier_lru,
    tier_totals,
    touch_tier_keys,
    unreferenced_tier_digests,
)

__all__ = [
    "EVICT_BATCH",
    "TierPut",
    "Tier",
    "TierSummary",
    "TierWriter",
    "offer_for",
    "queued_bytes",
    "summary",
]

_log = logging.getLogger("cachekeeper.server.tier")
_FLUSH_EVERY_S = 2.0

EVICT_BATCH = 256  # keys looked at per eviction query
QUEUED_OVERHEAD_BYTES = 1024  # a queued SET's Python objects besides its key and value


def queued_bytes(key: bytes, size_bytes: int) -> int:
    """What a SET of ``size_bytes`` under ``key`` costs ``TierWriter``'s budget."""
    return len(key) + size_bytes + QUEUED_OVERHEAD_BYTES


def offer_for(
    settings: Settings, *, port: int | None, scope: str, wish: str | None
) -> RemoteCacheOffer | None:
    """The tier as offered to a caller with ``scope`` whose hook wishes ``wish`` ("auto",
    "on", "off"); None when this server serves no tier (``port`` None)."""
    if port is None:
        return None
    use = settings.remote_cache_default if wish in (None, "auto") else wish == "on"
    switches = remote_tier.site_switches(tier=True)
    refusal = None
    if scope not in ("write", "admin"):
        refusal = "read_only_token"
    elif not settings.remote_cache_writable:
        refusal = "signatures_required"
    return RemoteCacheOffer(
        port=port,
        use=use,
        writable=refusal is None,
        switches=switches if use else remote_tier.key_switches(switches),
        write_refusal=refusal,
        http=True,
        tls=settings.tls_cert is not None,
    )


@dataclass(frozen=True)
class TierSummary:
    """The tier as the status page shows it: its size, and its counters since start."""

    port: int | None
    keys: int
    stored_bytes: int
    max_bytes: int | None
    hits: int
    misses: int  # every GET answered nil: not there, past the bound, a failing store
    puts_stored: int
    puts_dropped: dict[str, int]  # why -> how many (answered OK, not stored)
    evictions: int
    writable: bool


_DROPS = (
    "read_only_token",
    "signatures_required",
    "key_too_long",
    "too_large",
    "busy",
    "store_failed",
)


def summary(store: Tier, metrics: Metrics, settings: Settings, *, port: int | None) -> TierSummary:
    """The status page's view of the tier, from the tier and the ``/metrics`` counters."""
    keys, stored = store.totals()

    def count(name: str, **labels: str) -> int:
        return int(metrics.value(f"cachekeeper_remote_cache_{name}", **labels))

    return TierSummary(
        port=port,
        keys=keys,
        stored_bytes=stored,
        max_bytes=settings.remote_cache_max_bytes,
        hits=count("gets_total", result="hit"),
        misses=sum(count("gets_total", result=r) for r in ("miss", "slow", "failed", "busy")),
        puts_stored=count("puts_total", result="stored"),
        puts_dropped={r: n for r in _DROPS if (n := count("puts_total", result=r))},
        evictions=count("evictions_total"),
        writable=settings.remote_cache_writable,
    )


@dataclass(frozen=True)
class TierPut:
    """What one put did: ``stored`` (False: dropped, ``reason`` says why) and evictions."""

    stored: bool
    reason: str | None = None  # "too_large"
    evicted: int = 0
    stored_bytes: int = 0


class _HotValues:
    """Checked values by digest, least recently used first out, within ``limit`` bytes."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._values: collections.OrderedDict[str, bytes] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, digest: str) -> bytes | None:
        with self._lock:
            value = self._values.get(digest)
            if value is not None:
                self._values.move_to_end(digest)
            return value

    def add(self, digest: str, value: bytes) -> None:
        if len(value) > self.limit:
            return
        with self._lock:
            if digest in self._values:
                self._values.move_to_end(digest)
                return
            self._values[digest] = value
            self._bytes += len(value)
            while self._bytes > self.limit:
                _old, dropped = self._values.popitem(last=False)
                self._bytes -= len(dropped)

    def drop(self, digests: list[str]) -> None:
        with self._lock:
            for digest in digests:
                value = self._values.pop(digest, None)
                if value is not None:
                    self._bytes -= len(value)


class Tier:
    """Keys in the catalog, values in a blob backend; thread-safe."""

    def __init__(
        self,
        *,
        catalog: Catalog,
        blobs: BlobBackend,
        max_value_bytes: int,
        max_bytes: int | None,
        memory_bytes: int = 0,
        cross_environment: bool = False,
    ) -> None:
        self.catalog = catalog
        self.cross_environment = cross_environment
        self.blobs = blobs
        self.max_value_bytes = max_value_bytes
        self.max_bytes = max_bytes
        self._hot = _HotValues(memory_bytes)
        self._uses: dict[bytes, str] = {}
        self._uses_lock = threading.Lock()
        self.evictions = 0  # keys evicted since start (for /metrics)

    def get(
        self,
        key: bytes,
        *,
        environment: str | None = None,
        reserve: Callable[[int], bool] | None = None,
    ) -> bytes | None:
        """The value stored under ``key``, or None (a miss is a value); with
        ``environment``, only a value written from it (``fetch``)."""
        return self.fetch(key, environment=environment, reserve=reserve)[0]

    def fetch(
        self,
        key: bytes,
        *,
        environment: str | None,
        reserve: Callable[[int], bool] | None = None,
    ) -> tuple[bytes | None, str]:
        """(the value under ``key`` or None, why: ``hit``, ``miss``, ``busy`` or
        ``other_environment``). ``environment`` (the reader's, None: any) must be the
        writer's unless ``cross_environment``. ``reserve(size)`` is asked before a value
        not held in memory is read into it; False: not read (``busy``)."""
        entry, why = self.lookup(key, environment=environment)
        if entry is None:
            return None, why
        value = self._hot.get(entry.digest)
        if value is None:
            if reserve is not None and not reserve(entry.size_bytes):
                return None, "busy"
            try:
                with self.blobs.open(entry.digest) as fh:  # into one buffer of its size:
                    value = fh.read(entry.size_bytes)  # read() would join chunks (twice it)
            except BlobMissing:
                self._drop_dangling(key, entry.digest)
                return None, "miss"
            if digest_of(value) != entry.digest:
                return None, "miss"  # never hand torch bytes that are not what was written
            self._hot.add(entry.digest, value)
        return value, "hit"

    def lookup(self, key: bytes, *, environment: str | None) -> tuple[TierEntry | None, str]:
        """The key's entry, its use recorded (None and why when it is not served to a reader
        from ``environment``: ``miss``, ``other_environment``); its value is not read."""
        entry = tier_key(self.catalog, key)
        if entry is None:
            return None, "miss"
        if (
            environment is not None
            and not self.cross_environment
            and str(entry.writer.get("environment", "")) != environment
        ):
            return None, "other_environment"
        with self._uses_lock:
            self._uses[key] = utc_now()
        return entry, "hit"

    def has_value(self, digest: str) -> bool:
        """Whether the tier's blob store holds value ``digest`` (a put of it sends nothing)."""
        return self.blobs.stat(digest) is not None

    def record(
        self, key: bytes, *, digest: str, size_bytes: int, writer: Mapping[str, Any]
    ) -> TierPut:
        """Point ``key`` at value ``digest``, already in the blob store and checked (a put
        whose bytes the server had, or a committed upload), then evict."""
        stat = self.blobs.stat(digest)
        if stat is None:
            raise BlobMissing(f"tier value {digest} is not in the tier's store")
        self._point(key, digest=digest, size_bytes=size_bytes, stored_bytes=stat.stored_bytes,
                    writer=writer)  # fmt: skip
        return TierPut(stored=True, evicted=self.evict(), stored_bytes=stat.stored_bytes)

    def put(self, key: bytes, value: bytes, *, writer: Mapping[str, Any]) -> TierPut:
        """Store ``value`` under ``key`` (a later put of a key replaces it), then evict."""
        if len(value) > self.max_value_bytes:
            return TierPut(stored=False, reason="too_large")
        digest = digest_of(value)
        stat = self.blobs.stat(digest)
        if stat is None:
            self.blobs.put([value], digest=digest, size_bytes=len(value))
            stat = self.blobs.stat(digest)
            if stat is None:  # pragma: no cover - a backend that loses what it just stored
                raise BlobMissing(f"tier value {digest} vanished after it was stored")
        self._point(key, digest=digest, size_bytes=len(value), stored_bytes=stat.stored_bytes,
                    writer=writer)  # fmt: skip
        self._hot.add(digest, value)  # its digest is the bytes': nothing to check again
        return TierPut(stored=True, evicted=self.evict(), stored_bytes=stat.stored_bytes)

    def _point(
        self,
        key: bytes,
        *,
        digest: str,
        size_bytes: int,
        stored_bytes: int,
        writer: Mapping[str, Any],
    ) -> None:
        with self.catalog.writing() as tx:
            replaced = put_tier_key(
                tx,
                key=key,
                digest=digest,
                size_bytes=size_bytes,
                stored_bytes=stored_bytes,
                at=utc_now(),
                writer=writer,
            )
            if replaced is not None:
                self._delete_after_commit(tx, [replaced])
        with self._uses_lock:
            self._uses.pop(key, None)

    def evict(self) -> int:
        """Evict least recently used keys until the stored bytes fit the budget; how many."""
        if self.max_bytes is None:
            return 0
        self.flush_uses()
        evicted, batch = 0, 8  # a put at the cap usually evicts one key or two: read a few
        while (total := tier_totals(self.catalog).stored_bytes) > self.max_bytes:
            oldest = tier_lru(self.catalog, limit=batch)
            batch = min(EVICT_BATCH, 2 * batch)
            if not oldest:
                break
            chosen, freed = [], 0
            for entry in oldest:
                chosen.append(entry)
                freed += entry.stored_bytes + entry.row_bytes
                if total - freed <= self.max_bytes:
                    break
            with self.catalog.writing() as tx:
                delete_tier_keys(tx, (e.key for e in chosen))
                self._delete_after_commit(tx, [e.digest for e in chosen])
            evicted += len(chosen)
        self.evictions += evicted
        return evicted

    def flush_uses(self) -> int:
        """Write the last uses seen since the previous flush; how many keys."""
        with self._uses_lock:
            uses, self._uses = self._uses, {}
        if uses:
            with self.catalog.writing() as tx:
                touch_tier_keys(tx, uses)
        return len(uses)

    def totals(self) -> tuple[int, int]:
        """(keys, stored bytes of their distinct values)."""
        found = tier_totals(self.catalog)
        return found.keys, found.stored_bytes

    def _delete_after_commit(self, tx: Any, digests: list[str]) -> None:
        doomed = unreferenced_tier_digests(tx, digests)

        def delete() -> None:
            self._hot.drop(doomed)
            for digest in doomed:
                self.blobs.delete(digest)

        tx.after_commit(delete)

    def _drop_dangling(self, key: bytes, digest: str) -> None:
        with self.catalog.writing() as tx:
            if (found := tier_key(self.catalog, key)) is not None and found.digest == digest:
                delete_tier_keys(tx, [key])


class TierWriter:
    """Stores accepted SETs after they were answered, one at a time, within a byte budget;
    also flushes the tier's last uses every few seconds."""

    def __init__(self, store: Tier, metrics: Metrics, *, budget_bytes: int) -> None:
        self.store = store
        self.metrics = metrics
        self.budget_bytes = budget_bytes
        self.pending: collections.OrderedDict[bytes, tuple[bytes, dict[str, Any]]] = (
            collections.OrderedDict()
        )
        self.pending_bytes = 0
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(
            target=self._run, name="cachekeeper-tier-writer", daemon=True
        )

    def start(self) -> None:
        self._thread.start()

    def reserve(self, size_bytes: int) -> bool:
        """Hold ``size_bytes`` of the budget for a value about to be received
        (``queued_bytes``); False when it would pass the budget."""
        with self._cond:
            if self._stopping or self.pending_bytes + size_bytes > self.budget_bytes:
                return False
            self.pending_bytes += size_bytes
            return True

    def release(self, size_bytes: int) -> None:
        """Give back a reservation whose value will not be offered."""
        with self._cond:
            self.pending_bytes -= size_bytes

    def offer(self, key: bytes, value: bytes, writer: dict[str, Any]) -> bool:
        """Queue a value whose ``queued_bytes`` were reserved; False (dropped, the
        reservation given back) when the writer is stopping."""
        with self._cond:
            if self._stopping:
                self.pending_bytes -= queued_bytes(key, len(value))
                return False
            old = self.pending.pop(key, None)
            if old is not None:
                self.pending_bytes -= queued_bytes(key, len(old[0]))
            self.pending[key] = (value, writer)
            self._cond.notify()
            return True

    def peek(self, key: bytes, *, environment: str | None = None) -> bytes | None:
        """A value accepted under ``key`` and not stored yet (served as the store would:
        with ``environment``, only one written from it unless the store crosses them)."""
        with self._cond:
            found = self.pending.get(key)
        if found is None:
            return None
        value, writer = found
        if (
            environment is not None
            and not self.store.cross_environment
            and str(writer.get("environment", "")) != environment
        ):
            return None
        return value

    def _run(self) -> None:
        next_flush = time.monotonic() + _FLUSH_EVERY_S
        while True:
            with self._cond:
                while not self.pending and not self._stopping:
                    if not self._cond.wait(timeout=max(0.0, next_flush - time.monotonic())):
                        break
                if self._stopping and not self.pending:
                    break
                item = next(iter(self.pending.items()), None)
            if item is not None:
                key, (value, writer) = item
                self._store(key, value, writer)
                with self._cond:
                    if self.pending.get(key, (None,))[0] is value:  # else a newer SET replaced it
                        del self.pending[key]
                        self.pending_bytes -= queued_bytes(key, len(value))
            if time.monotonic() >= next_flush:
                next_flush = time.monotonic() + _FLUSH_EVERY_S
                self._flush()
        self._flush()

    def _store(self, key: bytes, value: bytes, writer: dict[str, Any]) -> None:
        started = time.perf_counter()
        try:
            done = self.store.put(key, value, writer=writer)
        except Exception:  # noqa: BLE001 - a store that fails drops the value, never the tier
            _log.exception("per-key tier: storing a value of %d bytes failed", len(value))
            result = "store_failed"
        else:
            result = "stored" if done.stored else (done.reason or "dropped")
            if done.stored:
                self.metrics.inc("cachekeeper_remote_cache_bytes_total", len(value), direction="in")
            if done.evicted:
                self.metrics.inc("cachekeeper_remote_cache_evictions_total", done.evicted)
        self.metrics.inc("cachekeeper_remote_cache_puts_total", result=result)
        seconds = time.perf_counter() - started
        self.metrics.observe("cachekeeper_remote_cache_put_seconds", seconds, result=result)

    def _flush(self) -> None:
        try:
            self.store.flush_uses()
        except Exception:  # noqa: BLE001 - last uses are advice for eviction; retried later
            _log.exception("per-key tier: recording last uses failed")

    def stop(self, *, timeout_s: float) -> None:
        """Store what is queued (within ``timeout_s``), then end the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout_s)
