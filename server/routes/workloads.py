"""``/v1/workloads``: register workload TOML files (validated like the CLI does) for agents."""

from __future__ import annotations

import hashlib
from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from cachekeeper.builder.workload import parse_workload
from cachekeeper.errors import Forbidden, InsufficientStorage, WorkloadInvalid, WorkloadNotFound
from cachekeeper.server.auth import AdminScope, ReadScope, WriteScope
from cachekeeper.server.deps import ServicesDep, read_body, services_of
from cachekeeper.server.responses import error_responses
from cachekeeper.server.services import Services
from cachekeeper.wire import WorkloadInfo, WorkloadList

__all__ = ["router"]

router = APIRouter(prefix="/v1/workloads", tags=["workloads"])

WorkloadName = Annotated[
    str, Path(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", description="the workload's name")
]


@router.get("", response_model=WorkloadList)
def list_workloads(services: ServicesDep, _: ReadScope) -> dict[str, Any]:
    """Every registered workload."""
    return {"workloads": [asdict(w) for w in services.workloads.list_all()]}


def _register(services: Services, name: str, body: bytes, *, scope: str) -> dict[str, Any]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadInvalid(f"workload {name!r} is not UTF-8 text") from exc
    workload = parse_workload(text, source=name)
    if workload.name != name:
        raise WorkloadInvalid(f"workload file names itself {workload.name!r}, not {name!r}")
    code = workload.code
    if code and scope != "admin":
        # A command or an import path is code that every agent would run (docs/security.md).
        first = code[0]
        raise Forbidden(
            f"workload {name!r} holds code a builder would run ({first.where} = "
            f"{first.value!r}): registering it needs the 'admin' scope; the token has {scope!r}",
            extra={"scope": "admin", "granted": scope},
        )
    digest = hashlib.sha256(body).hexdigest()
    return asdict(services.workloads.put(name=name, toml=text, digest=digest))


_TOML_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "application/toml": {"schema": {"type": "string"}},
            "text/plain": {"schema": {"type": "string"}},
        },
    }
}


@router.put(
    "/{name}",
    response_model=WorkloadInfo,
    openapi_extra=_TOML_BODY,
    responses=error_responses(WorkloadInvalid, Forbidden, InsufficientStorage),
)
async def put_workload(name: WorkloadName, request: Request, scope: WriteScope) -> dict[str, Any]:
    """Register or replace a workload; the TOML must parse and name itself ``name``.

    A workload with a ``[[command]]``, an ``[[entrypoint]]`` or a mask/score factory
    (``pkg.mod:attr``) is code that agents run: registering it needs the admin scope.
    """
    services = services_of(request)
    body = await read_body(request, limit=services.settings.max_workload_bytes, what="workload")
    return await run_in_threadpool(_register, services, name, body, scope=scope)


@router.get(
    "/{name}",
    response_class=Response,
    responses={200: {"content": {"application/toml": {}}}, **error_responses(WorkloadNotFound)},
)
def get_workload(name: WorkloadName, services: ServicesDep, _: ReadScope) -> Response:
    """The workload's TOML text as registered."""
    return Response(services.workloads.toml(name), media_type="application/toml")


@router.delete(
    "/{name}",
    status_code=204,
    response_class=Response,
    responses=error_responses(WorkloadNotFound),
)
def delete_workload(name: WorkloadName, services: ServicesDep, _: AdminScope) -> Response:
    """Unregister a workload (its snapshots stay)."""
    services.workloads.delete(name)
    return Response(status_code=204)
