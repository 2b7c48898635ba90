"""Fuzz every operation of the generated OpenAPI schema against a live server: no 5xx."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.helpers.live_server import LiveServer

pytestmark = pytest.mark.slow  # fuzzes every route of the schema


def test_no_server_errors(live: LiveServer) -> None:
    """Bounded examples per operation (schemathesis' pytest plugin does not load under
    pytest 9, so hypothesis drives each operation's strategy here)."""
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 17

    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(
            max_examples=20,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def check(case: schemathesis.Case) -> None:
            response = case.call(timeout=30)
            label = f"{case.method} {case.formatted_path}"
            assert response.status_code < 500, (label, response.text[:500])
            if response.status_code >= 400:  # every error answers {"error", "detail"}
                body = response.json()
                assert isinstance(body.get("error"), str) and "detail" in body, (label, body)

        check()

    scraped = httpx.get(f"{live.url}/metrics").text.splitlines()
    answered = sum(
        float(line.rsplit(" ", 1)[1])
        for line in scraped
        if line.startswith("cachekeeper_http_requests_total{")
    )
    assert answered >= 5 * len(operations)  # the fuzzing really reached the server


def test_openapi_lists_the_contract(live: LiveServer) -> None:
    paths = httpx.get(f"{live.url}/openapi.json").json()["paths"]
    for path in (
        "/v1/resolve",
        "/v1/blobs/missing",
        "/v1/blobs/{digest}",
        "/v1/snapshots",
        "/v1/snapshots/{snapshot_id}",
        "/v1/snapshots/{snapshot_id}/archive",
        "/v1/snapshots/{snapshot_id}/pin",
        "/v1/workloads",
        "/v1/workloads/{name}",
        "/v1/gc",
    ):
        assert path in paths
