"""The operator commands (issue 17.7) against a real server on loopback with auth on.

``docs/operations.md``'s "Day one" steps run exactly as written (only the server URL and
the id in the pin step change: the doc cannot know either); every CLI command and
subcommand has help text.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import click
import httpx
import pytest
from click.testing import CliRunner

from cachekeeper.cli import COMMANDS, cli
from cachekeeper.server.settings import Settings
from tests.cli.conftest import run
from tests.helpers.live_server import LiveServer, start_server
from tests.server.conftest import make_snapshot, push

ROOT = Path(__file__).resolve().parents[2]
DOC_URL = "https://cache:8750"  # the docs say https: a token never goes over plain http
TOKENS = {"builder-secret": "write", "node-secret": "read", "ops-secret": "admin"}
# the steps that need neither docker (1) nor a builder that compiles (3)
RUNNABLE = re.compile(r"cachekeeper (workload|prejob|status|snapshots|gc)\b")


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveServer]:
    handle = start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS, gc_grace_s=0))
    try:
        yield handle
    finally:
        handle.stop()


def _day_one_commands() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    block = text.split("Day one", 1)[1].split("```console", 1)[1].split("```", 1)[0]
    commands: list[str] = []
    for line in block.replace("\\\n", " ").splitlines():
        if line.startswith("$ "):
            commands.append(line[2:].strip())
    return commands


def _sh(command: str, *, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"set -e -o pipefail\n{command}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow  # seven CLI processes
def test_day_one_steps_run_as_written(live: LiveServer, tmp_path: Path) -> None:
    commands = _day_one_commands()
    runnable = [c for c in commands if RUNNABLE.search(c)]
    assert len(runnable) == 7, commands  # register, ls, prejob, status, snapshots ls/pin, gc
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith("CACHEKEEPER_") and not k.startswith("TORCHINDUCTOR_")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["CACHEKEEPER_HOME"] = str(tmp_path / "home")
    snapshot_id = ""
    outputs: list[str] = []
    for command in runnable:
        if "snapshots ls" in command:
            # what an agent would publish (step 3 needs a GPU builder)
            manifest, blobs = make_snapshot({"a.bin": b"a"}, workload="drafter", verified=True)
            with httpx.Client(
                base_url=live.url, headers={"Authorization": "Bearer builder-secret"}
            ) as c:
                assert push(c, manifest, blobs).status_code == 201
            snapshot_id = manifest.id
        if "snapshots pin" in command:  # the doc cannot know the id (a prefix, as it shows)
            command = re.sub(r"pin [0-9a-f]+", f"pin {snapshot_id[:8]}", command)
        result = _sh(command.replace(DOC_URL, live.url), env=env)
        assert result.returncode == 0, (command, result.stdout, result.stderr)
        outputs.append(result.stdout)
    assert outputs[0].startswith("registered drafter ")
    assert "drafter" in outputs[1]
    assert outputs[3].strip()  # status: no agent has reported yet, so no rows
    assert snapshot_id[:12] in outputs[4]
    assert outputs[5].strip() == f"pinned {snapshot_id}"
    assert outputs[6].startswith(f"server gc ({live.url}): 0 snapshots evicted")
    listed = httpx.get(
        f"{live.url}/v1/snapshots", headers={"Authorization": "Bearer node-secret"}
    ).json()["snapshots"]
    assert [s["pinned"] for s in listed] == [True]


def test_workload_snapshot_and_gc_commands_json_and_errors(
    live: LiveServer, tmp_path: Path
) -> None:
    url = live.url
    write = ("--server", url, "--token", "builder-secret")
    admin = ("--server", url, "--token", "ops-secret")
    read = ("--server", url, "--token", "node-secret")
    wl = tmp_path / "wl.toml"
    wl.write_text('name = "tiny"\n[[entrypoint]]\ntarget = "pkg.mod:step"\n')
    # code a builder would run: the write scope is not enough, and the line says why
    out = fail("workload", "register", str(wl), *write)
    assert out.count("\n") == 1 and "holds code a builder would run" in out, out
    assert "entrypoint[0].target" in out and "'admin' scope" in out, out
    info = json.loads(run("workload", "register", str(wl), *admin, "--json"))
    assert info["name"] == "tiny" and len(info["digest"]) == 64
    assert json.loads(run("workload", "ls", *read, "--json"))["workloads"][0]["name"] == "tiny"

    # a read token cannot remove: one line naming the scope, exit code of Forbidden
    out = fail("workload", "rm", "tiny", *read)
    assert out.count("\n") == 1 and out.startswith("error: ") and "admin" in out, out
    # an invalid file: refused here with the file's name, nothing sent
    bad = tmp_path / "bad.toml"
    bad.write_text('name = "x y"\n')
    out = fail("workload", "register", str(bad), *write)
    assert out.startswith("error: bad.toml") and "[invalid_workload]" in out, out

    manifest, blobs = make_snapshot({"b.bin": b"b"}, workload="tiny")
    with httpx.Client(base_url=url, headers={"Authorization": "Bearer builder-secret"}) as c:
        assert push(c, manifest, blobs).status_code == 201
    rows = json.loads(run("snapshots", "ls", "--workload", "tiny", *read, "--json"))
    assert [s["id"] for s in rows["snapshots"]] == [manifest.id]
    assert json.loads(run("snapshots", "ls", "--workload", "other", *read, "--json")) == {
        "snapshots": []
    }
    assert json.loads(run("snapshots", "pin", manifest.id[:6], *write, "--json"))["pinned"]
    assert not json.loads(run("snapshots", "unpin", manifest.id, *write, "--json"))["pinned"]
    out = fail("snapshots", "pin", "abc", *write)
    assert "at least 4 characters" in out and "[snapshot_not_found]" in out, out
    out = fail("snapshots", "pin", "ffff", *write)
    assert "no snapshot 'ffff' on the server" in out, out

    dry = json.loads(run("gc", "--server", url, "--token", "ops-secret", "--dry-run", "--json"))
    assert dry["dry_run"] is True
    removed = json.loads(run("snapshots", "rm", manifest.id[:8], "--yes", *admin, "--json"))
    assert removed == {"snapshots_removed": [manifest.id]}
    assert json.loads(run("snapshots", "ls", *read, "--json")) == {"snapshots": []}
    done = json.loads(run("gc", "--server", url, "--token", "ops-secret", "--json"))
    assert done["dry_run"] is False and done["blobs_deleted"] == 1
    run("workload", "rm", "tiny", *admin)
    out = fail("workload", "rm", "tiny", *admin)
    assert "no workload 'tiny' is registered" in out, out
    # no server: a usage error, not a traceback
    out = fail("snapshots", "ls", code=2)
    assert "no server" in out


def test_local_gc_stays_local_with_a_server_configured(
    live: LiveServer, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CACHEKEEPER_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("CACHEKEEPER_SERVER", "http://127.0.0.1:9")  # nothing listens there
    assert "dry_run" in json.loads(run("gc", "--dry-run", "--json"))
    monkeypatch.setenv("CACHEKEEPER_SERVER", live.url)
    monkeypatch.setenv("CACHEKEEPER_TOKEN", "ops-secret")
    assert "snapshots_evicted" in json.loads(run("gc", "--server", "--dry-run", "--json"))


def fail(*args: str, code: int | None = None) -> str:
    """Run a command that must fail; its stderr (its output for a usage error, code 2)."""
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code != 0 if code is None else result.exit_code == code, result.output
    return result.stderr if code != 2 else result.output


def _walk(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        ctx = click.Context(command)
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            assert sub is not None, f"{path} {name}"
            yield from _walk(sub, f"{path} {name}")


def test_every_command_has_help_text() -> None:
    walked = dict(_walk(cli, "cachekeeper"))
    assert {f"cachekeeper {name}" for name in COMMANDS} <= walked.keys()
    assert "cachekeeper snapshots pin" in walked and "cachekeeper workload register" in walked
    for path, command in walked.items():
        assert (command.help or "").strip(), f"{path} has no help text"
        for param in command.params:
            if isinstance(param, click.Option) and not param.hidden:
                assert (param.help or "").strip(), f"{path} {param.opts[0]} has no help text"
