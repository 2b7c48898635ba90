"""Restoring a snapshot into a cache dir: the entry points and what they are made of.

    cachekeeper/restore/core.py           the one restore (``restore_snapshot``: lock,
                                          already-restored check, signature, write, marker)
                                          and its entry points (``restore``,
                                          ``restore_archive``, ``restore_from_tar``,
                                          ``merge_tree``); the rules are drawn there
    cachekeeper/restore/sources.py        where the bytes come from (``SnapshotSource``:
                                          an archive file, a tar stream, a blob store)
    cachekeeper/restore/writer.py         verified temp files that appear without clobbering,
                                          never through a link the restore did not create
    cachekeeper/restore/marker.py         the cache dir's ``.cachekeeper/`` folder, the
                                          restore marker and the fast ``is_restored`` check
    cachekeeper/restore/triton_groups.py  Triton group files rewritten to the new root
    cachekeeper/restore/repair.py         ``restore --repair``: set aside what differs, then
                                          restore
    cachekeeper/restore/node_cache.py     the hook's per-environment cache dirs of this node
                                          (``cache ls`` / ``cache prune``)

The names below load on first use (PEP 562, ``cachekeeper._lazy``): the pre-job hook's
no-op path imports ``cachekeeper.restore.marker`` (and through it ``triton_groups``) and
never the writer, the sources or zstandard (``tests/client/test_prejob.py`` checks it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from cachekeeper._lazy import lazy_getattr

if TYPE_CHECKING:
    from cachekeeper.restore.core import (
        RestoreReport,
        merge_tree,
        needed_digests,
        restore,
        restore_archive,
        restore_from_tar,
        restore_snapshot,
        target_lock,
    )
    from cachekeeper.restore.marker import STATE_DIR, is_restored
    from cachekeeper.restore.sources import BlobSource, SnapshotSource

__all__ = [
    "BlobSource",
    "SnapshotSource",
    "RestoreReport",
    "restore_snapshot",
    "restore",
    "restore_from_tar",
    "restore_archive",
    "merge_tree",
    "needed_digests",
    "is_restored",
    "target_lock",
    "STATE_DIR",
]

_HOME = {
    "BlobSource": "sources",
    "SnapshotSource": "sources",
    "RestoreReport": "core",
    "restore_snapshot": "core",
    "restore": "core",
    "restore_from_tar": "core",
    "restore_archive": "core",
    "merge_tree": "core",
    "needed_digests": "core",
    "target_lock": "core",
    "is_restored": "marker",
    "STATE_DIR": "marker",
}

__getattr__ = lazy_getattr(__name__, _HOME)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
