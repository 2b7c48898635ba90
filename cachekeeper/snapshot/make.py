"""Snapshot a cache dir into the local store, and the one-file archive form.

What enters a snapshot: every regular file under the root, except

- ``locks/`` folders and ``*.lock`` files (Inductor's and Triton's file locks),
- temp and partial files: names starting with ``.`` (this covers restore's own
  ``.cachekeeper/`` folder and its staging files) or ending in ``.tmp`` / ``.partial``,
- anything that is not a regular file (sockets, FIFOs, devices).

A symbolic link anywhere under the root is refused with ``LinkInCacheDir`` naming it:
following it could pull in files from outside the cache, and dropping it silently would
make a snapshot that differs from the dir.

The one-file archive (``write_archive``) is the format of ``cachekeeper.snapshot.archive``, in one
zstd frame compressed multi-threaded, written through ``fsutil.atomic_writer``: a temp file
next to the output, fsynced, that appears by ``os.replace`` only when complete.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from pathlib import Path
from typing import Any

import zstandard

from cachekeeper import remote_tier
from cachekeeper.backends.local import LocalBackend
from cachekeeper.environment import fingerprint as fingerprint_mod
from cachekeeper.errors import EmptyCacheDir, NotOwnBytes
from cachekeeper.fsutil import atomic_writer
from cachekeeper.integrity import CHUNK_BYTES, digest_of, hash_file
from cachekeeper.restore.marker import read_markers
from cachekeeper.snapshot.archive import open_archive_stream, read_manifest_member, write_tar
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.snapshot.provenance import (
    load_prewarm_record,
    recorded_cpu,
    recorded_key_switches,
    recorded_workloads,
)
from cachekeeper.snapshot.scan import CacheTree, ScannedFile, is_excluded, scan_dir
from cachekeeper.snapshot.signing import load_signing_key, sign_manifest
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


def _store_file(blobs: LocalBackend, tree: CacheTree, scanned: ScannedFile) -> tuple[str, int]:
    """Hash the file the scan saw and put it in ``blobs`` unless present; reads it once
    (twice when large and new: hash, then store, which checks the hash again). Read
    through ``tree``: a link or another file in its place since the scan is refused."""
    with tree.reading(scanned) as fh:
        if scanned.size_bytes <= _SMALL_FILE_BYTES:
            data = fh.read()
            digest = digest_of(data)
            if not blobs.has(digest):
                blobs.put([data], digest=digest, size_bytes=len(data))
            return digest, len(data)
        digest, size = hash_file(fh.fileno())
        if not blobs.has(digest):
            fh.seek(0)
            blobs.put(iter(lambda: fh.read(CHUNK_BYTES), b""), digest=digest, size_bytes=size)
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
    allow_empty: bool = True,
) -> Manifest:
    """Hash every file of ``root``, put new blobs in ``store``, save and return the manifest.

    With ``only`` (relative paths) and ``parent`` (a snapshot id): a harvested delta of
    just those files, ``source="harvest"``, parented on ``parent`` (never verified).

    With ``sign_key`` (an Ed25519 ``PREFIX.key``), the manifest is signed before it is
    saved; the key is read first, so a bad key fails before any hashing. A signature says
    the signer compiled what it signs, so a whole dir that holds files a restore put
    there (its restore markers) is refused (``NotOwnBytes``): bytes from a server, a
    harvest among them, never get this key's signature by way of a node's dir. (A harvest,
    ``parent``, holds only what the job compiled; its signer is the node's key.)

    Without ``allow_empty``, a dir holding no file a snapshot takes raises
    ``EmptyCacheDir`` saying what was scanned, before anything is saved.

    With ``workload`` given and no ``stats``, what a prewarm of that workload recorded in
    ``root`` (cachekeeper.snapshot.provenance) fills ``stats``, ``workload_digest`` and ``devices``,
    and its CPU state replaces the fingerprint's (this shell's, or the one passed in): a
    snapshot's fingerprint is the one its caches were built with. Without ``workload``, a dir
    that a prewarm of exactly one workload left its record in is that workload's: the
    snapshot of a freshly prewarmed dir says verified as the same dir pushed does.
    """
    root = Path(root)
    if sign_key is not None:
        load_signing_key(sign_key)  # fail early on a missing or wrong key
        if parent is None:
            _refuse_restored(root)
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
    with CacheTree(root) as tree:
        files = tree.scan()
        if only is not None:
            wanted = set(only)
            files = [f for f in files if f.rel in wanted]
        if not files and not allow_empty:
            raise EmptyCacheDir(_nothing_in(root, excluded=tree.excluded, only=only))
        # Each file is read relative to the scan's descriptors and must be the one scanned
        # (cachekeeper.snapshot.scan): a link swapped in after the scan is refused, never followed.
        entries = []
        for scanned in files:
            digest, size = _store_file(store.blobs, tree, scanned)
            entries.append(
                FileEntry(path=scanned.rel, digest=digest, size_bytes=size, mode=scanned.mode)
            )
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


def _nothing_in(root: Path, *, excluded: int, only: Collection[str] | None) -> str:
    """The message of a scan that found nothing to take."""
    if only is not None:
        found = f"none of the {len(only)} path(s) asked for is a file there any more"
    elif excluded:
        found = (
            f"its {excluded} entr{'y is' if excluded == 1 else 'ies are'} all left out"
            " (locks, *.tmp/*.partial files, names starting with '.', cachekeeper's own"
            " .cachekeeper/)"
        )
    else:
        found = "it is empty"
    return (
        f"nothing to push in {root}: {found}, so no file a snapshot takes (Inductor's"
        " fxgraph/, aotautograd/, triton/, ...); is it the job's TORCHINDUCTOR_CACHE_DIR?"
        " (--allow-empty publishes it anyway)"
    )


def _refuse_restored(root: Path) -> None:
    """NotOwnBytes when ``root`` holds files a restore of a snapshot wrote (its markers say
    so; prewarm's merges of its own staging dirs are marked ``merged``)."""
    restored = [
        str(body.get("id", "?")) for _mtime, body in read_markers(root) if not body.get("merged")
    ]
    if restored:
        raise NotOwnBytes(
            f"refusing to sign {root}: it holds files restored from snapshot"
            f" {restored[-1][:12]} (.cachekeeper/restored/), bytes this machine did not"
            " compile; a signature vouches that the signer compiled what it signs: prewarm"
            " into a fresh, empty dir and sign that (docs/security.md)"
        )


def write_archive(manifest: Manifest, blobs: LocalBackend, out: Path, *, level: int = 3) -> int:
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
