"""API fuzzing with auth on: every operation of the OpenAPI schema, driven by
schemathesis' strategies through hypothesis (its pytest plugin does not load under
pytest 9), against a live server with tokens configured. No 5xx anywhere; every route
that needs a scope answers 401 without a token and 403 with a weaker one, whatever the
rest of the request holds. (tests/server/test_schema_fuzz.py covers auth off.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.live_server import LiveServer, start_server

TOKENS = {"r-token": "read", "w-token": "write", "a-token": "admin"}
WEAKER = {"write": "r-token", "admin": "w-token"}
EXAMPLES = 8


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    from cachekeeper.server.settings import Settings

    data = tmp_path_factory.mktemp("auth-fuzz")
    handle = start_server(Settings(data_dir=data, tokens=TOKENS))
    try:
        yield handle
    finally:
        handle.stop()


def _scopes(app: Any) -> dict[tuple[str, str], str | None]:
    """(METHOD, path) -> the scope its dependencies require (None: public)."""
    out: dict[tuple[str, str], str | None] = {}
    for top in app.routes:
        router = getattr(top, "original_router", None)  # an included router (FastAPI 0.12x)
        prefix = top.include_context.prefix if router is not None else ""
        for route in router.routes if router is not None else [top]:
            dependant = getattr(route, "dependant", None)
            if dependant is None:
                continue
            names = [getattr(d.call, "__name__", "") for d in dependant.dependencies]
            scope = next((n[len("require_") :] for n in names if n.startswith("require_")), None)
            # OpenAPI names a path parameter {key}; the route may match it as {key:path}
            path = re.sub(r"\{(\w+):\w+\}", r"{\1}", prefix + route.path)
            for method in route.methods:
                out[(method, path)] = scope
    return out


def _fuzz(operation: Any, headers: dict[str, str], check: Any) -> None:
    @given(case=operation.as_strategy())
    @settings(
        max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def run(case: schemathesis.Case) -> None:
        case.headers = {**(case.headers or {}), **headers}
        if not headers:
            (case.headers or {}).pop("Authorization", None)
        response = case.call(timeout=30)
        assert response.status_code < 500, (case.method, case.formatted_path, response.text[:300])
        check(response)

    run()


def test_every_route_needs_its_scope_and_never_answers_5xx(
    secured: LiveServer, reliability
) -> None:
    schema = schemathesis.openapi.from_url(f"{secured.url}/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    scopes = _scopes(secured.app)
    guarded = 0
    for operation in operations:
        scope = scopes[(operation.method.upper(), operation.path)]
        if scope is None:
            _fuzz(operation, {}, lambda r: None)
            continue
        guarded += 1
        _fuzz(operation, {}, lambda r: _expect(r, 401, "unauthorized"))
        _fuzz(
            operation,
            {"Authorization": "Bearer not-a-token"},
            lambda r: _expect(r, 401, "unauthorized"),
        )
        if scope in WEAKER:
            _fuzz(
                operation,
                {"Authorization": f"Bearer {WEAKER[scope]}"},
                lambda r: _expect(r, 403, "forbidden"),
            )
        _fuzz(operation, {"Authorization": "Bearer a-token"}, lambda r: None)
    assert guarded >= 15
    reliability.record(
        f"fuzzed requests without a token or with an unknown one, {guarded} guarded routes "
        f"({EXAMPLES} examples each): 401",
        tries=guarded * 2 * EXAMPLES,
        outcome="refused",
        area="API fuzzing",
    )
    weaker = sum(1 for op in operations if scopes[(op.method.upper(), op.path)] in WEAKER)
    reliability.record(
        f"fuzzed requests with a too-weak token, {weaker} write/admin routes: 403",
        tries=weaker * EXAMPLES,
        outcome="refused",
        area="API fuzzing",
    )
    reliability.record(
        f"fuzzed requests with an admin token, all {len(operations)} operations: no 5xx",
        tries=len(operations) * EXAMPLES,
        outcome="kept",
        area="API fuzzing",
    )


def _expect(response: Any, status: int, code: str) -> None:
    assert response.status_code == status, (
        response.request.url,
        response.status_code,
        response.text[:200],
    )
    assert response.json()["error"] == code
