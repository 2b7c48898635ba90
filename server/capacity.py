"""The store's hard cap (``max_store_bytes``) against what uploads add: ``StoreRoom``.

Blob uploads (``PUT /v1/blobs/{digest}``, ``server/routes/blobs.py``) reserve room as their
bytes arrive, through one ``Reservation`` each, and are refused (507
``insufficient_storage``) the moment the stored bytes plus what every upload in flight
has received would pass the cap. Eviction is never an upload's doing: it is GC's, an
admin's decision (``server/resources/gc.py``). The request bounds (sizes, idle time, the JSON
screen) are ``server/limits.py``'s.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator

from fastapi import FastAPI

from cachekeeper.errors import InsufficientStorage

from .settings import Settings

__all__ = ["Reservation", "StoreRoom", "store_room"]


class StoreRoom:
    """The store's hard cap (``max_store_bytes``), kept against the bytes uploads really send.

    An upload reserves room as its bytes arrive and is refused (507) the moment the stored
    bytes plus what every upload in flight has received would pass the cap; its temp file
    is removed, so nothing is half-written. Received bytes are counted: a zstd-encoded body
    (what the client sends) counts about what it takes at rest, an identity body its full
    size. A declared ``Content-Length`` that cannot fit is refused before a byte is read. An
    upload never evicts anything: eviction is GC's (an admin's) decision.
    """

    def __init__(self, *, settings: Settings, stored_bytes: Callable[[], int]) -> None:
        self._settings = settings
        self._stored_bytes = stored_bytes
        self._lock = threading.Lock()
        self._in_flight = 0  # bytes received by uploads not finished yet
        self._landed = 0  # bytes of uploads finished since start (stored_bytes lags them)

    def open(self, *, declared_bytes: int) -> Reservation:
        """A reservation for one upload; InsufficientStorage if ``declared_bytes`` cannot fit."""
        cap = self._settings.max_store_bytes
        with self._lock:
            mark = self._landed
        base = self._stored_bytes() if cap is not None else 0
        reservation = Reservation(self, cap_bytes=cap, base_bytes=base, mark=mark)
        reservation.check(declared_bytes)
        return reservation

    def _reserve(self, reservation: Reservation, n: int, *, keep: bool) -> None:
        """Check that ``n`` more bytes fit (InsufficientStorage if not); ``keep`` takes them."""
        with self._lock:
            if reservation.cap_bytes is not None:
                used = reservation.base_bytes + (self._landed - reservation.mark) + self._in_flight
                if used + n > reservation.cap_bytes:
                    raise _full(reservation.cap_bytes, used, n)
            if keep:
                self._in_flight += n
                reservation.taken_bytes += n

    def _close(self, reservation: Reservation, *, landed_bytes: int) -> None:
        with self._lock:
            self._in_flight -= reservation.taken_bytes
            self._landed += landed_bytes
            reservation.taken_bytes = 0


def _full(cap: int, used: int, incoming: int) -> InsufficientStorage:
    return InsufficientStorage(
        f"the store is full: {used} of its {cap} bytes are used or being uploaded, and this"
        f" upload needs {incoming} more; an admin frees room with GC"
        " (POST /v1/gc evicts least recently used unpinned snapshots down to the cap)"
    )


class Reservation:
    """One upload's share of the store's room; ``counted`` passes its bytes through."""

    def __init__(self, room: StoreRoom, *, cap_bytes: int | None, base_bytes: int, mark: int):
        self._room = room
        self.cap_bytes = cap_bytes
        self.base_bytes = base_bytes
        self.mark = mark
        self.taken_bytes = 0

    def check(self, n: int) -> None:
        """InsufficientStorage if ``n`` more bytes would not fit now (nothing is reserved)."""
        self._room._reserve(self, n, keep=False)

    def counted(self, chunks: Iterable[bytes]) -> Iterator[bytes]:
        """``chunks``, each reserved before it passes; InsufficientStorage past the cap."""
        for chunk in chunks:
            self._room._reserve(self, len(chunk), keep=True)
            yield chunk

    def close(self, *, stored_bytes: int) -> None:
        """Release the reservation; ``stored_bytes`` is what the upload added to the store."""
        self._room._close(self, landed_bytes=stored_bytes)


def store_room(app: FastAPI) -> StoreRoom:
    """The app's ``StoreRoom`` (one per app, made on first use)."""
    room: StoreRoom | None = getattr(app.state, "store_room", None)
    if room is None:
        services = app.state.services
        room = StoreRoom(settings=app.state.settings, stored_bytes=services.blobs.stored_bytes)
        app.state.store_room = room
    return room
