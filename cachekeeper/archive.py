"""A minimal streaming tar reader for snapshot streams: fast, strict, non-seekable safe.

``tarfile`` in stream mode (``"r|"``) re-slices its buffer on every read, which cost
~1 s per 350 MB in the restore benchmark (as much as zstd decompression itself). A
snapshot stream holds only regular-file members with short names, so this reader parses
ustar headers itself (with PAX ``x`` records and GNU ``L`` long names, as ``tarfile``
may write them), checks each header's checksum, and hands out each member's bytes
straight from the underlying stream in large reads.

It never touches the filesystem; the caller decides what a member name means, and gets
the member's type so that links and devices can be refused.
"""

from __future__ import annotations

import io
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

__all__ = ["TarMember", "TarFormatError", "iter_tar", "REGULAR", "ReadAhead"]

BLOCK = 512
REGULAR = "0"
_MAX_META_BYTES = 1 << 20
_READ_BYTES = 1 << 20


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


def _padding(size: int) -> int:
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
            data = _read_exact(stream, size + _padding(size))[:size]
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
            _skip(stream, size_of_data + _padding(size_of_data))
            continue
        reader = _MemberReader(stream, size)
        yield TarMember(name, REGULAR, size, reader)
        reader.drain()
        _skip(stream, _padding(size))


def _skip(stream: BinaryIO, n: int) -> None:
    while n > 0:
        data = stream.read(min(n, _READ_BYTES))
        if not data:
            raise TarFormatError("tar stream ends inside a member")
        n -= len(data)


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
