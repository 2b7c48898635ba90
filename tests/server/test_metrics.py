"""server/metrics.py: /metrics on prometheus_client, as the hand-written one showed it, plus
the histograms of what nodes and builders wait on.

``data/metrics-before.txt`` is the hand-written module's exposition (main before the r5-libs merge) for
``exercise()`` below: every metric it had, with its callers' labels. The new one must parse
to the same families (name, type, help, every sample's labels and value).
"""

from __future__ import annotations

import ast
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import prometheus_client
import pytest
from prometheus_client.parser import text_string_to_metric_families

from cachekeeper.server.metrics import _HELP, _LABELS, CONTENT_TYPE, Metrics
from cachekeeper.server.resources.snapshots import Snapshots
from cachekeeper.server.settings import Settings
from tests.helpers.in_process import in_process
from tests.helpers.metrics import sample
from tests.server.conftest import make_snapshot, push

BEFORE = Path(__file__).parent / "data" / "metrics-before.txt"
REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
HISTOGRAMS = {name for name, (kind, _) in _HELP.items() if kind == "histogram"}


def exercise(metrics: Any) -> dict[str, float]:
    """Every metric the server had before prometheus_client, with the labels its callers
    pass, a few times each (integers, a fraction, a large byte count, a label value that
    needs escaping); some left at zero. The gauges /metrics reads at scrape."""
    inc = metrics.inc
    for status in ("200", "404", "200"):
        inc("cachekeeper_http_requests_total", route="/v1/resolve", method="POST", status=status)
    inc("cachekeeper_http_requests_total", route="unmatched", method="GET", status="404")
    inc("cachekeeper_http_request_bytes_total", 1234)
    inc("cachekeeper_http_response_bytes_total", 3 << 30)
    inc("cachekeeper_resolves_total", outcome="verified")
    inc("cachekeeper_resolves_total", outcome="miss")
    inc("cachekeeper_blob_uploads_total", result="created")
    inc("cachekeeper_blob_downloads_total")
    inc("cachekeeper_archive_requests_total")
    inc("cachekeeper_archive_blobs_total", 7)
    inc("cachekeeper_snapshots_published_total")
    inc("cachekeeper_evictions_total", 2)
    inc("cachekeeper_job_reports_total", phase="prejob", outcome="restored", workload='a "b"\\c\nd')
    inc("cachekeeper_cold_starts_total", workload="wl", reason="no_matching_snapshot")
    inc("cachekeeper_job_new_entries_total", 3, workload="wl", kind="fxgraph")
    inc("cachekeeper_job_new_bytes_total", 2.5, workload="wl")
    inc("cachekeeper_remote_cache_gets_total", result="hit")
    inc("cachekeeper_remote_cache_puts_total", result="stored")
    inc("cachekeeper_remote_cache_bytes_total", 500, direction="in")
    inc("cachekeeper_remote_cache_connections_closed_total", reason="idle_timeout")
    inc("cachekeeper_catalog_refusals_total", 4, table="job_reports", reason="max_rows")
    # left at zero: archive packs, job new entries of other kinds, tier evictions, protocol
    # errors, auth failures, catalog pruned
    return {
        "cachekeeper_store_bytes": 1.5e9,
        "cachekeeper_store_blobs": 12.0,
        "cachekeeper_store_snapshots": 3.0,
        "cachekeeper_catalog_bytes": 4096.0,
        "cachekeeper_remote_cache_keys": 0.0,
    }


def _families(text: str) -> dict[str, tuple[str, str, list[Any]]]:
    """name -> (type, help, sorted samples), parsed as a Prometheus scraper does."""
    return {
        family.name: (
            family.type,
            family.documentation,
            sorted((s.name, sorted(s.labels.items()), s.value) for s in family.samples),
        )
        for family in text_string_to_metric_families(text)
    }


def test_every_metric_is_exposed_as_the_hand_written_exposition_had_it() -> None:
    """Names, types, help, labels and values as before; the histograms are the additions;
    no ``_created`` series (prometheus_client's own, which the hand-written one had none of)."""
    metrics = Metrics()
    text = metrics.render(exercise(metrics))
    before, now = _families(BEFORE.read_text(encoding="utf-8")), _families(text)
    assert {name: now.get(name) for name in before} == before
    assert set(now) - set(before) == HISTOGRAMS
    assert "_created" not in text
    # a counter never counted is one unlabelled 0, labelled or not, as before
    assert sample(text, "cachekeeper_archive_packs_total") == 0
    assert sample(text, "cachekeeper_catalog_pruned_total") == 0


def test_each_app_has_its_own_registry() -> None:
    """Tests build many apps per process; prometheus_client's global registry is never used."""
    one, two = Metrics(), Metrics()
    one.inc("cachekeeper_resolves_total", outcome="miss")
    one.observe("cachekeeper_resolve_seconds", 0.01, status="200")
    assert one.value("cachekeeper_resolves_total", outcome="miss") == 1
    assert two.value("cachekeeper_resolves_total", outcome="miss") == 0
    assert one.value("cachekeeper_resolve_seconds", status="200") == 1  # its count
    assert one.registry is not two.registry
    assert prometheus_client.REGISTRY.get_sample_value("cachekeeper_resolves_total") is None


def test_an_undeclared_metric_or_label_fails_at_its_first_call() -> None:
    metrics = Metrics()
    with pytest.raises(KeyError, match="'cachekeeper_no_such_total' is not declared"):
        metrics.inc("cachekeeper_no_such_total")
    with pytest.raises(ValueError, match="Incorrect label names"):
        metrics.inc("cachekeeper_resolves_total", result="miss")  # its label is outcome
    assert metrics.value("cachekeeper_no_such_total") == 0


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Any]:
    with in_process(Settings(data_dir=tmp_path / "data")) as running:
        yield running


def test_the_routes_nodes_wait_on_are_timed_to_their_last_byte(
    server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publish, resolve, and a restore's reads (manifest, archive, part of it, a blob) each
    land in their histogram once, by status; the archive's time spans its stream, which
    the route only starts (each of its chunks is sent 0.1 s apart here)."""
    real_archive = Snapshots.archive

    def slow_archive(self: Snapshots, *args: Any, **kwargs: Any) -> Iterator[bytes]:
        for chunk in real_archive(self, *args, **kwargs):
            time.sleep(0.1)
            yield chunk

    monkeypatch.setattr(Snapshots, "archive", slow_archive)
    client = server.client
    manifest, blobs = make_snapshot({"fxgraph/a/e": b"entry" * 100}, workload="wl", verified=True)
    assert push(client, manifest, blobs).status_code == 201
    resolve = {"fingerprint": manifest.fingerprint, "workload": "wl", "devices": ["cuda:0"]}
    assert client.post("/v1/resolve", json=resolve).json()["snapshot"]["id"] == manifest.id
    assert client.get(f"/v1/snapshots/{manifest.id}").status_code == 200
    assert client.get("/v1/snapshots/" + "0" * 64).status_code == 404
    archive = client.get(f"/v1/snapshots/{manifest.id}/archive")
    assert archive.status_code == 200 and archive.content
    part = client.post(f"/v1/snapshots/{manifest.id}/archive", json={"digests": list(blobs)})
    assert part.status_code == 200
    digest = next(iter(blobs))
    assert client.get(f"/v1/blobs/{digest}").status_code == 200

    text = client.get("/metrics").text
    assert client.get("/metrics").headers["content-type"] == CONTENT_TYPE
    count = "_count"
    assert sample(text, "cachekeeper_publish_seconds" + count, status="201") == 1
    assert sample(text, "cachekeeper_resolve_seconds" + count, status="200") == 1
    reads = "cachekeeper_restore_read_seconds" + count
    assert sample(text, reads, read="manifest", status="200") == 1
    assert sample(text, reads, read="manifest", status="404") == 1
    assert sample(text, reads, read="archive", status="200") == 1
    assert sample(text, reads, read="archive_part", status="200") == 1
    assert sample(text, reads, read="blob", status="200") == 1
    streamed = sample(text, "cachekeeper_restore_read_seconds_sum", read="archive", status="200")
    assert streamed is not None and streamed >= 0.1  # the stream, not the route's return
    bucket = "cachekeeper_restore_read_seconds_bucket"
    assert sample(text, bucket, read="blob", status="200", le="+Inf") == 1
    assert (
        sample(
            text,
            "cachekeeper_http_requests_total",
            route="/v1/resolve",
            method="POST",
            status="200",
        )
        == 1
    )


def test_docs_list_every_metric() -> None:
    """docs/server.md's Metrics section names every declared metric, with its labels."""
    text = (DOCS / "server.md").read_text(encoding="utf-8")
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    missing = [name for name in _HELP if f"`{name}`" not in section]
    assert missing == [], f"docs/server.md's Metrics section does not name: {missing}"


def test_the_route_answers_the_same_content_type(tmp_path: Path) -> None:
    """Prometheus' 0.0.4 text, as before, whatever the scraper's Accept asks for (Prometheus
    asks for OpenMetrics first, which would change how counters are written)."""
    with in_process(Settings(data_dir=tmp_path / "data")) as server:
        accept = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.3"
        answer = server.client.get("/metrics", headers={"Accept": accept})
    assert answer.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert "# EOF" not in answer.text
    assert sample(answer.text, "cachekeeper_store_snapshots") == 0


def _metric_calls(source: str) -> list[tuple[int, str, set[str] | None]]:
    """(line, metric, keyword label names or None for ``**labels``) of each ``.inc``,
    ``.observe`` or ``.value`` call naming a metric by a literal."""
    calls = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in ("inc", "observe", "value") or not node.args:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and str(first.value).startswith("cachekeeper_"):
            names = {k.arg for k in node.keywords if k.arg is not None}
            spread = any(k.arg is None for k in node.keywords)
            calls.append((node.lineno, str(first.value), None if spread else names))
    return calls


def test_every_call_in_the_server_names_a_declared_metric_with_its_labels() -> None:
    """A call no test reaches would fail only in production (an undeclared name, a label
    the declaration lacks): every literal call in server/ is checked here instead."""
    assert _metric_calls('m.inc("cachekeeper_x_total", a="1")\nm.value("cachekeeper_y", **l)') == [
        (1, "cachekeeper_x_total", {"a"}),
        (2, "cachekeeper_y", None),
    ]
    wrong = []
    calls = 0
    for path in sorted((REPO / "server").rglob("*.py")):
        for line, name, labels in _metric_calls(path.read_text(encoding="utf-8")):
            calls += 1
            where = f"{path.relative_to(REPO)}:{line} {name}"
            if name not in _HELP:
                wrong.append(f"{where}: not declared in _HELP")
            elif labels is not None and labels != set(_LABELS.get(name, ())):
                wrong.append(f"{where}: labels {sorted(labels)}, declared {_LABELS.get(name, ())}")
    assert calls >= 25  # 29 when written
    assert wrong == []
