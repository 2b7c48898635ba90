"""Issue 17.5: a snapshot's environment, said and enforced by the local commands.

``restore`` of a snapshot built for another environment refuses, naming the fields, and
``--force`` restores with a warning; ``ls`` shows each snapshot's torch, CUDA, GPU and
verified; the snapshot of a prewarmed dir is that workload's and verified, as push says.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from cachekeeper.cli import cli
from cachekeeper.snapshot.provenance import record_prewarm
from tests.cli.conftest import run

OTHER = {"torch": "2.99.0+cu999", "cuda": "99.9", "python": "2.7"}


def _snapshot_as(cache: Path, archive: Path, fields: dict[str, str], mp: pytest.MonkeyPatch) -> str:
    with mp.context() as m:
        m.setenv("CACHEKEEPER_FINGERPRINT_OVERRIDES", json.dumps(fields))
        out = json.loads(run("snapshot", str(cache), "-o", str(archive), "--json"))
    return str(out["id"])


def test_restore_refuses_another_environment_unless_forced(
    ck_home: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "other.tar.zst"
    sid = _snapshot_as(cache, archive, OTHER, monkeypatch)
    dst = tmp_path / "dst"
    for ref in (str(archive), sid[:8]):
        result = CliRunner().invoke(cli, ["restore", ref, "--cache-dir", str(dst)])
        assert result.exit_code == 1, result.output
        line = result.stderr.strip()
        assert line.count("\n") == 0 and line.startswith("error: snapshot "), line
        assert "built for another environment" in line and "--force" in line, line
        assert "torch: this node " in line and "snapshot 2.99.0+cu999" in line, line
        assert "python: this node " in line and "cuda: this node " in line, line
        assert not dst.exists()  # nothing written
    result = CliRunner().invoke(cli, ["restore", str(archive), "--cache-dir", str(dst), "--force"])
    assert result.exit_code == 0, result.output
    assert "warning: snapshot " in result.stderr and "restoring anyway" in result.stderr
    assert (dst / "ab.py").read_bytes() == b"print(1)"
    # this node's own snapshot restores without a word
    mine = tmp_path / "mine.tar.zst"
    run("snapshot", str(cache), "-o", str(mine))
    result = CliRunner().invoke(cli, ["restore", str(mine), "--cache-dir", str(tmp_path / "e")])
    assert result.exit_code == 0 and result.stderr == "", result.stderr


def test_ls_shows_environment_and_verified(
    ck_home: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    gpu = {"gpus": [{"index": 0, "name": "NVIDIA H200", "capability": "9.0"}]}
    _snapshot_as(cache, tmp_path / "a.tar.zst", {**OTHER, **gpu}, monkeypatch)
    rows = json.loads(run("local", "ls", "--json"))["snapshots"]
    assert [(r["torch"], r["cuda"], r["verified"]) for r in rows] == [
        ("2.99.0+cu999", "99.9", False)
    ]
    table = run("local", "ls")
    assert "TORCH" in table and "GPU" in table and "VERIFIED" in table
    assert "2.99.0+cu999" in table and "99.9" in table


def test_snapshot_of_a_prewarmed_dir_is_verified_like_push(
    ck_home: Path, cache: Path, tmp_path: Path
) -> None:
    # what `cachekeeper prewarm` leaves after a verify that hit (no compile needed here)
    record_prewarm(
        cache,
        workload="tiny",
        workload_digest="ab" * 32,
        devices=["cpu"],
        stats={"verify": {"effective": True}},
    )
    archive = tmp_path / "p.tar.zst"
    run("snapshot", str(cache), "-o", str(archive))
    info = run("inspect", str(archive))
    assert "workload     tiny" in info and "verified     yes" in info, info
    assert "devices      cpu" in info, info
    # two workloads recorded: which one is unknown, so neither is claimed
    record_prewarm(
        cache,
        workload="other",
        workload_digest="cd" * 32,
        devices=["cpu"],
        stats={"verify": {"effective": True}},
    )
    run("snapshot", str(cache), "-o", str(archive))
    info = run("inspect", str(archive))
    assert "workload     -" in info and "verified     no" in info, info
