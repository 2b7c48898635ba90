"""What postjob says about a job's per-key tier (client/tier_stats.py), and how the hook
picks a path when torch is not the one it was written for (client/tier.py,
cachekeeper/_tier_hook/): "tier on but 0 requests" with its likely cause, never silence."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from cachekeeper import config, remote_tier
from cachekeeper.client.tier import checked_torch, tier_exports
from cachekeeper.client.tier_stats import collect, prepare, stats_dir
from cachekeeper.server.settings import Settings
from cachekeeper.wire import RemoteCacheOffer
from tests.conftest import REPO
from tests.helpers.live_server import start_server
from tests.helpers.redis_py import REDIS_PY, redis_py_versions

HOOK = REPO / "cachekeeper" / "_tier_hook"


def _backend():
    spec = importlib.util.spec_from_file_location(
        "_ck_tier_stats_test", HOOK / "_cachekeeper_tier.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_job_whose_processes_never_loaded_the_hook_is_a_problem_with_its_cause(
    tmp_path: Path,
) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    assert prepare(cache, backend="cachekeeper", writes=True) == stats_dir(cache)
    found = collect(cache)
    assert found is not None and found.processes == 0
    assert found.problem is not None and "did not inherit prejob's exports" in found.problem
    assert collect(cache) is None  # postjob consumed it: the next job counts only its own


def test_a_job_off_the_tier_reports_nothing(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    prepare(cache, backend="cachekeeper", writes=True)
    prepare(cache, backend=None, writes=False)  # a later prejob without the tier
    assert collect(cache) is None


@pytest.mark.slow  # imports torch in a child (seconds)
def test_a_job_whose_python_has_no_redis_py_is_told_so(tmp_path: Path) -> None:
    """Issue 30, point 2: the stock path in an image without redis-py. torch turns its
    remote caches off silently; the hook (watching only) records it and postjob says so."""
    cache = tmp_path / "cache"
    cache.mkdir()
    folder = prepare(cache, backend="redis", writes=True)
    assert folder is not None
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCH"))}
    env.update(
        PYTHONPATH=str(HOOK),
        TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE="1",
        **{config.TIER_MODE: "redis", config.TIER_STATS_DIR: str(folder)},
    )
    code = "import torch._inductor.remote_cache; import redis"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert "No module named 'redis'" in proc.stderr  # the fault: this Python has no redis-py
    found = collect(cache)
    assert found is not None and found.processes == 1, found
    assert found.problem is not None and "has no redis-py" in found.problem, found


def test_the_hook_refuses_a_remote_cache_module_that_differs() -> None:
    backend = _backend()
    old = types.ModuleType("torch._inductor.remote_cache")  # a torch before the override

    class RemoteCache:
        pass

    old.RemoteCache = RemoteCache  # type: ignore[attr-defined]
    assert backend.check(old) == "RemoteCache.backend_override_cls is missing"
    stats = backend.install(old, mode="cachekeeper") or backend._STATS
    assert not stats.installed and "differs" in stats.reason


def test_prejob_takes_the_stock_path_for_a_torch_the_backend_was_not_checked_against(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert checked_torch("2.11.0+cu130") and checked_torch("2.15.1")
    assert not checked_torch("2.16.0") and not checked_torch("2.10.0") and not checked_torch(None)
    monkeypatch.syspath_prepend(str(REDIS_PY / redis_py_versions()[-1]))  # as on a node
    with start_server(Settings(data_dir=tmp_path / "d", tokens={"w": "write"}, resp_port=0)) as s:
        assert s.resp_port is not None
        offer = RemoteCacheOffer(port=s.resp_port, use=True, writable=True, http=True,
                                 switches=remote_tier.site_switches(tier=True))  # fmt: skip
        choice = tier_exports(offer, server=s.url, token="w", wish="auto", client_name="n",
                              torch_version="2.16.0",
                              environ={"CACHEKEEPER_HOME": str(tmp_path / "h")})  # fmt: skip
    assert choice.used and choice.backend == "redis", choice
    assert choice.note is not None and "2.16.0 is not a version" in choice.note
    assert "can fail that compile" in choice.note  # the stock path's risk, in prejob's line
