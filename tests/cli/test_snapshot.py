"""The local snapshot and store commands (cli/local_snapshot.py, cli/local.py), through click against
a real store and real archives; the help check also covers cli/fingerprint.py."""

from __future__ import annotations

import json
from pathlib import Path

import click
from click.testing import CliRunner

from cachekeeper.cli import COMMANDS, cli
from tests.cli.conftest import run

LOCAL_MODULES = (
    "cachekeeper.cli.local_snapshot:",
    "cachekeeper.cli.local:",
    "cachekeeper.cli.fingerprint:",
)
OWNED = {name for name, (target, _) in COMMANDS.items() if target.startswith(LOCAL_MODULES)}


def test_every_local_command_has_help_text() -> None:
    assert OWNED == {
        *("fingerprint", "explain", "snapshot", "restore", "inspect", "local", "ls", "rm", "gc")
    }
    for name in sorted(OWNED):
        command = cli.get_command(click.Context(cli), name)
        assert command is not None and (command.help or "").strip(), name
        assert "not available" not in (command.help or ""), name
        out = run(name, "--help")
        assert "Usage:" in out


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

    rows = json.loads(run("local", "ls", "--json"))["snapshots"]
    assert [r["id"] for r in rows] == [sid]
    assert sid[:12] in run("local", "ls")

    plan = json.loads(run("local", "rm", sid, "--dry-run", "--json"))
    assert plan["dry_run"] and plan["bytes_freed"] > 0 and plan["snapshots_removed"] == [sid]
    assert json.loads(run("local", "ls", "--json"))["snapshots"] != []
    done = json.loads(run("local", "rm", sid, "--yes", "--json"))
    assert done["bytes_freed"] == plan["bytes_freed"] and done["blobs_deleted"] == 2
    assert json.loads(run("local", "ls", "--json")) == {"snapshots": []}
    assert json.loads(run("local", "gc", "--json"))["blobs_deleted"] == 0


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
