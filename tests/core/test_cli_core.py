"""The core CLI commands, run through click against a real store and real archives."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cachekeeper.cli import COMMANDS, cli

OWNED = {
    name for name, (target, _) in COMMANDS.items() if target.startswith("cachekeeper.cli.core:")
}


def run(*args: str, code: int = 0) -> str:
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    root = tmp_path / "cache"
    (root / "fxgraph" / "ab").mkdir(parents=True)
    (root / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    (root / "ab.py").write_bytes(b"print(1)")
    return root


def test_every_core_command_has_help_text() -> None:
    assert OWNED == {"fingerprint", "explain", "snapshot", "restore", "inspect", "ls", "rm", "gc"}
    for name in sorted(OWNED):
        command = cli.get_command(click.Context(cli), name)
        assert command is not None and (command.help or "").strip(), name
        assert "not available" not in (command.help or ""), name
        out = run(name, "--help")
        assert "Usage:" in out


def test_fingerprint_json_has_digest(ck_home: Path) -> None:
    body = json.loads(run("fingerprint", "--json"))
    assert len(body["digest"]) == 64 and "torch" in body["fingerprint"]
    assert "digest" in run("fingerprint")


def test_snapshot_inspect_restore_ls_rm_gc(ck_home: Path, cache: Path, tmp_path: Path) -> None:
    archive = tmp_path / "snap.tar.zst"
    snap = json.loads(run("snapshot", str(cache), "-o", str(archive), "--workload", "w", "--json"))
    assert snap["files"] == 2 and archive.is_file()
    sid = snap["id"]

    info = json.loads(run("inspect", str(archive), "--json"))
    assert info["id"] == sid and info["file_count"] == 2 and info["workload"] == "w"
    assert "fxgraph/ab/entry" in run("inspect", sid[:10], "--files")

    dry = json.loads(
        run("restore", str(archive), "--cache-dir", str(tmp_path / "d"), "--dry-run", "--json")
    )
    assert dry["dry_run"] and len(dry["planned"]) == 2 and not (tmp_path / "d").exists()
    done = json.loads(run("restore", str(archive), "--cache-dir", str(tmp_path / "d"), "--json"))
    assert done["written"] == 2
    by_id = json.loads(run("restore", sid, "--cache-dir", str(tmp_path / "e"), "--json"))
    assert by_id["written"] == 2
    assert (tmp_path / "e" / "ab.py").read_bytes() == b"print(1)"

    rows = json.loads(run("ls", "--json"))
    assert [r["id"] for r in rows] == [sid]
    assert sid[:12] in run("ls")

    plan = json.loads(run("rm", sid, "--dry-run", "--json"))
    assert plan["dry_run"] and plan["freed_bytes"] > 0
    assert json.loads(run("ls", "--json")) != []
    json.loads(run("rm", sid, "--yes", "--json"))
    assert json.loads(run("ls", "--json")) == []
    assert json.loads(run("gc", "--json"))["blob_count"] == 0


def test_restore_reports_conflicts_but_exits_zero(
    ck_home: Path, cache: Path, tmp_path: Path
) -> None:
    archive = tmp_path / "snap.tar.zst"
    run("snapshot", str(cache), "-o", str(archive))
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "ab.py").write_bytes(b"mine")
    result = CliRunner().invoke(cli, ["restore", str(archive), "--cache-dir", str(dst)])
    assert result.exit_code == 0
    assert "warning: kept existing ab.py" in result.output
    assert (dst / "ab.py").read_bytes() == b"mine"


def test_errors_are_one_line_with_exit_code(ck_home: Path, tmp_path: Path) -> None:
    bogus = tmp_path / "bogus.tar.zst"
    bogus.write_bytes(b"junk")
    result = CliRunner().invoke(cli, ["restore", str(bogus), "--cache-dir", str(tmp_path / "d")])
    assert result.exit_code == 1
    assert result.output.strip().startswith("error:") and "[unsupported_format]" in result.output
    result = CliRunner().invoke(cli, ["inspect", "deadbeef"])
    assert result.exit_code == 1 and "[snapshot_not_found]" in result.output


def test_link_in_cache_dir_is_named(ck_home: Path, cache: Path) -> None:
    (cache / "link").symlink_to(cache / "ab.py")
    result = CliRunner().invoke(cli, ["snapshot", str(cache)])
    assert (
        result.exit_code == 1 and "link" in result.output and "[link_in_cache_dir]" in result.output
    )


def test_explain_exit_codes(
    ck_home: Path, cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    archive = tmp_path / "snap.tar.zst"
    run("snapshot", str(cache), "-o", str(archive))
    body = json.loads(run("explain", str(archive), "--json"))
    assert body["compatible"] is True and body["mismatches"] == []
    monkeypatch.setenv("CACHEKEEPER_FINGERPRINT_OVERRIDES", json.dumps({"torch": "9.9.9+other"}))
    out = run("explain", str(archive), code=1)
    assert "torch" in out and "9.9.9+other" in out
