"""Prewarm and verify end to end, with real CPU torch.compile(flex_attention) runs.

Cold CPU compiles are slow (~15-25 s each on two cores), so the suite compiles few
distinct things and shares them per module:

- ``mods_prewarm``: ONE workload whose five regimes cover every built-in mask_mod and
  score_mod plus an import-path factory and a working entrypoint, prewarmed then verified.
- ``tiny_two_devices``: examples/workloads/cpu-tiny.toml prewarmed on an injected device
  list ``cuda:0,cuda:1`` (the N-GPU path: two children in parallel, two staging dirs, two
  merges, two verifies); ``CACHEKEEPER_TEST_FAKE_CUDA=1`` runs those children on the CPU.

Children import the test package ``fixtures_pkg`` through PYTHONPATH, as a training
repo's own code would be imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper.builder.prewarm import prewarm
from cachekeeper.builder.verdicts import PrewarmReport, ProgressEvent
from cachekeeper.builder.verify import verify
from cachekeeper.builder.workload import load_workload, parse_workload
from cachekeeper.environment.devices import parse_devices
from tests.helpers.requires import require

pytestmark = pytest.mark.compile  # real torch.compile runs in children

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
TINY = REPO / "examples" / "workloads" / "cpu-tiny.toml"

_REGIME = """
[[attention]]
batch = 1
q_heads = 2
head_dim = 16
seq_lens = [128]
dtype = "float32"
backward = true  # ignored on the CPU: forward only, under no_grad
compile = { dynamic = false }
"""
# Why dynamic = false: with the default (automatic dynamic shapes), the fourth recompile of
# flex_attention in one process made a captured constant symbolic and Inductor 2.13 failed
# to lower it ("LoweringException: RuntimeError: unbacked_bindings"), a real cold-compile
# bug that prewarm reports as cold_compile_broken. Training code that calls these mods in
# this order without dynamic=False would hit it too.
MODS_TOML = (
    'name = "all-mods"\n'
    + _REGIME
    + 'mask = "causal"\nscore_mod = "softcap"\nscore_args = { cap = 20.0 }\n'
    + _REGIME
    + 'mask = "sliding_window"\nmask_args = { window = 32 }\nscore_mod = "alibi"\n'
    + _REGIME
    + 'mask = "document_causal"\nmask_args = { doc_len = 64 }\n'
    + _REGIME
    + 'mask = "prefix_lm"\nmask_args = { prefix_len = 16 }\n'
    + 'score_mod = "fixtures_pkg.mods:relative_bias"\nscore_args = { scale = 0.5 }\n'
    + _REGIME
    + 'mask = "none"\nscore_mod = "none"\n'
    + '[[entrypoint]]\ntarget = "fixtures_pkg.warmup:step"\nkwargs = { size = 64 }\n'
)
BROKEN_TOML = """\
name = "broken"
[[entrypoint]]
target = "fixtures_pkg.warmup:step"
kwargs = { size = 64 }
[[entrypoint]]
target = "fixtures_pkg.warmup:fx_traces_compiled"
kwargs = { size = 32 }
"""


@pytest.fixture(scope="module", autouse=True)
def _child_env() -> Iterator[None]:
    require("torch")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
        mp.delenv("CACHEKEEPER_TEST_FAKE_CUDA", raising=False)
        yield


def _listing(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in sorted(root.rglob("*"))
        if p.is_file() and not p.is_symlink()
    }


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [str(Path(sys.executable).with_name("cachekeeper")), *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(scope="module")
def mods_prewarm(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[PrewarmReport, Path, list[ProgressEvent]]:
    root = tmp_path_factory.mktemp("mods")
    (root / "all-mods.toml").write_text(MODS_TOML)
    workload = load_workload(root / "all-mods.toml")
    events: list[ProgressEvent] = []
    cache = root / "inductor"
    report = prewarm(workload, cache, devices=["cpu"], progress=events.append, timeout_s=900)
    return report, cache, events


@pytest.fixture(scope="module")
def tiny_two_devices(tmp_path_factory: pytest.TempPathFactory) -> tuple[PrewarmReport, Path]:
    cache = tmp_path_factory.mktemp("tiny") / "inductor"
    devices = parse_devices("cuda", visible=[0, 1])
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CACHEKEEPER_TEST_FAKE_CUDA", "1")
        report = prewarm(load_workload(TINY), cache, devices=devices, timeout_s=900)
    return report, cache


def test_every_builtin_mod_factory_and_entrypoint_prewarm_then_verify(mods_prewarm) -> None:
    report, cache, events = mods_prewarm
    assert report.status == "verified", report.to_dict()
    assert report.exit_code == 0
    (run,) = report.devices
    names = [r.name for r in run.regimes]
    assert names == [f"attention[{i}]" for i in range(5)] + ["entrypoint[0]"]
    labels = [r.label for r in run.regimes]
    for mod in ("causal+softcap", "sliding_window+alibi", "document_causal", "prefix_lm+"):
        assert any(label.startswith(mod) for label in labels), labels
    assert labels[4].startswith("none b1") and labels[4].endswith(" fwd")  # CPU: no backward
    # a cold staging dir: every regime really compiled (a miss), none bypassed
    for regime in run.regimes:
        assert regime.verdict == "compiled", regime
        assert regime.counters["fxgraph_cache_miss"] >= 1
    # the verify in a fresh process hit every one of them
    assert report.verify is not None and report.verify.effective
    (checked,) = report.verify.devices
    assert [r.verdict for r in checked.regimes] == ["hit"] * 6
    assert checked.counters["fxgraph_cache_miss"] == 0
    assert checked.counters["fxgraph_cache_hit"] >= 6
    # merged with the restore rules; the work area is gone
    assert report.merged["cpu"]["written"] > 0 and not report.merged["cpu"]["conflicts"]
    assert (cache / "fxgraph").is_dir()
    assert not list(cache.parent.glob(".cachekeeper-prewarm-*"))
    # progress was relayed: a start and a done per regime step, in both phases
    seen = {(e.mode, e.regime, e.event) for e in events}
    for name in names:
        for mode in ("prewarm", "verify"):
            assert {(mode, name, "start"), (mode, name, "done")} <= seen
    # the manifest stats
    stats = report.stats
    assert stats["verify"]["effective"] is True and stats["devices"] == ["cpu"]
    assert len(stats["prewarm"]["devices"]["cpu"]["regimes"]) == 6
    json.dumps(report.to_dict())


def test_n_devices_run_in_parallel_children_and_all_verify(tiny_two_devices) -> None:
    report, cache = tiny_two_devices
    assert report.status == "verified", report.to_dict()
    assert [run.device for run in report.devices] == ["cuda:0", "cuda:1"]
    for run in report.devices:
        assert run.status == "ok" and run.regimes[0].verdict == "compiled"
    assert set(report.merged) == {"cuda:0", "cuda:1"}
    assert report.merged["cuda:0"]["written"] > 0
    assert report.verify is not None
    assert [run.device for run in report.verify.devices] == ["cuda:0", "cuda:1"]
    assert all(run.effective for run in report.verify.devices)
    assert report.stats["devices"] == ["cuda:0", "cuda:1"]
    # both children ran at once: together they took less than one after the other
    runs = report.devices
    assert sum(r.seconds for r in runs) > report.seconds - report.verify.seconds


def test_a_snapshot_of_the_prewarmed_dir_carries_the_verify_stats_and_devices(
    tiny_two_devices, tmp_path: Path
) -> None:
    from cachekeeper.snapshot.make import snapshot_dir
    from cachekeeper.store import LocalStore

    report, cache = tiny_two_devices
    store = LocalStore(home=tmp_path / "home")
    manifest = snapshot_dir(cache, store=store, workload="cpu-tiny")
    assert manifest.verified
    assert manifest.devices == ("cuda:0", "cuda:1")
    assert manifest.workload_digest == load_workload(TINY).digest
    assert manifest.stats == json.loads(json.dumps(report.stats))
    assert not [f.path for f in manifest.files if f.path.startswith(".cachekeeper")]
    # someone's own warm cache, or another workload's name: no record, so unverified
    assert not snapshot_dir(cache, store=store, workload="other").verified


def test_cli_verify_passes_on_the_prewarmed_cache(tiny_two_devices) -> None:
    _, cache = tiny_two_devices
    proc = _cli("verify", str(TINY), "--cache-dir", str(cache), "--device", "cpu", "--json")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err
    body = json.loads(out)
    assert body["status"] == "verified" and body["effective"] is True
    assert body["devices"][0]["counters"]["fxgraph_cache_hit"] >= 1


def test_verify_fails_on_an_empty_dir_and_on_a_changed_head_dim(
    tiny_two_devices, tmp_path: Path
) -> None:
    _, cache = tiny_two_devices
    empty = tmp_path / "empty"
    empty.mkdir()
    # the CLI on an empty dir runs in parallel with the library call below (2 cold compiles)
    proc = _cli("verify", str(TINY), "--cache-dir", str(empty), "--device", "cpu", "--json")
    try:
        copy = tmp_path / "copy"
        shutil.copytree(cache, copy)
        changed = parse_workload(
            TINY.read_text().replace("head_dim = 16", "head_dim = 32"), source="changed.toml"
        )
        report = verify(changed, copy, devices=["cpu"], timeout_s=600)
        assert report.status == "not_effective" and report.exit_code == 1
        (run,) = report.devices
        assert run.counters["fxgraph_cache_miss"] >= 1 and run.regimes[0].verdict == "miss"
    finally:
        out, err = proc.communicate(timeout=600)
    assert proc.returncode == 1, err
    body = json.loads(out)
    assert body["status"] == "not_effective" and body["effective"] is False
    assert body["devices"][0]["counters"]["fxgraph_cache_miss"] >= 1


def test_cold_compile_broken_is_reported_and_nothing_is_merged(tmp_path: Path) -> None:
    workload = tmp_path / "broken.toml"
    workload.write_text(BROKEN_TOML)
    cache = tmp_path / "inductor"
    cache.mkdir()
    (cache / "keep.txt").write_text("already here")
    before = _listing(cache)
    proc = _cli("prewarm", str(workload), "--cache-dir", str(cache), "--device", "cpu", "--json")
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 3, err
    body = json.loads(out)
    assert body["status"] == "cold_compile_broken"
    error = body["devices"][0]["error"]
    assert error["type"] == "RuntimeError"
    assert (
        "Detected that you are using FX to symbolically trace a dynamo-optimized"
        in (error["message"])
    )
    assert error["where"] == "entrypoint[1]"
    assert any("symbolic_trace" in line for line in error["traceback_tail"])
    # entrypoint[0] did compile into the staging dir, and none of it reached the target
    assert body["devices"][0]["regimes"][0]["counters"]["fxgraph_cache_miss"] >= 1
    assert body["merged"] == {} and body["verify"] is None
    assert _listing(cache) == before
    assert not list(tmp_path.glob(".cachekeeper-prewarm-*"))
    assert body["stats"]["verify"]["effective"] is False


def test_unresolvable_import_path_fails_naming_the_field(tmp_path: Path) -> None:
    text = TINY.read_text().replace('mask = "causal"', 'mask = "fixtures_pkg.mods:missing"')
    workload = parse_workload(text, source="typo.toml")
    cache = tmp_path / "inductor"
    report = prewarm(workload, cache, devices=["cpu"], timeout_s=600)
    assert report.status == "failed" and report.exit_code == 2
    (run,) = report.devices
    assert run.status == "invalid" and run.error is not None
    assert run.error.message == (
        "typo.toml: attention[0].mask: 'fixtures_pkg.mods:missing': no attribute 'missing'"
    )
    assert not cache.exists()


def test_a_child_past_its_timeout_is_killed_and_reported(tmp_path: Path) -> None:
    workload = parse_workload(
        'name = "hang"\n[[entrypoint]]\ntarget = "fixtures_pkg.warmup:sleep"\n'
        "kwargs = { seconds = 300 }\n",
        source="hang.toml",
    )
    report = prewarm(workload, tmp_path / "inductor", devices=["cpu"], timeout_s=2)
    (run,) = report.devices
    assert run.status == "timeout" and report.status == "failed" and report.exit_code == 2
    assert run.seconds < 60  # hang guard (30x the 2 s timeout; the child sleeps 300 s)
    assert not (tmp_path / "inductor").exists()
