"""The per-key tier's wire format: RESP2/RESP3 replies, and commands read within bounds.

``server/resp/listener.py`` serves the commands; this module only turns bytes into arguments and
replies into bytes, so what one command may cost is decided here, before a handler runs:

- **Frame limits.** A command holds at most ``FrameLimits.max_args`` arguments and
  ``FrameLimits.command_bytes`` of them in memory (besides a SET's value, which the
  caller's ``keep`` admits into its own budget). Before auth the limits are strict, as
  Redis's (``unauthenticated bulk length``): a frame over them is a protocol error and the
  connection closes before its bytes are read. After auth an argument over them is read
  and dropped (``Dropped``), so the connection stays in step and the handler answers.
- **Not RESP.** Binary noise, a TLS hello, a bulk without its CRLF: ``ProtocolError``.
- **HTTP.** A command named ``POST`` or ``Host:``, or an inline line that is an HTTP request
  line (``PUT / HTTP/1.1``), is ``CrossProtocol``: the connection closes without a reply,
  as Redis does, so a web page cannot make a browser speak to the tier (a form's
  ``text/plain`` body is a list of inline commands).

Reading a command is split in two (``next_byte``, ``read_rest``) so that the listener can
wait for a command's first byte under one timeout (idle, or the auth deadline) and for
the rest of it under another (the frame timeout).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "LINE_BYTES",
    "CrossProtocol",
    "Dropped",
    "FrameLimits",
    "ProtocolError",
    "Reply",
    "bulk",
    "bulk_parts",
    "error",
    "expiry_problem",
    "integer",
    "map_reply",
    "next_byte",
    "nil",
    "read_rest",
    "simple",
]

LINE_BYTES = 16 << 10  # an inline command or a header line; the reader's buffer limit
_DISCARD_CHUNK = 1 << 20
_CRLF = b"\r\n"
_HTTP_NAMES = (b"POST", b"HOST:")
_EXPIRY = re.compile(rb"-?\d{1,18}")


class ProtocolError(Exception):
    """The client sent something that is not RESP (the connection is closed)."""


class CrossProtocol(ProtocolError):
    """The client sent an HTTP request (the connection is closed without a reply)."""


@dataclass(frozen=True)
class Dropped:
    """An argument whose bytes were read and discarded (too long to keep)."""

    length: int


@dataclass(frozen=True)
class FrameLimits:
    """What one command may hold: ``max_args`` arguments, ``command_bytes`` of them in
    memory besides a value its ``keep`` admits; ``strict``: over either, the frame is a
    protocol error before its bytes are read (before auth), else the argument is dropped."""

    max_args: int
    command_bytes: int
    strict: bool


# -- encoding -----------------------------------------------------------------------------


def simple(text: str) -> bytes:
    return b"+" + text.encode() + _CRLF


def error(text: str) -> bytes:
    return b"-" + text.replace("\r", " ").replace("\n", " ").encode() + _CRLF


def bulk(value: bytes) -> bytes:
    return b"".join(bulk_parts(value))


def bulk_parts(value: bytes) -> tuple[bytes, bytes, bytes]:
    return b"$%d\r\n" % len(value), value, _CRLF


# A reply is its bytes, or for a value the server sends as it holds it, its parts: a GET's
# value (megabytes) goes out as (header, value, CRLF) through ``writelines`` and is never
# copied into a reply (Python 3.12's transport sends the parts with one sendmsg).
Reply = bytes | tuple[bytes, ...]


def integer(value: int) -> bytes:
    return b":%d\r\n" % value


def nil(proto: int) -> bytes:
    return b"_\r\n" if proto == 3 else b"$-1\r\n"


def map_reply(pairs: list[tuple[str, Any]], proto: int) -> bytes:
    """A map in RESP3, its flattened array in RESP2 (HELLO's answer)."""
    out = [b"%" + str(len(pairs)).encode() + _CRLF if proto == 3 else b"*%d\r\n" % (2 * len(pairs))]
    for key, value in pairs:
        out.append(bulk(key.encode()))
        if isinstance(value, int):
            out.append(integer(value))
        elif isinstance(value, list):
            out.append(b"*0\r\n")
        else:
            out.append(bulk(str(value).encode()))
    return b"".join(out)


# -- decoding -----------------------------------------------------------------------------


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        line = await reader.readuntil(_CRLF)
    except asyncio.IncompleteReadError as exc:
        raise ProtocolError("unexpected end of stream") from exc
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError("line too long") from exc
    return line[:-2]


async def next_byte(reader: asyncio.StreamReader) -> bytes | None:
    """The first byte of the next command, or None at the end of the stream."""
    try:
        return await reader.readexactly(1)
    except asyncio.IncompleteReadError:
        return None


def _inline(line: bytes, limits: FrameLimits, keep: Callable[[list[Any], int], bool]) -> list[Any]:
    if not line.strip():
        return []
    args = list(line.split())  # an inline command (telnet, redis-cli -x), within LINE_BYTES
    if args[0].upper() in _HTTP_NAMES or (len(args) == 3 and args[2].startswith(b"HTTP/")):
        raise CrossProtocol("an HTTP request")
    if len(args) > limits.max_args:
        raise ProtocolError("too many arguments")
    for i, arg in enumerate(args):  # as for a multibulk: the caller may take a value
        keep(args[:i], len(arg))
    return args


async def read_rest(
    reader: asyncio.StreamReader,
    first: bytes,
    *,
    limits: FrameLimits,
    keep: Callable[[list[Any], int], bool],
) -> list[Any]:
    """The command that ``first`` began, as a list of bytes (``Dropped`` for an argument
    over ``limits``). ``keep(args so far, length)`` says whether the caller takes the next
    bulk into its own budget (a SET's value); it is asked before the bulk's bytes are read.
    Raises ProtocolError on anything that is not RESP or, with strict limits, over them."""
    if first != b"*" and not (first.isalpha() or first in b"\r\n"):
        # not RESP (a TLS hello, binary noise): say so now rather than wait for a CRLF
        raise ProtocolError(f"unexpected byte {first!r}")
    if first in b"\r\n":  # a blank line between inline commands
        return []
    line = first + await _line(reader)
    if not line.startswith(b"*"):
        return _inline(line, limits, keep)
    try:
        count = int(line[1:])
    except ValueError as exc:
        raise ProtocolError("invalid multibulk length") from exc
    if not 0 <= count <= limits.max_args:
        unauthenticated = "unauthenticated " if limits.strict and count > 0 else ""
        raise ProtocolError(f"{unauthenticated}invalid multibulk length")
    args: list[Any] = []
    left = limits.command_bytes
    for _ in range(count):
        header = await _line(reader)
        if not header.startswith(b"$"):
            raise ProtocolError(f"expected '$', got {bytes(header)[:1]!r}")
        try:
            length = int(header[1:])
        except ValueError as exc:
            raise ProtocolError("invalid bulk length") from exc
        if not 0 <= length <= (1 << 32):
            raise ProtocolError("invalid bulk length")
        if limits.strict and length > left:
            raise ProtocolError("unauthenticated bulk length")
        try:
            if keep(args, length):
                args.append(await _exactly(reader, length))
            elif length <= left:
                args.append(await _exactly(reader, length))
                left -= length
            else:
                await _discard(reader, length)
                args.append(Dropped(length))
        except asyncio.IncompleteReadError as exc:
            raise ProtocolError("unexpected end of stream") from exc
        if len(args) == 1 and isinstance(args[0], bytes) and args[0].upper() in _HTTP_NAMES:
            raise CrossProtocol("an HTTP request")
    return args


async def _exactly(reader: asyncio.StreamReader, length: int) -> bytes:
    data = await reader.readexactly(length)
    if await reader.readexactly(2) != _CRLF:
        raise ProtocolError("bulk not terminated by CRLF")
    return data


async def _discard(reader: asyncio.StreamReader, length: int) -> None:
    left = length + 2
    while left:
        left -= len(await reader.readexactly(min(left, _DISCARD_CHUNK)))


def expiry_problem(options: list[Any]) -> str | None:
    """Why SET's options are not ``EX s`` or ``PX ms`` (Redis's error text), or None."""
    if not options:
        return None
    if (
        len(options) != 2
        or not all(isinstance(o, bytes) for o in options)
        or options[0].upper() not in (b"EX", b"PX")
    ):
        return "ERR syntax error (the per-key tier takes SET key value [EX s|PX ms])"
    if _EXPIRY.fullmatch(options[1]) is None:
        return "ERR value is not an integer or out of range"
    if int(options[1]) <= 0:
        return "ERR invalid expire time in 'set' command"
    return None
