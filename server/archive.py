"""The archive stream: ``zstd(tar(manifest.json, blobs/<sha256>...))`` generated on the fly.

The fast path for pulling many small files in one request. Speed comes from not
recompressing: a zstd stream may be a concatenation of frames (RFC 8878 §3.1), and every
blob is stored as one zstd frame of exactly its bytes, so a large blob's stored frame is
copied into the response as it is, between small frames that hold the tar headers, the
padding and the small blobs (recompressed together, which compresses them better than one
frame each). Decoders must read across frames: ``zstd -d`` does, and so does
``zstandard.ZstdDecompressor().stream_reader(fh, read_across_frames=True)``.

The tar inside is the format of ``cachekeeper.snapshot.archive`` (member names, headers, order):
this module only decides which pieces of its ``layout`` to compress and which blobs to pass
through as stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO, Protocol

import zstandard

from cachekeeper.snapshot.archive import layout

__all__ = ["archive_chunks", "SPLICE_MIN_BYTES", "CHUNK_BYTES"]

CHUNK_BYTES = 4 << 20  # what one yield carries (each yield is a thread hop in Starlette)
SPLICE_MIN_BYTES = 64 << 10  # blobs at least this big are copied as their stored frame


class _BlobSource(Protocol):
    """What the stream reads blobs from (the snapshots' blob backend)."""

    def open(self, digest: str) -> BinaryIO: ...

    def open_raw(self, digest: str) -> BinaryIO: ...


def archive_chunks(
    *,
    manifest_json: bytes,
    blobs: Sequence[tuple[str, int]],
    store: _BlobSource,
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

    for piece in layout(manifest_json, blobs):
        if isinstance(piece, bytes):
            small(piece)
            continue
        if piece.size_bytes >= splice_min_bytes:
            end_frame()
            if pending_bytes:
                yield take()
            with store.open_raw(piece.digest) as raw:
                while chunk := raw.read(CHUNK_BYTES):
                    yield chunk
        elif piece.size_bytes:
            with store.open(piece.digest) as fh:
                small(fh.read(piece.size_bytes + 1))
        if on_blob is not None:
            on_blob(piece.digest)
        if pending_bytes >= CHUNK_BYTES:
            yield take()
    end_frame()
    yield take()
