"""A real compiled Inductor cache survives snapshot -> archive -> restore at another path."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachekeeper.restore import is_restored, restore_archive
from cachekeeper.snapshot.make import snapshot_dir, write_archive
from cachekeeper.store import LocalStore
from tests.conftest import run_probe


@pytest.mark.slow
def test_restored_cache_hits_at_a_new_path(compiled_cache: Path, tmp_path: Path) -> None:
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(compiled_cache, store=store)
    assert not any(f.path.startswith("locks/") for f in manifest.files)
    archive = tmp_path / "compiled.tar.zst"
    write_archive(manifest, store.blobs, archive)

    new_dir = tmp_path / "somewhere" / "else" / "inductor"
    report = restore_archive(archive, new_dir)
    assert report.written == len(manifest.files) and report.conflicts == []
    assert is_restored(manifest.id, new_dir)

    counters = run_probe(new_dir)
    assert counters["inductor"].get("fxgraph_cache_hit", 0) >= 1, counters
    assert counters["inductor"].get("fxgraph_cache_miss", 0) == 0, counters
