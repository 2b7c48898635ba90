"""The archive stream: ``zstd(tar(manifest.json, blobs/<sha256>...))`` generated on the fly.

The fast path for pulling many small files in one request. Speed comes from not
recompressing: a zstd stream may be a concatenation of frames (RFC 8878 §3.1), and every
blob is stored as one zstd frame of exactly its bytes, so a large blob's stored frame is
copied into the response as it is, between small frames that hold the tar headers, the
padding and the small blobs (recompressed together, which compresses them better than one
frame each). Decoders must read across frames: ``zstd -d`` does, and so does
``zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)``.

Layout of the uncompressed tar: ``manifest.json`` first, then ``blobs/<digest>`` regular
files (mode 0644, mtime 0), each distinct blob once, in the order given.
"""

from __future__ import annotations

import tarfile
from collections.abc import Callable, Iterator, Sequence

import zstandard

from cachekeeper.blobstore import BlobStore

__all__ = ["archive_chunks", "SPLICE_MIN_BYTES", "CHUNK_BYTES"]

CHUNK_BYTES = 4 << 20  # what one yield carries (each yield is a thread hop in Starlette)
SPLICE_MIN_BYTES = 64 << 10  # blobs at least this big are copied as their stored frame
_BLOCK = 512


def _header(name: str, size: int) -> bytes:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8", errors="strict")


def _padding(size: int) -> bytes:
    return b"\0" * (-size % _BLOCK)


def archive_chunks(
    *,
    manifest_json: bytes,
    blobs: Sequence[tuple[str, int]],
    store: BlobStore,
    level: int = 1,
    splice_min_bytes: int = SPLICE_MIN_BYTES,
    on_blob: Callable[[str], None] | None = None,
) -> Iterator[bytes]:
    """Yield the compressed archive of ``manifest_json`` and ``blobs`` ((digest, size) pairs).

    Sizes are the uncompressed sizes the catalog recorded when each blob was verified.
    """
    cctx = zstandard.ZstdCompressor(level=level)
    cobj = cctx.compressobj()
    in_frame = False  # bytes fed to cobj since its frame began
    pending: list[bytes] = []
    pending_bytes = 0

    def small(data: bytes) -> None:
        nonlocal in_frame, pending_bytes
        if not data:
            return
        in_frame = True
        out = cobj.compress(data)
        if out:
            pending.append(out)
            pending_bytes += len(out)

    def end_frame() -> None:
        nonlocal cobj, in_frame, pending_bytes
        if in_frame:
            out = cobj.flush()
            pending.append(out)
            pending_bytes += len(out)
            cobj = cctx.compressobj()
            in_frame = False

    def take() -> bytes:
        nonlocal pending_bytes
        data = b"".join(pending)
        pending.clear()
        pending_bytes = 0
        return data

    small(_header("manifest.json", len(manifest_json)))
    small(manifest_json)
    small(_padding(len(manifest_json)))
    for digest, size in blobs:
        small(_header(f"blobs/{digest}", size))
        if size >= splice_min_bytes:
            end_frame()
            if pending_bytes:
                yield take()
            with store.open_raw(digest) as raw:
                while chunk := raw.read(CHUNK_BYTES):
                    yield chunk
        elif size:
            with store.open(digest) as fh:
                small(fh.read(size + 1))
        small(_padding(size))
        if on_blob is not None:
            on_blob(digest)
        if pending_bytes >= CHUNK_BYTES:
            yield take()
    small(b"\0" * (2 * _BLOCK))
    end_frame()
    yield take()
