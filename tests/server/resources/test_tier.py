"""The per-key tier's store: values by digest in a real blob dir, keys in a real catalog,
least recently used keys evicted to the budget, nothing deleted that a key still names."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from cachekeeper.backends.local import LocalBackend
from cachekeeper.server.catalog import Catalog
from cachekeeper.server.resources.tier import Tier
from cachekeeper.server.resources.tier_keys import ROW_BYTES, tier_key, tier_totals

WRITER = {"client": "ck:n:1", "scope": "write"}


def store(
    tmp_path: Path,
    *,
    max_bytes: int | None = None,
    max_value: int = 1 << 20,
    memory_bytes: int = 0,
) -> Tier:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Tier(
        catalog=Catalog.create(tmp_path / "meta.sqlite"),
        blobs=LocalBackend(tmp_path / "tier-blobs", level=1),
        max_value_bytes=max_value,
        max_bytes=max_bytes,
        memory_bytes=memory_bytes,
    )


def noise(n: int, seed: int) -> bytes:  # incompressible, so stored bytes ~ n
    out = b""
    while len(out) < n:
        out += hashlib.sha256(f"{seed}-{len(out)}".encode()).digest()
    return out[:n]


def test_keys_are_torchs_own_bytes_and_values_come_back_exactly(tmp_path: Path) -> None:
    tier = store(tmp_path)
    key = b"pt2:fx-graph-v1::f\xc3\xa9/weird key:c1"
    assert tier.get(key) is None
    assert tier.put(key, b"v1", writer=WRITER).stored
    assert tier.get(key) == b"v1"
    assert tier.put(key, b"v2", writer=WRITER).stored  # a later write wins
    assert tier.get(key) == b"v2"
    assert sorted(tier.blobs.digests()) == [hashlib.sha256(b"v2").hexdigest()]  # v1 went
    assert tier.put(b"k", b"x" * ((1 << 20) + 1), writer=WRITER).reason == "too_large"


def test_the_least_recently_used_keys_go_first_and_shared_values_stay(tmp_path: Path) -> None:
    tier = store(tmp_path, max_bytes=25_000)
    for i in range(3):
        tier.put(b"k%d" % i, noise(10_000, i), writer=WRITER)  # the third evicts k0
    assert tier.get(b"k0") is None and tier.get(b"k1") is not None
    tier.put(b"shared", noise(10_000, 2), writer=WRITER)  # the same value as k2: no new bytes
    assert tier.totals() == (3, tier.totals()[1]) and tier.totals()[1] < 25_000
    tier.get(b"k2")  # k1 is now the least recently used
    done = tier.put(b"k3", noise(10_000, 3), writer=WRITER)
    assert done.evicted == 1 and tier.get(b"k1") is None
    assert tier.get(b"k2") is not None and tier.get(b"shared") is not None
    digests = set(tier.blobs.digests())
    assert hashlib.sha256(noise(10_000, 1)).hexdigest() not in digests
    assert hashlib.sha256(noise(10_000, 2)).hexdigest() in digests


def test_a_key_whose_value_is_gone_reads_as_a_miss_and_is_dropped(tmp_path: Path) -> None:
    tier = store(tmp_path)
    tier.put(b"k", b"value", writer=WRITER)
    tier.blobs.delete(hashlib.sha256(b"value").hexdigest())
    assert tier.get(b"k") is None
    assert tier_key(tier.catalog, b"k") is None


def test_last_uses_reach_the_catalog_in_batches(tmp_path: Path) -> None:
    tier = store(tmp_path)
    tier.put(b"k", b"value", writer=WRITER)
    before = tier_key(tier.catalog, b"k")
    assert before is not None
    tier.get(b"k")
    assert tier_key(tier.catalog, b"k") == before  # a GET writes nothing
    assert tier.flush_uses() == 1
    after = tier_key(tier.catalog, b"k")
    assert after is not None and after.last_used_at > before.last_used_at


def test_hot_values_serve_from_memory_and_leave_with_their_blob(tmp_path: Path) -> None:
    """A value read back (or put) is kept in memory, checked once; evicting its key drops
    it, so a later GET of a key rewritten to other bytes never sees the old ones."""
    tier = store(tmp_path, memory_bytes=1 << 20)
    tier.put(b"k1", b"v1" * 100, writer=WRITER)
    entry = tier_key(tier.catalog, b"k1")
    assert entry is not None
    tier.blobs.delete(entry.digest)  # the blob gone behind its back: memory still answers
    assert tier.get(b"k1") == b"v1" * 100
    tier.put(b"k1", b"other", writer=WRITER)  # a replaced value: its old blob and memory go
    assert tier.get(b"k1") == b"other"
    assert tier._hot.get(entry.digest) is None
    cold = store(tmp_path / "cold", memory_bytes=0)  # none kept: the blob is read each time
    cold.put(b"k", b"value", writer=WRITER)
    found = tier_key(cold.catalog, b"k")
    assert found is not None
    cold.blobs.delete(found.digest)
    assert cold.get(b"k") is None


def test_keys_and_writers_count_in_the_budget(tmp_path: Path) -> None:
    """Issue 32, class 6: a tier of 1-byte values under 1,000-byte keys is bounded by its
    keys' rows (key twice, writer, the rest of the row), not only by its values' bytes."""
    tier = store(tmp_path, max_bytes=20_000)
    writer = {"client": "n" * 128, "scope": "write"}
    for i in range(50):
        tier.put(b"%03d" % i + b"k" * 997, b"v", writer=writer)
    keys, stored = tier.totals()
    assert stored <= 20_000 and 0 < keys < 10
    entry = tier_key(tier.catalog, b"049" + b"k" * 997)
    assert entry is not None
    assert entry.row_bytes == 2 * 1000 + len(json.dumps(writer, sort_keys=True)) + ROW_BYTES
    totals = tier_totals(tier.catalog)
    assert totals.row_bytes == keys * entry.row_bytes  # one value, shared: the rest is rows
    assert totals.stored_bytes - totals.row_bytes == entry.stored_bytes
