"""Snapshot a cache dir into the local store, and the one-file archive form.

What enters a snapshot: every regular file under the root, except

- ``locks/`` folders and ``*.lock`` files (Inductor's and Triton's file locks),
- temp and partial files: names starting with ``.`` (this covers restore's own
  ``.cachekeeper/`` folder and its staging files) or ending in ``.tmp`` / ``.partial``,
- anything that is not a regular file (sockets, FIFOs, devices).

A symbolic link anywhere under the root is refused with ``LinkInCacheDir`` naming it:
following it could pull in files from outside the cache, and dropping it silently would
make a snapshot that differs from the dir.

The one-file archive (``write_archive``) is the format of ``cachekeeper.archive``, in one
zstd frame compressed multi-threaded, written through ``fsutil.atomic_writer``: a temp file
next to the output, fsynced, that appears by ``os.replace`` only when complete.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import zstandard

from cachekeeper import fingerprint as fingerprint_mod
from cachekeeper import remote_tier
from cachekeeper.archive import open_archive_stream, read_manifest_member, write_tar
from cachekeeper.blobstore import LocalBlobStore
from cachekeeper.fsutil import atomic_writer
from cachekeeper.integrity import digest_of, hash_file
from cachekeeper.manifest import FileEntry, Manifest
from cachekeeper.provenance import (
    load_prewarm_record,
    recorded_cpu,
    recorded_key_switches,
    recorded_workloads,
)
from cachekeeper.scan import is_excluded, scan_dir
from cachekeeper.signing import load_signing_key, sign_manifest
from cachekeeper.store import LocalStore

__all__ = [
    "is_excluded",
    "scan_dir",
    "snapshot_dir",
    "devices_of",
    "write_archive",
    "read_archive_manifest",
]

_SMALL_FILE_BYTES = 8 << 20


def devices_of(root: Path, fingerprint: fingerprint_mod.Fingerprint) -> list[str]:
    """The devices a cache covers: ``["cpu"]`` without GPUs, else ``triton/<idx>`` folders,
    else every GPU index of the fingerprint."""
    gpus = fingerprint.get("gpus") or []
    if not gpus:
        return ["cpu"]
    triton = Path(root) / "triton"
    indices = (
        sorted(int(p.name) for p in triton.iterdir() if p.is_dir() and p.name.isdigit())
        if triton.is_dir()
        else []
    )
    if indices:
        return [f"cuda:{i}" for i in indices]
    return [f"cuda:{g['index']}" for g in gpus]


def _store_file(blobs: LocalBlobStore, path: Path) -> tuple[str, int]:
    """Hash ``path`` and put it in ``blobs`` unless present; reads small files once."""
    size = path.stat().st_size
    if size <= _SMALL_FILE_BYTES:
        data = path.read_bytes()
        digest = digest_of(data)
        if not blobs.has(digest):
            blobs.put([data], digest=digest, size_bytes=len(data))
        return digest, len(data)
    digest, size = hash_file(path)
    if not blobs.has(digest):
        blobs.put_file(path, digest=digest)
    return digest, size


def snapshot_dir(
    root: Path,
    *,
    store: LocalStore,
    workload: str | None = None,
    workload_digest: str | None = None,
    devices: list[str] | None = None,
    stats: dict[str, Any] | None = None,
    fingerprint: fingerprint_mod.Fingerprint | None = None,
    sign_key: str | os.PathLike[str] | None = None,
    only: Collection[str] | None = None,
    parent: str | None = None,
) -> Manifest:
    """Hash every file of ``root``, put new blobs in ``store``, save and return the manifest.

    With ``only`` (relative paths) and ``parent`` (a snapshot id): a harvested delta of
    just those files, ``source="harvest"``, parented on ``parent`` (never verified).

    With ``sign_key`` (an Ed25519 ``PREFIX.key``), the manifest is signed before it is
    saved; the key is read first, so a bad key fails before any hashing.

    With ``workload`` given and no ``stats``, what a prewarm of that workload recorded in
    ``root`` (cachekeeper.provenance) fills ``stats``, ``workload_digest`` and ``devices``,
    and its CPU state replaces the fingerprint's (this shell's, or the one passed in): a
    snapshot's fingerprint is the one its caches were built with. Without ``workload``, a dir
    that a prewarm of exactly one workload left its record in is that workload's: the
    snapshot of a freshly prewarmed dir says verified as the same dir pushed does.
    """
    root = Path(root)
    if sign_key is not None:
        load_signing_key(sign_key)  # fail early on a missing or wrong key
    if parent is not None:
        stats = {"harvest": {"parent": parent}}  # not the prewarm's stats: nothing verified it
    if workload is None and stats is None:
        recorded = recorded_workloads(root)
        workload = recorded[0] if len(recorded) == 1 else None
    record = None
    if workload is not None and stats is None:
        record = load_prewarm_record(root, workload)
        if record is not None:
            stats = record.get("stats")
            workload_digest = workload_digest or record.get("workload_digest")
            devices = devices if devices is not None else record.get("devices")
    files = scan_dir(root)
    if only is not None:
        wanted = set(only)
        files = [f for f in files if f[0] in wanted]
    fp = fingerprint if fingerprint is not None else fingerprint_mod.collect()
    compiled_under = recorded_cpu(record)
    if compiled_under is not None:
        # What the prewarm's children compiled under, whoever asks: a fingerprint passed in
        # (the agent's, a push's) says where the caller runs, not what built the caches.
        fp = fingerprint_mod.with_cpu(fp, compiled_under)
    switches = recorded_key_switches(record)
    if switches is not None:
        # Likewise the tier's switches in torch's keys (one is in the AOTAutograd key): the
        # snapshot says what its entries were built with, not what the pushing shell runs.
        fp = remote_tier.with_key_switches(fp, switches)
    entries = []
    for rel, path, mode in files:
        digest, size = _store_file(store.blobs, path)
        entries.append(FileEntry(path=rel, digest=digest, size_bytes=size, mode=mode))
    manifest = Manifest(
        files=tuple(entries),
        fingerprint=fp,
        devices=tuple(devices if devices is not None else devices_of(root, fp)),
        workload=workload,
        workload_digest=workload_digest,
        stats=stats,
        source=None if parent is None else "harvest",
        parent=parent,
    )
    if sign_key is not None:
        manifest = sign_manifest(manifest, sign_key)
    store.save_manifest(manifest)
    return manifest


def write_archive(manifest: Manifest, blobs: LocalBlobStore, out: Path, *, level: int = 3) -> int:
    """Write the one-file archive of ``manifest`` to ``out`` (atomically, through
    ``fsutil.atomic_writer``); returns its size in bytes."""
    out = Path(out)
    params = zstandard.ZstdCompressionParameters.from_level(level, threads=-1)
    with atomic_writer(out) as raw:
        compressor = zstandard.ZstdCompressor(compression_params=params)
        with compressor.stream_writer(raw, closefd=False) as zout:
            write_tar(
                zout,
                manifest_json=manifest.to_json().encode(),
                blobs=((e.digest, e.size_bytes) for e in manifest.files),
                open_blob=blobs.open,
            )
    return out.stat().st_size


def read_archive_manifest(path: Path) -> Manifest:
    """The manifest of an archive file, reading only its first member."""
    with open(path, "rb") as fh:
        return read_manifest_member(open_archive_stream(fh), source=str(path))
