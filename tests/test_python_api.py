"""The Python API of docs/python-api.md: every exported name imports and is documented,
and ``cachekeeper.prejob`` called from Python restores from a live server.
"""

from __future__ import annotations

import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

import cachekeeper
from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push
from cachekeeper.restore import is_restored
from cachekeeper.server.settings import Settings
from cachekeeper.store import LocalStore
from tests.helpers.caches import make_cache
from tests.helpers.live_server import start_server

REPO = Path(__file__).resolve().parent.parent
DOC = (REPO / "docs" / "python-api.md").read_text()

# The modules docs/python-api.md documents; the first three name by name every export.
DOCUMENTED_IN_FULL = ["cachekeeper", "cachekeeper.mods", "cachekeeper.client.prejob"]
MODULES = [
    *DOCUMENTED_IN_FULL,
    "cachekeeper.client",
    "cachekeeper.client.pull",
    "cachekeeper.client.push",
    "cachekeeper.fingerprint",
    "cachekeeper.workload",
    "cachekeeper.errors",
]


@pytest.mark.parametrize("module_name", MODULES)
def test_every_exported_name_imports_and_has_a_docstring(module_name: str) -> None:
    module = importlib.import_module(module_name)
    assert module.__doc__, f"{module_name} has no docstring"
    assert module_name in DOC, f"docs/python-api.md does not mention {module_name}"
    for name in module.__all__:
        value = getattr(module, name)  # raises if an export is missing
        exec(f"from {module_name} import {name}", {})
        if inspect.isfunction(value) or inspect.isclass(value):
            assert inspect.getdoc(value), f"{module_name}.{name} has no docstring"


@pytest.mark.parametrize("module_name", DOCUMENTED_IN_FULL)
def test_the_doc_names_every_export(module_name: str) -> None:
    module = importlib.import_module(module_name)
    for name in module.__all__:
        if name != "__version__":
            assert f"`{name}" in DOC or f"{name}(" in DOC, f"python-api.md lacks {name}"


def test_importing_the_api_imports_neither_torch_nor_httpx() -> None:
    code = (
        "import json, sys, cachekeeper, cachekeeper.mods; cachekeeper.prejob;"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'httpx'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        cachekeeper.no_such_name  # noqa: B018


def test_prejob_from_python_restores_from_a_live_server(tmp_path: Path) -> None:
    src = tmp_path / "src"
    make_cache(src)
    with start_server(Settings(data_dir=tmp_path / "server")) as server:
        with CacheClient(base_url=server.url) as client:
            pushed = push(src, client=client, workload="small", store=LocalStore(home=tmp_path))
        cache = tmp_path / "cache"
        report = cachekeeper.prejob(
            workload="small", server=server.url, cache_dir=cache, environ={}, timeout_s=60
        )
        assert isinstance(report, cachekeeper.PrejobReport)
        assert report.outcome == "restored", report.reason
        assert report.snapshot_id == pushed.snapshot_id
        assert report.exports == {"TORCHINDUCTOR_CACHE_DIR": str(cache)}
        assert is_restored(pushed.snapshot_id, cache)
        again = cachekeeper.prejob(workload="small", server=server.url, cache_dir=cache)
        assert again.outcome == "already_restored"
    # the server is gone: a cold outcome with its reason, never an exception
    cold = cachekeeper.prejob(workload="small", server=server.url, cache_dir=cache, timeout_s=5)
    assert cold.cold and cold.reason and "server unreachable" in cold.reason
    assert cold.exports == {"TORCHINDUCTOR_CACHE_DIR": str(cache)}


SMALL_TOML = (
    'name = "small"\n[[attention]]\nbatch = 1\nq_heads = 2\nkv_heads = 2\nhead_dim = 16\n'
    'seq_lens = [128]\ndtype = "float32"\nmask = "causal"\n'
)


@pytest.mark.parametrize("suffix", ["/v1", "/v1/", "/"])
def test_a_server_url_as_copied_from_the_api_docs_takes_the_quick_path_and_reports(
    tmp_path: Path, suffix: str
) -> None:
    """Issue 25: ``server="http://cache:8750/v1"`` posted to /v1/v1/resolve, so the no-op
    path never fired and every job report was dropped; the CLI normalised the URL. One
    place builds every client URL (``cachekeeper.client.calls.endpoint``)."""
    src = tmp_path / "src"
    make_cache(src)
    cache = tmp_path / "cache"
    code = (
        "import json, sys, cachekeeper\n"
        f"r = cachekeeper.prejob(workload='small', server=sys.argv[1], cache_dir={str(cache)!r})\n"
        "print(json.dumps([r.outcome, r.reported, 'httpx' in sys.modules]))\n"
    )
    with start_server(Settings(data_dir=tmp_path / "server")) as server:
        with CacheClient(base_url=server.url) as client:
            client.register_workload("small", SMALL_TOML)
            push(src, client=client, workload="small", store=LocalStore(home=tmp_path))
        url = server.url + suffix
        first = cachekeeper.prejob(workload="small", server=url, cache_dir=cache)
        assert (first.outcome, first.reported) == ("restored", True), first
        proc = subprocess.run(
            [sys.executable, "-c", code, url], capture_output=True, text=True, cwd=REPO
        )
        assert proc.returncode == 0, proc.stderr
        # the no-op path: one stdlib resolve, no HTTP client loaded, and the report stored
        assert json.loads(proc.stdout) == ["already_restored", True, False]
        from cachekeeper.client.postjob import postjob

        after = postjob(workload="small", server=url, cache_dir=cache)
        assert after.outcome == "clean" and after.reported, after
        with CacheClient(base_url=server.url) as client:
            (row,) = client.fleet_status(workload="small")
        # two prejobs on one dir within the job window are one job's ranks (issue 25)
        assert row.jobs is not None and row.jobs.restores == 1 and row.jobs.postjobs == 1


def test_every_client_url_is_built_in_one_place() -> None:
    from cachekeeper.client.calls import endpoint

    for server in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/V1/", " http://h:1 "):
        assert endpoint(server, "/v1/resolve") == "http://h:1/v1/resolve"
    # behind a reverse proxy that serves the API under a path prefix
    assert endpoint("https://proxy/ck/v1", "/v1/reports") == "https://proxy/ck/v1/reports"
    assert endpoint("https://proxy/ck", "/healthz") == "https://proxy/ck/healthz"
