"""docs/api.md's route table agrees with the app's OpenAPI schema and the error table.

The convention (stated at the top of docs/api.md): one row per route, ``METHOD /path``
(``POST/DELETE`` for two methods, path parameters named as in the schema, a ``?query``
ignored); the ``status`` column lists the success statuses; the ``errors`` column lists
``STATUS `code`, `code`; STATUS `code` ...`` for the route's own error answers, which the
route declares with ``responses=error_responses(...)`` (server/responses.py). The codes
any route can answer (COMMON below) are stated once in the doc, not per row.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from cachekeeper import wire
from cachekeeper.errors import ERRORS
from cachekeeper.server.app import create_app
from cachekeeper.server.settings import Settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
COMMON = {  # any route (server/responses.py); stated once at the top of docs/api.md
    "unauthorized",
    "forbidden",
    "invalid_request",
    "payload_too_large",
    "request_timeout",
    "server_error",
    "catalog_corrupt",
}
METHODS = {"GET", "POST", "PUT", "DELETE", "PATCH"}

Route = tuple[str, str]  # (method, path)


@dataclasses.dataclass(frozen=True)
class Claims:
    success: frozenset[int]
    errors: frozenset[tuple[int, str]]  # (status, code)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def doc_claims(text: str) -> dict[Route, Claims]:
    """The route table of docs/api.md: {(method, path): what the row claims}."""
    rows = [line for line in text.splitlines() if line.startswith("|")]
    header = _cells(rows[0])
    assert header[:2] == ["route", "scope"] and {"status", "errors"} <= set(header), header
    status_col, errors_col = header.index("status"), header.index("errors")
    out: dict[Route, Claims] = {}
    for line in rows[2:]:
        cells = _cells(line)
        found = re.fullmatch(r"`([A-Z/]+) (/[^`?]*)(\?[^`]*)?`", cells[0])
        assert found, f"docs/api.md: route cell {cells[0]!r} is not `METHOD /path`"
        success = frozenset(int(s) for s in re.findall(r"\b\d{3}\b", cells[status_col]))
        errors: set[tuple[int, str]] = set()
        for item in filter(None, (i.strip() for i in cells[errors_col].split(";"))):
            # "STATUS `code`, `code` prose": the codes are the leading list, the rest is prose
            found_item = re.match(r"(\d{3}) (`[a-z_0-9]+`(?:, `[a-z_0-9]+`)*)", item)
            assert found_item, f"docs/api.md {cells[0]}: {item!r} is not STATUS `code`, ..."
            codes = re.findall(r"`([a-z_0-9]+)`", found_item.group(2))
            errors |= {(int(found_item.group(1)), code) for code in codes}
        for method in found.group(1).split("/"):
            assert method in METHODS, f"docs/api.md: {method!r} in {cells[0]} is not a method"
            key = (method, found.group(2))
            assert key not in out, f"docs/api.md lists {key} twice"
            out[key] = Claims(success, frozenset(errors))
    return out


def schema_claims(schema: dict[str, Any]) -> dict[Route, Claims]:
    """The same, from the OpenAPI schema (error codes from each status' x-error-codes)."""
    out: dict[Route, Claims] = {}
    for path, operations in schema["paths"].items():
        for method, op in operations.items():
            responses = op.get("responses", {})
            success = frozenset(int(s) for s in responses if int(s) < 400)
            errors = frozenset(
                (int(s), code) for s, r in responses.items() for code in r.get("x-error-codes", ())
            )
            out[(method.upper(), path)] = Claims(success, errors)
    return out


def disagreements(doc: dict[Route, Claims], schema: dict[Route, Claims]) -> list[str]:
    problems = [f"{m} {p}: in the schema, not in docs/api.md" for m, p in schema.keys() - doc]
    problems += [f"{m} {p}: in docs/api.md, not in the schema" for m, p in doc.keys() - schema]
    for key in sorted(doc.keys() & schema.keys()):
        said, real, where = doc[key], schema[key], f"{key[0]} {key[1]}"
        if said.success != real.success:
            problems.append(
                f"{where}: docs say success {sorted(said.success)}, schema {sorted(real.success)}"
            )
        for status, code in sorted(said.errors - real.errors):
            problems.append(f"{where}: docs say {status} `{code}`, the route does not declare it")
        for status, code in sorted(real.errors - said.errors):
            if code not in COMMON:
                problems.append(f"{where}: the route declares {status} `{code}`, docs do not")
        for code in sorted({code for _status, code in said.errors | real.errors} - ERRORS.keys()):
            problems.append(f"{where}: `{code}` is not in cachekeeper/errors.py")
    return sorted(problems)


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    app = create_app(Settings(data_dir=tmp_path_factory.mktemp("api-doc") / "data"))
    return app.openapi()


def test_api_md_agrees_with_the_openapi_schema(schema: dict[str, Any]) -> None:
    problems = disagreements(doc_claims(DOC.read_text(encoding="utf-8")), schema_claims(schema))
    assert not problems, "docs/api.md and the app disagree:\n" + "\n".join(problems)


def test_the_check_catches_drift(schema: dict[str, Any]) -> None:
    """The comparison itself fails on a doc that names the wrong code, status or route."""
    text = DOC.read_text(encoding="utf-8")
    drifted = text.replace("404 `agent_not_found`", "404 `not_found`", 1)
    assert drifted != text
    problems = disagreements(doc_claims(drifted), schema_claims(schema))
    assert any("`not_found`" in p for p in problems), problems
    row = next(line for line in text.splitlines() if line.startswith("| `GET /healthz`"))
    problems = disagreements(doc_claims(text.replace(row + "\n", "")), schema_claims(schema))
    assert problems == ["GET /healthz: in the schema, not in docs/api.md"]


def test_common_codes_are_in_the_error_table() -> None:
    assert COMMON <= ERRORS.keys()
    text = DOC.read_text(encoding="utf-8")
    for code in COMMON:  # stated once at the top of the doc
        assert f"`{code}`" in text.split("| route |")[0], code


@pytest.mark.parametrize(("name", "shape"), [("SUMMARY", wire.Summary), ("AGENT", wire.AgentInfo)])
def test_shapes_named_in_the_doc_list_the_wire_fields(name: str, shape: type) -> None:
    text = " ".join(DOC.read_text(encoding="utf-8").split())
    found = re.search(rf"`{name}` is `\{{([^}}]*)\}}`", text)
    assert found, f"docs/api.md does not spell out `{name}`"
    listed = re.findall(r'"(\w+)"', found.group(1))
    assert listed == [f.name for f in dataclasses.fields(shape)]


def test_schema_components_keep_the_wire_field_names(schema: dict[str, Any]) -> None:
    components = schema["components"]["schemas"]
    shapes = [getattr(wire, n) for n in wire.__all__]
    checked = 0
    for shape in shapes:
        if dataclasses.is_dataclass(shape) and shape.__name__ in components:
            props = list(components[shape.__name__]["properties"])
            assert props == [f.name for f in dataclasses.fields(shape)], shape.__name__
            checked += 1
    assert checked >= 20


@pytest.mark.parametrize(
    ("route", "request_shape", "answer_shape"),
    [("POST /v1/resolve", wire.ResolveRequest, wire.ResolveAnswer)],
)
def test_a_rows_body_and_answer_name_every_wire_field(
    route: str, request_shape: type, answer_shape: type
) -> None:
    """Resolve's row spells out every field a node sends and gets (its trust included)."""
    row = next(
        line
        for line in DOC.read_text(encoding="utf-8").splitlines()
        if line.startswith(f"| `{route}`")
    )
    cells = _cells(row)
    body, answer = cells[2], cells[4]
    missing = [f.name for f in dataclasses.fields(request_shape) if f'"{f.name}"' not in body]
    missing += [f.name for f in dataclasses.fields(answer_shape) if f'"{f.name}"' not in answer]
    assert not missing, f"docs/api.md's {route} row does not name: {missing}"
