"""Raw RESP on loopback, for the tests of the tier's listener: what an attacker sends.

    sock = connect(port)                      # optionally from another loopback address
    sock.sendall(command(b"AUTH", b"tok"))
    replies(sock, 1)                          # [b"+OK"]
    closed(sock, wait_s=2)                    # True once the server closed it

redis-py (tests/helpers/redis_py.py) is what real nodes run; this is what they never send.
"""

from __future__ import annotations

import socket
import time

__all__ = ["closed", "command", "connect", "replies", "send_for"]


def command(*parts: bytes) -> bytes:
    """One multibulk command."""
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


def connect(port: int, *, source: str | None = None, timeout_s: float = 5.0) -> socket.socket:
    """A TCP connection to 127.0.0.1:``port``, from ``source`` (another 127.x address, so
    the server sees another peer) when given."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.settimeout(timeout_s)
    if source is not None:
        sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def replies(sock: socket.socket, count: int, *, timeout_s: float = 5.0) -> list[bytes]:
    """The next ``count`` reply lines (simple strings, errors, bulk headers with their
    value joined), or fewer when the server closes first."""
    sock.settimeout(timeout_s)
    buffer = b""
    out: list[bytes] = []
    while len(out) < count:
        while b"\r\n" not in buffer:
            chunk = sock.recv(65536)
            if not chunk:
                return out
            buffer += chunk
        line, buffer = buffer.split(b"\r\n", 1)
        if line.startswith(b"$") and line != b"$-1":
            size = int(line[1:])
            while len(buffer) < size + 2:
                chunk = sock.recv(65536)
                if not chunk:
                    return out
                buffer += chunk
            line, buffer = line + b" " + buffer[:size], buffer[size + 2 :]
        out.append(line)
    return out


def closed(sock: socket.socket, *, wait_s: float) -> bool:
    """True when the server closes ``sock`` within ``wait_s`` (what it sent first is read
    and dropped); False when it is still open then."""
    deadline = time.monotonic() + wait_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if sock.recv(1 << 20) == b"":
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


def send_for(sock: socket.socket, data: bytes, *, seconds: float) -> int:
    """Send what of ``data`` the server takes within ``seconds`` (then stop, as a client
    that stalls); how many bytes went. A connection the server closed takes no more."""
    sent = 0
    deadline = time.monotonic() + seconds
    view = memoryview(data)
    while sent < len(data):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            sent += sock.send(view[sent : sent + (1 << 20)])
        except TimeoutError:
            break
        except OSError:
            break
    return sent
