"""cachekeeper.wire: the generic from_dict / to_dict over the API's shapes."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path

import pytest

from cachekeeper import wire
from cachekeeper.wire import (
    EventOut,
    Mismatch,
    ResolveAnswer,
    StatusAnswer,
    Summary,
    WireError,
    from_dict,
    to_dict,
    utc_now,
)
from cachekeeper.wire._core import _hints
from tests.helpers.bodies import summary_body

DIGEST = "a" * 64


def summary(**changes: object) -> dict:
    return summary_body(DIGEST, **changes)


def event(**changes: object) -> dict:
    out = {
        "workload": "w",
        "fingerprint_digest": "f" * 64,
        "status": "failed",
        "detail": "boom",
        "traceback_tail": ["line 1", "line 2"],
        "snapshot_id": None,
        "seconds": 1.5,
        "id": 3,
        "at": "2026-01-01T00:00:00Z",
        "agent_id": "0123456789abcdef",
    }
    out.update(changes)
    return out


def test_round_trip_keeps_every_field_in_order():
    answer = {
        "snapshot": None,
        "verified": False,
        "exact": False,
        "near_misses": [
            {
                "snapshot": summary(),
                "mismatches": [
                    {"field": "torch", "node": "2.13.0", "snapshot": {"a": [1]}, "built_by": None}
                ],
            }
        ],
        "reason": "no snapshot matches",
        "archive_url": None,
        "deltas": [{**summary(), "id": "e" * 64}],
        "remote_cache": {
            "port": 6380,
            "use": True,
            "writable": False,
            "switches": {"TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1"},
            "write_refusal": "read_only_token",
            "http": True,
            "tls": False,
        },
        "signed_by": None,
    }
    parsed = from_dict(ResolveAnswer, answer)
    assert parsed.near_misses[0].snapshot_id == DIGEST
    assert parsed.near_misses[0].mismatches[0] == Mismatch(
        field="torch", node="2.13.0", snapshot={"a": [1]}
    )
    assert parsed.snapshot_id is None
    assert to_dict(parsed) == answer
    assert list(to_dict(parsed)) == list(answer)
    status = {"status": [{"workload": "w", "fingerprint_digest": "f" * 64, "status": "warm",
                          "snapshot_id": DIGEST, "updated_at": None, "last_event": event(),
                          "agents": ["b1"], "devices": ["cuda:0", "cuda:1"],
                          "uncovered": ["cuda:2"], "note": "snapshot covers cuda:0,1; ...",
                          "jobs": {"workload": "w", "fingerprint_digest": "f" * 64,
                                   "restores": 3, "cold": 1, "cold_reasons": {"no_match": 1},
                                   "postjobs": 2, "compiled": 1, "compiled_after_restore": 1,
                                   "new_graphs": 4, "new_bytes": 10, "last_report_at": "t",
                                   "reporters": 2,
                                   "tier_jobs": 2, "snapshot_hits": 3, "tier_hits": 4,
                                   "tier_puts": 1, "tier_failed": 0, "tier_problems": 1,
                                   "tier_problem": "the tier was on but asked nothing"},
                          "jobs_note": "restored, but ...", "stale": None, "harvested": 2,
                          "harvest_note": "2 harvested deltas ... kept back"}]}  # fmt: skip
    assert to_dict(from_dict(StatusAnswer, status)) == status


def test_unknown_keys_are_ignored_and_defaults_filled():
    parsed = from_dict(EventOut, {**event(), "new_field": 1})
    assert parsed.seconds == 1.5
    bare = {k: v for k, v in event().items() if k not in ("detail", "traceback_tail", "seconds")}
    parsed = from_dict(EventOut, bare)
    assert (parsed.detail, parsed.traceback_tail, parsed.seconds) == ("", [], None)


@pytest.mark.parametrize(
    ("data", "where"),
    [
        ({**summary(), "id": "x"}, "Summary.id: 'x' does not match"),
        ({**summary(), "size_bytes": "10"}, "Summary.size_bytes: expected int, got str"),
        ({**summary(), "size_bytes": True}, "Summary.size_bytes: expected int, got bool"),
        ({**summary(), "verified": 1}, "Summary.verified: expected bool, got int"),
        ({**summary(), "devices": "cpu"}, "Summary.devices: expected a list, got str"),
        ({**summary(), "devices": [1]}, "Summary.devices[0]: expected str, got int"),
        ({k: v for k, v in summary().items() if k != "pinned"}, "Summary.pinned: missing"),
        ([summary()], "Summary: expected an object, got list"),
    ],
)
def test_garbage_is_refused_naming_the_field(data, where):
    with pytest.raises(WireError) as info:
        from_dict(Summary, data)
    assert str(info.value).startswith(where)


def test_checks_literals_and_nested_paths():
    with pytest.raises(WireError, match=r"EventOut.status: 'done' is not one of"):
        from_dict(EventOut, event(status="done"))
    with pytest.raises(WireError, match=r"EventOut.seconds: -1.0 is less than 0"):
        from_dict(EventOut, event(seconds=-1))
    with pytest.raises(WireError, match=r"EventOut.traceback_tail\[1\]: .* is longer than 2000"):
        from_dict(EventOut, event(traceback_tail=["ok", "x" * 2001]))
    bad = {"snapshot": summary(id="B" * 64), "verified": True, "exact": True, "near_misses": []}
    with pytest.raises(WireError, match=r"^ResolveAnswer.snapshot.id: "):
        from_dict(ResolveAnswer, bad)
    assert from_dict(EventOut, event(seconds=2)).seconds == 2.0  # JSON ints are floats too


def test_every_shape_resolves_its_annotations():
    shapes = [getattr(wire, name) for name in wire.__all__]
    shapes = [s for s in shapes if dataclasses.is_dataclass(s) and s is not wire.Check]
    assert len(shapes) >= 25
    for shape in shapes:
        _hints(shape)  # a typo in an annotation fails here, not on a live answer


def test_import_is_stdlib_only():
    code = (
        "import sys, cachekeeper.wire; "
        "bad = [m for m in ('torch', 'pydantic', 'httpx', 'fastapi') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_utc_now_is_the_wire_time_text():
    first, second = utc_now(), utc_now()
    assert first <= second  # same width, so text order is time order
    parsed = datetime.fromisoformat(first)
    assert parsed.tzinfo == UTC and first.endswith("+00:00")
    assert len(first.split(".")[1]) == len("123456+00:00")  # microseconds


def test_utc_now_loads_no_shape_module():
    code = (
        "import sys; from cachekeeper.wire import utc_now; utc_now(); "
        "loaded = [m for m in sys.modules if m.startswith('cachekeeper.wire.') "
        "and m != 'cachekeeper.wire._core']; assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_package_names_every_shape_once_in_each_list():
    """A shape is named three times in cachekeeper/wire/__init__.py: the lazy map (run
    time), the TYPE_CHECKING imports (types for mypy; a name missing there types as Any),
    and __all__. A shape added to a module must appear in all three, from its own module."""
    init = Path(wire.__file__)
    tree = ast.parse(init.read_text())
    typed: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING":
            for imp in node.body:
                assert isinstance(imp, ast.ImportFrom) and imp.level == 1
                typed.update({alias.name: str(imp.module) for alias in imp.names})
    defined = {
        name: path.stem
        for path in init.parent.glob("[!_]*.py")
        for name, value in vars(importlib.import_module(f"cachekeeper.wire.{path.stem}")).items()
        if dataclasses.is_dataclass(value) and value.__module__ == f"cachekeeper.wire.{path.stem}"
    }
    assert len(defined) >= 25
    assert wire._MODULE_OF == defined
    assert typed == defined
    assert set(defined) <= set(wire.__all__)
    assert len(wire.__all__) == len(set(wire.__all__))
