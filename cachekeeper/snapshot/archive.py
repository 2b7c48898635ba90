"""The snapshot archive format: member names, header writing, and a strict streaming reader.

Every writer and reader of an archive uses this module, so the format has one owner::

    zstd( tar( manifest.json       first member: the manifest's canonical JSON
               blobs/<sha256>      each distinct blob once, its uncompressed bytes
               ...                 in manifest order
               two zero blocks ) ) the end of the tar

Members are regular files with mode 0644, mtime 0, uid and gid 0 and no owner names.
Headers are POSIX ustar (``tarfile``'s PAX format, which adds an ``x`` record only where
ustar cannot hold a value: a blob of 8 GiB or more). The zstd stream may hold several
frames (RFC 8878 section 3.1). ``zstd -d | tar -x`` unpacks an archive.

Writers: ``cachekeeper.snapshot.make.write_archive`` (the one-file form, through ``write_tar``)
and ``cachekeeper.server.archive`` (the streamed form: the pieces of ``layout``, with each
large blob's stored zstd frame passed through without recompression).

Reader: ``tarfile`` in stream mode (``"r|"``) re-slices its buffer on every read, which cost
~1 s per 350 MB in the restore benchmark (as much as zstd decompression itself). An archive
holds only regular-file members with short names, so ``iter_tar`` parses ustar headers
itself (with PAX ``x`` records and GNU ``L`` long names, as other tar writers may write
them), checks each header's checksum, and hands out each member's bytes straight from the
underlying stream in large reads. It never touches the filesystem; the caller decides what
a member name means (``blob_digest``), and gets the member's type so that links and devices
can be refused. ``read_manifest_member`` reads and bounds the first member.
"""

from __future__ import annotations

import io
import queue
import tarfile
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import zstandard

from cachekeeper.errors import BlobMissing, InvalidManifest, UnsupportedFormat
from cachekeeper.integrity import is_digest
from cachekeeper.snapshot.manifest import MAX_FILES, Manifest

__all__ = [
    "MANIFEST_MEMBER",
    "BLOB_PREFIX",
    "MAX_MANIFEST_BYTES",
    "BLOCK",
    "REGULAR",
    "END_OF_ARCHIVE",
    "BlobSlot",
    "blob_member",
    "blob_digest",
    "member_header",
    "padding",
    "layout",
    "write_tar",
    "TarMember",
    "TarFormatError",
    "iter_tar",
    "open_archive_stream",
    "read_manifest_member",
    "check_entry_count",
    "ReadAhead",
]

MANIFEST_MEMBER = "manifest.json"
BLOB_PREFIX = "blobs/"
MAX_MANIFEST_BYTES = 256 << 20
BLOCK = 512
REGULAR = "0"
END_OF_ARCHIVE = b"\0" * (2 * BLOCK)
_MAX_META_BYTES = 1 << 20
_READ_BYTES = 1 << 20


# -- writing ---------------------------------------------------------------------------


def blob_member(digest: str) -> str:
    """The member name of a blob: ``blobs/<sha256>``."""
    return BLOB_PREFIX + digest


def blob_digest(name: str) -> str | None:
    """The digest a member name ``blobs/<sha256>`` stands for; None for any other name."""
    if not name.startswith(BLOB_PREFIX):
        return None
    digest = name[len(BLOB_PREFIX) :]
    return digest if is_digest(digest) else None


def member_header(name: str, size: int) -> bytes:
    """The header block(s) of a regular-file member of ``size`` bytes (see module docstring)."""
    info = tarfile.TarInfo(name)
    info.size = size
    info.mode = 0o644
    info.mtime = 0
    info.type = tarfile.REGTYPE
    return info.tobuf(format=tarfile.PAX_FORMAT, encoding="utf-8", errors="strict")


def padding(size: int) -> bytes:
    """The zero bytes that follow a member of ``size`` bytes up to the next block."""
    return b"\0" * (-size % BLOCK)


@dataclass(frozen=True)
class BlobSlot:
    """Where a blob's bytes go in the tar: exactly ``size_bytes`` uncompressed bytes."""

    digest: str
    size_bytes: int


def layout(manifest_json: bytes, blobs: Iterable[tuple[str, int]]) -> Iterator[bytes | BlobSlot]:
    """The tar of an archive in order: bytes to write as they are, and a ``BlobSlot`` where
    the writer puts that blob's bytes. ``blobs`` are (digest, size in bytes) pairs; a digest
    given twice is written once."""
    yield (
        member_header(MANIFEST_MEMBER, len(manifest_json))
        + manifest_json
        + padding(len(manifest_json))
    )
    seen: set[str] = set()
    for digest, size in blobs:
        if digest in seen:
            continue
        seen.add(digest)
        yield member_header(blob_member(digest), size)
        yield BlobSlot(digest, size)
        if size % BLOCK:
            yield padding(size)
    yield END_OF_ARCHIVE


def write_tar(
    sink: Any,
    *,
    manifest_json: bytes,
    blobs: Iterable[tuple[str, int]],
    open_blob: Callable[[str], BinaryIO],
    chunk_bytes: int = _READ_BYTES,
) -> None:
    """Write the uncompressed tar of an archive to ``sink`` (anything with ``write``).

    ``open_blob(digest)`` gives a blob's uncompressed bytes; a blob shorter than its
    declared size raises ``BlobMissing`` (the tar would be corrupt), a longer one is cut
    at the declared size as ``tarfile`` does.
    """
    for piece in layout(manifest_json, blobs):
        if isinstance(piece, bytes):
            sink.write(piece)
            continue
        left = piece.size_bytes
        with open_blob(piece.digest) as blob:
            while left > 0:
                chunk = blob.read(min(left, chunk_bytes))
                if not chunk:
                    raise BlobMissing(
                        f"blob {piece.digest} ends {left} bytes short of its declared "
                        f"{piece.size_bytes}",
                        extra={"missing": [piece.digest]},
                    )
                sink.write(chunk)
                left -= len(chunk)


# -- reading ---------------------------------------------------------------------------


class TarFormatError(ValueError):
    """A tar stream that is truncated or malformed."""


@dataclass
class TarMember:
    """One member: its name, type flag (``"0"`` regular), declared size, and its bytes."""

    name: str
    type: str
    size: int
    _reader: _MemberReader

    def isreg(self) -> bool:
        return self.type == REGULAR

    @property
    def stream(self) -> _MemberReader:
        return self._reader


def _read_exact(stream: BinaryIO, n: int) -> bytes:
    data = stream.read(n)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = stream.read(n - got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


class _MemberReader:
    """Reads at most ``size`` bytes of one member from the shared stream."""

    def __init__(self, stream: BinaryIO, size: int) -> None:
        self._stream = stream
        self.remaining = size

    def read(self, n: int = -1) -> bytes:
        if self.remaining <= 0 or n == 0:
            return b""
        if n < 0 or n > self.remaining:
            n = self.remaining
        data = self._stream.read(min(n, _READ_BYTES) if n > 0 else 0)
        if not data:
            raise TarFormatError("tar stream ends inside a member")
        self.remaining -= len(data)
        return data

    def drain(self) -> None:
        while self.remaining > 0:
            self.read(_READ_BYTES)


def _field(header: bytes, start: int, length: int) -> bytes:
    return header[start : start + length].split(b"\0", 1)[0]


def _number(raw: bytes) -> int:
    if raw and raw[0] & 0x80:  # GNU base-256 for big values
        value = int.from_bytes(raw[1:], "big")
        return value
    text = raw.split(b"\0", 1)[0].strip(b" \0")
    try:
        return int(text, 8) if text else 0
    except ValueError as exc:
        raise TarFormatError(f"bad number {raw!r} in tar header") from exc


def _parse_pax(data: bytes) -> dict[str, str]:
    records: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        space = data.find(b" ", pos)
        if space < 0:
            raise TarFormatError("bad PAX record")
        try:
            length = int(data[pos:space])
        except ValueError as exc:
            raise TarFormatError("bad PAX record length") from exc
        if length <= 0 or pos + length > len(data):
            raise TarFormatError("bad PAX record length")
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        records[key.decode("utf-8", "replace")] = value.decode("utf-8", "surrogateescape")
        pos += length
    return records


def _pad_bytes(size: int) -> int:
    return (-size) % BLOCK


def iter_tar(stream: BinaryIO) -> Iterator[TarMember]:
    """Yield the members of an uncompressed tar stream; unread member bytes are skipped."""
    pending_name: str | None = None
    pending_size: int | None = None
    while True:
        header = _read_exact(stream, BLOCK)
        if not header:
            return  # end of stream without the zero blocks: accepted, like tar does
        if len(header) < BLOCK:
            raise TarFormatError("tar stream ends inside a header")
        if header == b"\0" * BLOCK:
            return
        checksum = _number(header[148:156])
        actual = sum(header[:148]) + 8 * 32 + sum(header[156:])
        if checksum != actual:
            raise TarFormatError("tar header checksum mismatch")
        kind = chr(header[156]) if header[156] else REGULAR
        size = _number(header[124:136])
        if kind in ("x", "g", "L"):
            if size > _MAX_META_BYTES:
                raise TarFormatError(f"tar metadata member of {size} bytes")
            data = _read_exact(stream, size + _pad_bytes(size))[:size]
            if len(data) < size:
                raise TarFormatError("tar stream ends inside a metadata member")
            if kind == "x":
                records = _parse_pax(data)
                if "path" in records:
                    pending_name = records["path"]
                if "size" in records:
                    try:
                        pending_size = int(records["size"])
                    except ValueError as exc:
                        raise TarFormatError("bad PAX size") from exc
            elif kind == "L":
                pending_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = _field(header, 0, 100).decode("utf-8", "surrogateescape")
        if header[257:262] == b"ustar":
            prefix = _field(header, 345, 155).decode("utf-8", "surrogateescape")
            if prefix:
                name = f"{prefix}/{name}"
        if pending_name is not None:
            name = pending_name
        if pending_size is not None:
            size = pending_size
        pending_name = pending_size = None
        if kind not in (REGULAR, "7"):  # "7" (contiguous) is a regular file too
            size_of_data = size if kind not in ("1", "2", "3", "4", "5", "6") else 0
            yield TarMember(name, kind, size, _MemberReader(stream, 0))
            _skip(stream, size_of_data + _pad_bytes(size_of_data))
            continue
        reader = _MemberReader(stream, size)
        yield TarMember(name, REGULAR, size, reader)
        reader.drain()
        _skip(stream, _pad_bytes(size))


def _skip(stream: BinaryIO, n: int) -> None:
    while n > 0:
        data = stream.read(min(n, _READ_BYTES))
        if not data:
            raise TarFormatError("tar stream ends inside a member")
        n -= len(data)


def open_archive_stream(fh: BinaryIO, *, read_bytes: int = _READ_BYTES) -> BinaryIO:
    """The uncompressed tar of a compressed archive read from ``fh``, decompressed across
    frames in a background thread (``ReadAhead``)."""
    reader = zstandard.ZstdDecompressor().stream_reader(
        fh, read_size=read_bytes, closefd=False, read_across_frames=True
    )
    return ReadAhead(reader)  # type: ignore[arg-type, return-value]


def read_manifest_member(stream: BinaryIO, *, source: str) -> Manifest:
    """Read the first member of an uncompressed tar stream; it must be ``manifest.json``.

    The stream is left at the next member's header (``iter_tar`` reads the blobs on).

    Raises ``UnsupportedFormat`` for anything that is not an archive, and
    ``InvalidManifest`` for a manifest over ``MAX_MANIFEST_BYTES`` or ``MAX_FILES``.
    """
    try:
        member = next(iter_tar(stream), None)
        if member is None or member.name != MANIFEST_MEMBER or not member.isreg():
            raise UnsupportedFormat(
                f"{source}: the first member is not a regular {MANIFEST_MEMBER}"
            )
        if member.size > MAX_MANIFEST_BYTES:
            raise InvalidManifest(
                f"{source}: {MANIFEST_MEMBER} is {member.size} bytes, over {MAX_MANIFEST_BYTES}"
            )
        data = _read_all(member.stream, member.size)
        _skip(stream, _pad_bytes(member.size))  # at the next header: blobs read on from here
    except (TarFormatError, zstandard.ZstdError) as exc:
        raise UnsupportedFormat(f"{source} is not a cachekeeper archive: {exc}") from exc
    check_entry_count(data, source=source)
    return Manifest.from_json(data)


def check_entry_count(data: bytes, *, source: str, max_files: int = MAX_FILES) -> None:
    """Refuse a manifest listing more than ``max_files`` files before parsing it.

    Counting the ``"digest"`` keys is a scan of the bytes; parsing first would build
    millions of objects for a hostile manifest. (A key spelled with JSON escapes slips
    past this count, and is then refused by ``Manifest.from_dict`` after parsing, which
    the byte limit bounds.)
    """
    listed = data.count(b'"digest"')
    if listed > max_files:
        raise InvalidManifest(
            f"{source}: manifest lists about {listed} files, over the limit of {max_files}"
        )


def _read_all(reader: _MemberReader, size: int) -> bytes:
    parts = []
    while chunk := reader.read(size):
        parts.append(chunk)
    return b"".join(parts)


class ReadAhead(io.RawIOBase):
    """A reader that pulls ``source`` in a background thread, ``depth`` chunks ahead.

    zstandard (and socket reads) release the GIL, so decompressing the next megabytes
    overlaps with hashing and writing the current ones, as ``zstd -d | tar -x`` overlaps
    its two processes. Errors in the background read are raised by the next ``read``.
    """

    def __init__(self, source: BinaryIO, *, chunk_bytes: int = 1 << 20, depth: int = 16) -> None:
        super().__init__()
        self._source = source
        self._chunk_bytes = chunk_bytes
        self._queue: queue.Queue[bytes | BaseException] = queue.Queue(maxsize=depth)
        self._buffer = b""
        self._offset = 0
        self._eof = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, name="ck-read-ahead", daemon=True)
        self._thread.start()

    def _fill(self) -> None:
        try:
            while not self._stop.is_set():
                chunk = self._source.read(self._chunk_bytes)
                self._put(chunk)
                if not chunk:
                    return
        except BaseException as exc:  # handed to the reader, raised there
            self._put(exc)

    def _put(self, item: bytes | BaseException) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def readable(self) -> bool:
        return True

    def _next(self) -> bool:
        item = self._queue.get()
        if isinstance(item, BaseException):
            self._eof = True
            raise item
        if not item:
            self._eof = True
            return False
        self._buffer, self._offset = item, 0
        return True

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            parts = [self._buffer[self._offset :]]
            self._buffer, self._offset = b"", 0
            while not self._eof and self._next():
                parts.append(self._buffer)
                self._buffer, self._offset = b"", 0
            return b"".join(parts)
        parts = []
        wanted = size
        while wanted > 0:
            if self._offset >= len(self._buffer):
                if self._eof or not self._next():
                    break
            piece = self._buffer[self._offset : self._offset + wanted]
            self._offset += len(piece)
            wanted -= len(piece)
            parts.append(piece)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        self._stop.set()
        super().close()
