"""The local snapshot store: manifests plus a content-addressed blob directory.

Layout (``home`` is ``$CACHEKEEPER_HOME``, else ``~/.cache/cachekeeper``, read when the
store is created, never at import)::

    home/
      blobs/                    # LocalBackend: ab/cd/<sha256>.zst, zstd at rest
      snapshots/
        <manifest id>.json      # one manifest per snapshot (its canonical JSON)
        .<id>.json.*.tmp        # a manifest being written (fsutil); never listed

Repeated snapshots of the same cache share blobs, and so do restores and later pushes.

Cache management is scan -> plan -> execute (as huggingface_hub's cache manager does):
``list()`` returns frozen ``StoredSnapshot`` rows, ``plan_remove`` / ``plan_gc`` return a
frozen ``DeletePlan`` with the bytes it would free, and only ``DeletePlan.execute()``
touches disk, which is what makes ``--dry-run`` honest. Deletion removes manifests (the
pointers) before blobs, and never a blob that a kept manifest references.
"""

from __future__ import annotations

import builtins
import os
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cachekeeper import config
from cachekeeper.backends.local import LocalBackend
from cachekeeper.errors import InvalidManifest, SnapshotNotFound
from cachekeeper.fsutil import atomic_write_text
from cachekeeper.snapshot.manifest import Manifest

__all__ = ["LocalStore", "StoredSnapshot", "DeletePlan"]

_MIN_PREFIX = 4


def _gpu_model(manifest: Manifest) -> str | None:
    """The model of the GPU the snapshot was built on (its first covered index), if any."""
    covered = [int(d.split(":", 1)[1]) for d in manifest.devices if d.startswith("cuda:")]
    gpus = {g["index"]: g for g in manifest.fingerprint.get("gpus") or []}
    for index in covered:
        if index in gpus:
            return gpus[index]["name"]
    return None


@dataclass(frozen=True)
class StoredSnapshot:
    """One snapshot in the local store, as ``ls`` shows it."""

    id: str
    workload: str | None
    fingerprint_digest: str
    devices: tuple[str, ...]
    verified: bool
    size_bytes: int
    file_count: int
    created_at: datetime
    torch: str | None = None  # the builder's environment, from the manifest's fingerprint
    cuda: str | None = None
    gpu: str | None = None  # the first covered GPU's model; None for a CPU build
    signed: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "torch": self.torch,
            "cuda": self.cuda,
            "gpu": self.gpu,
            "workload": self.workload,
            "fingerprint_digest": self.fingerprint_digest,
            "devices": list(self.devices),
            "verified": self.verified,
            "signed": self.signed,
            "size_bytes": self.size_bytes,
            "file_count": self.file_count,
            "created_at": self.created_at.isoformat(),
        }


@dataclass(frozen=True)
class DeletePlan:
    """What a removal would delete; nothing is touched until ``execute()``."""

    store: LocalStore = field(repr=False, compare=False)
    snapshot_ids: tuple[str, ...]
    blob_digests: tuple[str, ...]
    freed_bytes: int  # stored (compressed) bytes of the blobs plus the manifests

    def execute(self) -> int:
        """Delete manifests first, then blobs; returns the bytes actually freed."""
        freed = 0
        for snapshot_id in self.snapshot_ids:
            path = self.store.manifest_path(snapshot_id)
            try:
                size = path.stat().st_size
                path.unlink()
                freed += size
            except FileNotFoundError:
                continue
        # A manifest saved since the plan was made may reference a blob of the plan.
        still_used = self.store.referenced_digests()
        for digest in self.blob_digests:
            if digest in still_used:
                continue
            size = self.store.blobs.size(digest) or 0
            if self.store.blobs.delete(digest):
                freed += size
        return freed

    def to_dict(self) -> dict[str, Any]:
        """The plan in the CLI's gc/rm vocabulary (``bytes_freed``: what it would free)."""
        return {
            "snapshots_removed": list(self.snapshot_ids),
            "blobs_deleted": len(self.blob_digests),
            "bytes_freed": self.freed_bytes,
        }


class LocalStore:
    """Manifests under ``home/snapshots`` and blobs under ``home/blobs``."""

    def __init__(self, *, home: Path | None = None) -> None:
        self.home = Path(home) if home is not None else config.home(os.environ)
        self.blobs = LocalBackend(self.home / "blobs")
        self.snapshots_dir = self.home / "snapshots"

    def manifest_path(self, snapshot_id: str) -> Path:
        return self.snapshots_dir / f"{snapshot_id}.json"

    # -- manifests ------------------------------------------------------------------------
    def save_manifest(self, manifest: Manifest) -> None:
        """Write the manifest atomically and durably (``fsutil.atomic_write_text``)."""
        self.snapshots_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.manifest_path(manifest.id), manifest.to_json())

    def _ids(self) -> list[str]:
        if not self.snapshots_dir.is_dir():
            return []
        return sorted(
            p.name[: -len(".json")]
            for p in self.snapshots_dir.iterdir()
            if p.name.endswith(".json") and not p.name.startswith(".")
        )

    def resolve_id(self, id_or_prefix: str) -> str:
        """The full id for an id or a unique prefix of at least 4 characters."""
        ids = self._ids()
        if id_or_prefix in ids:
            return id_or_prefix
        if len(id_or_prefix) >= _MIN_PREFIX:
            matches = [i for i in ids if i.startswith(id_or_prefix)]
            if len(matches) == 1:
                return matches[0]
            if len(matches) > 1:
                raise SnapshotNotFound(
                    f"snapshot id prefix {id_or_prefix!r} is ambiguous ({len(matches)} match)"
                )
        if len(id_or_prefix) < _MIN_PREFIX:
            raise SnapshotNotFound(
                f"no snapshot {id_or_prefix!r} in the local store {self.home} (an id prefix "
                f"needs at least {_MIN_PREFIX} characters)"
            )
        raise SnapshotNotFound(f"no snapshot {id_or_prefix!r} in the local store {self.home}")

    def load_manifest(self, id_or_prefix: str) -> Manifest:
        snapshot_id = self.resolve_id(id_or_prefix)
        try:
            text = self.manifest_path(snapshot_id).read_text(encoding="utf-8")
        except FileNotFoundError as exc:
            raise SnapshotNotFound(f"no snapshot {id_or_prefix!r} in the local store") from exc
        return Manifest.from_json(text)

    def list(self) -> list[StoredSnapshot]:
        """Every readable snapshot, newest first (unreadable manifests are left out)."""
        rows: list[StoredSnapshot] = []
        for snapshot_id in self._ids():
            path = self.manifest_path(snapshot_id)
            try:
                manifest = Manifest.from_json(path.read_text(encoding="utf-8"))
                mtime = path.stat().st_mtime
            except (OSError, InvalidManifest):
                continue
            rows.append(
                StoredSnapshot(
                    id=snapshot_id,
                    workload=manifest.workload,
                    fingerprint_digest=manifest.fingerprint_digest,
                    devices=manifest.devices,
                    verified=manifest.verified,
                    size_bytes=manifest.size_bytes,
                    file_count=len(manifest.files),
                    created_at=datetime.fromtimestamp(mtime, tz=UTC),
                    torch=manifest.fingerprint.get("torch"),
                    cuda=manifest.fingerprint.get("cuda"),
                    gpu=_gpu_model(manifest),
                    signed=manifest.signature is not None,
                )
            )
        rows.sort(key=lambda r: (r.created_at, r.id), reverse=True)
        return rows

    def referenced_digests(self, *, excluding: set[str] | None = None) -> set[str]:
        """Blob digests referenced by every stored manifest except ``excluding``.

        A manifest that cannot be parsed keeps every blob (we cannot tell what it needs),
        so it raises instead of silently letting gc delete its blobs.
        """
        used: set[str] = set()
        for snapshot_id in self._ids():
            if excluding and snapshot_id in excluding:
                continue
            try:
                text = self.manifest_path(snapshot_id).read_text(encoding="utf-8")
            except FileNotFoundError:
                continue
            used |= Manifest.from_json(text).digests
        return used

    # -- deletion plans -------------------------------------------------------------------
    def _plan(self, snapshot_ids: builtins.list[str], candidates: set[str]) -> DeletePlan:
        kept = self.referenced_digests(excluding=set(snapshot_ids))
        blobs = sorted(candidates - kept)
        freed = sum(self.blobs.size(d) or 0 for d in blobs)
        for snapshot_id in snapshot_ids:
            try:
                freed += self.manifest_path(snapshot_id).stat().st_size
            except FileNotFoundError:
                pass
        return DeletePlan(
            store=self,
            snapshot_ids=tuple(snapshot_ids),
            blob_digests=tuple(blobs),
            freed_bytes=freed,
        )

    def plan_remove(self, ids: builtins.list[str]) -> DeletePlan:
        """Plan removing these snapshots and the blobs only they reference."""
        full = list(dict.fromkeys(self.resolve_id(i) for i in ids))
        candidates: set[str] = set()
        for snapshot_id in full:
            candidates |= self.load_manifest(snapshot_id).digests
        return self._plan(full, candidates)

    def plan_gc(self) -> DeletePlan:
        """Plan deleting every blob no stored manifest references."""
        return self._plan([], set(self.blobs.digests()))
