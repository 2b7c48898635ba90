"""Dependencies the routers share, as ``Annotated`` aliases (FastAPI's template style)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from .metrics import Metrics
from .settings import Settings
from .storage import Storage

__all__ = ["StorageDep", "SettingsDep", "MetricsDep", "storage_of", "metrics_of"]


def storage_of(request: Request) -> Storage:
    return request.app.state.storage  # type: ignore[no-any-return]


def metrics_of(request: Request) -> Metrics:
    return request.app.state.metrics  # type: ignore[no-any-return]


def settings_of(request: Request) -> Settings:
    return request.app.state.settings  # type: ignore[no-any-return]


StorageDep = Annotated[Storage, Depends(storage_of)]
MetricsDep = Annotated[Metrics, Depends(metrics_of)]
SettingsDep = Annotated[Settings, Depends(settings_of)]
