"""Loopback ports for servers the tests and benchmarks start (stdlib only)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    """A loopback port free right now: nothing listens on it, and a server started a moment
    later can bind it (or a client can count on a refused connection)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
