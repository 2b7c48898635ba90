"""``cachekeeper restore --repair`` and what ``verify`` says about corrupt entries (issue 25).

A restore never overwrites: a corrupted entry already in the dir is kept as a conflict, and
a verify of the dir then missed and blamed the workload. Real CPU compiles: the session's
``compiled_cache`` (cpu-tiny's shape) is snapshotted; one of its FX-graph entries is put
corrupt into two fresh dirs before the restore. In one, verify misses and names the
entry with the repair; in the other, ``--repair`` sets the corrupt file aside (kept, byte
for byte) and restores the snapshot's, and verify then hits with zero misses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cachekeeper.restore.marker import recorded_conflicts
from tests.helpers.requires import require

pytestmark = pytest.mark.compile  # real torch.compile runs in children

CK = str(Path(sys.executable).parent / "cachekeeper")
TINY = Path(__file__).resolve().parents[2] / "examples" / "workloads" / "cpu-tiny.toml"


def ck(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHIND"))}
    env["CACHEKEEPER_HOME"] = str(home)
    return subprocess.run([CK, *args], capture_output=True, text=True, env=env, timeout=600)


def test_repair_replaces_a_corrupt_entry_that_verify_names(
    compiled_cache: Path, tmp_path: Path
) -> None:
    require("torch")
    home = tmp_path / "home"
    archive = tmp_path / "snap.tar.zst"
    assert ck("snapshot", str(compiled_cache), "-o", str(archive), home=home).returncode == 0
    entry = next(p for p in (compiled_cache / "fxgraph").rglob("*") if p.is_file())
    rel = entry.relative_to(compiled_cache).as_posix()
    garbage = os.urandom(500)

    def corrupt_restore(name: str) -> Path:
        dst = tmp_path / name
        (dst / rel).parent.mkdir(parents=True)
        (dst / rel).write_bytes(garbage)
        done = ck("restore", str(archive), "--cache-dir", str(dst), home=home)
        assert done.returncode == 0 and "1 conflicts" in done.stdout, done.stdout + done.stderr
        assert f"kept existing {rel}" in done.stderr and "--repair" in done.stderr
        return dst

    named = corrupt_restore("named")
    (files,) = recorded_conflicts(named).values()
    assert list(files) == [rel]
    verify = ck("verify", str(TINY), "--cache-dir", str(named), "--device", "cpu", home=home)
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "differ from its manifest (corrupt entries?" in verify.stdout and rel in verify.stdout
    assert "--repair" in verify.stdout

    fixed = corrupt_restore("fixed")
    repaired = ck("restore", str(archive), "--cache-dir", str(fixed), "--repair", "--json",
                  home=home)  # fmt: skip
    report = json.loads(repaired.stdout)
    assert report["set_aside"] == [rel] and report["conflicts"] == [] and report["written"] == 1
    assert (fixed / rel).read_bytes() == entry.read_bytes()
    assert (Path(report["set_aside_dir"]) / rel).read_bytes() == garbage  # kept, not deleted
    assert recorded_conflicts(fixed) == {}
    again = ck("verify", str(TINY), "--cache-dir", str(fixed), "--device", "cpu", "--json",
               home=home)  # fmt: skip
    assert again.returncode == 0, again.stdout + again.stderr
    (run,) = json.loads(again.stdout)["devices"]
    assert run["counters"].get("fxgraph_cache_miss", 0) == 0, run
