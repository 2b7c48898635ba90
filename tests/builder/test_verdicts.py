"""The verdict rule and the prewarm/verify reports built from child results (no compiles)."""

from __future__ import annotations

import pytest

from cachekeeper.builder.verdicts import DeviceRun, PrewarmReport, VerifyReport, is_effective
from cachekeeper.errors import ColdCompileBroken


def _run(mode: str, counters: dict[str, int], status: str = "ok") -> DeviceRun:
    return DeviceRun.from_result(
        {
            "device": "cpu",
            "mode": mode,
            "status": status,
            "regimes": [
                {"name": "attention[0]", "label": "l", "seconds": 1.0, "counters": counters}
            ],
            "counters": counters,
            "error": None,
        },
        seconds=2.0,
    )


def test_effective_rule() -> None:
    hit = {"fxgraph_cache_hit": 2, "autograd_cache_hit": 2}
    assert is_effective(hit)
    assert not is_effective({})  # installed but unused never passes
    assert not is_effective({**hit, "fxgraph_cache_miss": 1})
    assert not is_effective({**hit, "fxgraph_cache_bypass": 1})
    assert not is_effective({**hit, "autograd_cache_miss": 1})
    assert not is_effective({"autograd_cache_hit": 1})
    report = VerifyReport("w", "0" * 64, "/c", (_run("verify", hit),), 1.0)
    assert (report.status, report.exit_code, report.devices[0].regimes[0].verdict) == (
        "verified",
        0,
        "hit",
    )
    missed = VerifyReport("w", "0" * 64, "/c", (_run("verify", {"fxgraph_cache_miss": 1}),), 1.0)
    assert (missed.status, missed.exit_code) == ("not_effective", 1)
    crashed = VerifyReport("w", "0" * 64, "/c", (_run("verify", hit, "crashed"),), 1.0)
    assert (crashed.status, crashed.exit_code) == ("failed", 2)


def test_prewarm_report_status_and_stats() -> None:
    compiled = _run("prewarm", {"fxgraph_cache_miss": 1, "autograd_cache_miss": 1})
    ok_verify = VerifyReport("w", "0" * 64, "/c", (_run("verify", {"fxgraph_cache_hit": 1}),), 1.0)
    report = PrewarmReport("w", "0" * 64, "/c", (compiled,), 3.0, verify=ok_verify)
    assert report.status == "verified" and report.exit_code == 0
    assert report.stats["verify"]["effective"] is True
    assert report.stats["devices"] == ["cpu"]
    assert report.stats["prewarm"]["devices"]["cpu"]["regimes"][0]["verdict"] == "compiled"
    report.raise_for_status()
    broken = PrewarmReport("w", "0" * 64, "/c", (_run("prewarm", {}, "error"),), 3.0)
    assert broken.status == "cold_compile_broken" and broken.exit_code == 3
    assert broken.stats["verify"]["effective"] is False
    with pytest.raises(ColdCompileBroken):
        broken.raise_for_status()
