"""ReadAhead: the background-thread reader restore uses to overlap decompression with writes."""

from __future__ import annotations

import io
import random

import pytest

from cachekeeper.archive import ReadAhead


def test_returns_exactly_the_source_bytes_for_any_read_sizes() -> None:
    rng = random.Random(7)
    data = rng.randbytes(3_000_123)
    reader = ReadAhead(io.BytesIO(data), chunk_bytes=65_536, depth=3)
    out = bytearray()
    while True:
        piece = reader.read(rng.choice([1, 511, 512, 70_000, 1 << 20]))
        if not piece:
            break
        out += piece
    assert bytes(out) == data
    assert reader.read(10) == b""


def test_read_all_and_errors_reach_the_reader() -> None:
    assert ReadAhead(io.BytesIO(b"abc" * 1000), chunk_bytes=7).read() == b"abc" * 1000

    class Broken(io.RawIOBase):
        calls = 0

        def read(self, size: int = -1) -> bytes:
            self.calls += 1
            if self.calls > 2:
                raise ConnectionResetError("cut off mid-stream")
            return b"x" * size

    reader = ReadAhead(Broken(), chunk_bytes=4)  # type: ignore[arg-type]
    assert reader.read(8) == b"x" * 8
    with pytest.raises(ConnectionResetError, match="cut off"):
        reader.read(8)
