"""The verify's outside view of a cache dir (cachekeeper/builder/cache_watch.py), on real files."""

from __future__ import annotations

import os
from pathlib import Path

from cachekeeper.builder.cache_watch import Watch


def _entry(root: Path, rel: str, data: bytes = b"entry") -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_gained_and_changed_entries_are_seen(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    kept = _entry(cache, "fxgraph/ab/key1/e1")
    changed = _entry(cache, "aotautograd/key2/e2")
    _entry(cache, "triton/0/x/kernel.cubin")  # not an FX or AOTAutograd entry
    watch = Watch.start(cache, mark_reads=False)
    _entry(cache, "fxgraph/cd/key3/e3")  # a miss writes a new entry
    changed.write_bytes(b"other bytes")
    _entry(cache, "triton/0/y/kernel.cubin")
    seen = watch.finish()
    assert (seen.entries, seen.gained_count, seen.read) == (2, 2, None)
    assert seen.gained == ("aotautograd/key2/e2", "fxgraph/cd/key3/e3")
    assert not seen.clean and "gained or changed 2" in seen.describe()
    assert kept.read_bytes() == b"entry"


def test_reads_are_counted_on_a_copy_the_verify_owns(tmp_path: Path) -> None:
    cache = tmp_path / "copy"
    read = _entry(cache, "fxgraph/ab/key1/e1")
    _entry(cache, "aotautograd/key2/e2")
    watch = Watch.start(cache, mark_reads=True)
    assert watch.marked  # this filesystem records reads (the probe said so)
    assert os.stat(read).st_atime_ns == 0
    nothing = Watch(cache, dict(watch.before), True).finish()
    assert nothing.read == 0 and not nothing.clean and "nothing hit it" in nothing.describe()
    read.read_bytes()  # a hit reads its entry
    seen = watch.finish()
    assert (seen.read, seen.gained_count) == (1, 0) and seen.clean
