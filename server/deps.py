"""What the routers share: dependencies as ``Annotated`` aliases (FastAPI's template style),
and reading a bounded request body."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from cachekeeper.errors import PayloadTooLarge

from .metrics import Metrics
from .services import Services
from .settings import Settings

__all__ = [
    "ServicesDep",
    "SettingsDep",
    "MetricsDep",
    "services_of",
    "metrics_of",
    "read_body",
]


def services_of(request: Request) -> Services:
    return request.app.state.services  # type: ignore[no-any-return]


def metrics_of(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


def settings_of(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(services_of)]
MetricsDep = Annotated[Metrics, Depends(metrics_of)]
SettingsDep = Annotated[Settings, Depends(settings_of)]


async def read_body(request: Request, *, limit: int, what: str) -> bytes:
    """The whole request body, refusing (413) more than ``limit`` bytes before reading it all."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and (len(length) > 19 or int(length) > limit):
        raise PayloadTooLarge(f"{what} of {length} bytes is over the limit of {limit} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(f"{what} is over the limit of {limit} bytes")
    return bytes(body)
