"""A cache dir's own state folder, and the marker a complete restore leaves in it.

    cache_dir/.cachekeeper/          # STATE_DIR: ours; snapshots never include dot-names
      restored/<snapshot id>         # JSON: the id, each path with its size, the signer's key
      conflicts/<snapshot id>        # JSON: the paths a restore kept because they differ
                                     # from the manifest (their digest in the manifest)

``record_conflicts`` is the restore's record of what it kept (a file that differs from the
manifest: someone's own version, or a corrupt entry), which ``verify`` names when the dir
misses and ``restore --repair`` replaces; a restore without conflicts removes it.
``markers`` reads every marker (postjob's baseline), ``held_snapshot`` names the newest
snapshot whose files are all still there (what a job uses when no restore could run).

``write_marker`` is the restore's last step (``cachekeeper.restore``), after every file of
the snapshot is in place and verified. ``is_restored`` is the fast already-restored check
that the pre-job hook runs before every job: it reads the marker and ``stat``-s each path,
checking existence and size (existence only for Triton group files, which a restore
rewrites); no hashing, a few milliseconds for thousands of files. A file changed in place
with the same size is not detected by it; a full restore hashes and reports it.

Stdlib only and light on purpose: the hook imports this module, not the restore stack.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

from cachekeeper.fsutil import atomic_write_text
from cachekeeper.manifest import Manifest, is_digest
from cachekeeper.triton_groups import is_group_path

__all__ = [
    "STATE_DIR",
    "write_marker",
    "is_restored",
    "markers",
    "held_snapshot",
    "record_conflicts",
    "recorded_conflicts",
]

STATE_DIR = ".cachekeeper"


def write_marker(manifest: Manifest, cache_dir: Path, *, key_id: str | None) -> None:
    """Record that ``cache_dir`` holds all of ``manifest`` (signed by ``key_id``, if given)."""
    folder = Path(cache_dir) / STATE_DIR / "restored"
    folder.mkdir(parents=True, exist_ok=True)
    files = [[e.path, -1 if is_group_path(e.path) else e.size_bytes] for e in manifest.files]
    body = {"id": manifest.id, "files": files, "key_id": key_id}
    atomic_write_text(folder / manifest.id, json.dumps(body))


def is_restored(
    manifest_id: str, cache_dir: Path, *, trusted_key_ids: Collection[str] | None = None
) -> bool:
    """The already-restored check: marker present and every file there with its size.

    With ``trusted_key_ids`` (non-empty), the marker must also say that a restore which
    verified the signature of one of those keys wrote it.
    """
    if not is_digest(manifest_id):
        return False
    root = os.fspath(cache_dir)
    try:
        with open(os.path.join(root, STATE_DIR, "restored", manifest_id), "rb") as fh:
            marker = json.loads(fh.read())
        if trusted_key_ids and marker.get("key_id") not in trusted_key_ids:
            return False
        files = marker["files"]
        stat = os.stat
        for path, size in files:
            st = stat(f"{root}/{path}")
            if size >= 0 and st.st_size != size:
                return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return True


def markers(cache_dir: Path) -> list[tuple[float, str, list[list[Any]]]]:
    """(mtime, snapshot id, files) of every readable restore marker, oldest first."""
    out = []
    folder = Path(cache_dir) / STATE_DIR / "restored"
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    for name in names:
        try:
            path = folder / name
            body = json.loads(path.read_bytes())
            out.append((path.stat().st_mtime, str(body["id"]), list(body["files"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a marker being written, or not ours
    return sorted(out)


def held_snapshot(cache_dir: Path) -> str | None:
    """The newest snapshot a complete restore left in ``cache_dir`` whose files are all
    still there (``is_restored``), or None: the cache a job uses when no restore ran."""
    for _mtime, snapshot_id, _files in reversed(markers(cache_dir)):
        if is_restored(snapshot_id, cache_dir):
            return snapshot_id
    return None


def record_conflicts(manifest: Manifest, cache_dir: Path, conflicts: Collection[str]) -> None:
    """Record (or, with none, clear) the paths a restore of ``manifest`` kept as conflicts."""
    path = Path(cache_dir) / STATE_DIR / "conflicts" / manifest.id
    if not conflicts:
        try:
            path.unlink()
        except OSError:
            pass  # none recorded (the common case), or a dir we cannot change
        return
    digests = {e.path: e.digest for e in manifest.files}
    body = {"id": manifest.id, "files": {p: digests.get(p) for p in sorted(conflicts)}}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(body))


def recorded_conflicts(cache_dir: Path) -> dict[str, dict[str, str | None]]:
    """{snapshot id: {path: the manifest's digest}} of every recorded conflict."""
    folder = Path(cache_dir) / STATE_DIR / "conflicts"
    out: dict[str, dict[str, str | None]] = {}
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    for name in names:
        try:
            body = json.loads((folder / name).read_bytes())
            out[str(body["id"])] = dict(body["files"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out
