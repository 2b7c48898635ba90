"""The first day of a new site (issue 17): paths that cannot be written, empty paths, an
unregistered workload, and the messages a newcomer meets. Every command is a real process
(or click's runner), against a real server where one is involved.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from cachekeeper.server.settings import Settings
from tests.cli.conftest import ck
from tests.helpers.live_server import LiveServer, start_server

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "workloads" / "cpu-tiny.toml"


@pytest.fixture
def unwritable(tmp_path: Path) -> Path:
    """A directory this process cannot create files in (root ignores modes: use sysfs)."""
    if os.geteuid() != 0:
        folder = tmp_path / "read-only"
        folder.mkdir()
        folder.chmod(0o555)
        yield folder
        folder.chmod(0o755)
        return
    folder = Path("/sys")
    probe = folder / f"cachekeeper-probe-{uuid.uuid4().hex}"
    try:
        probe.write_text("")
    except OSError:
        yield folder
        return
    probe.unlink()
    pytest.skip("no unwritable directory available to root here")


def one_error_line(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """The single stderr line, which must hold each needle and no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


# -- 17.1: a path that cannot be written is one line, and never fails the job -----------
def test_prejob_with_an_unwritable_env_file_still_exports(tmp_path: Path, unwritable: Path) -> None:
    env_file = unwritable / "prejob.env"
    proc = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c"),
              "--env-file", str(env_file), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"export TORCHINDUCTOR_CACHE_DIR={tmp_path / 'c'}\n"
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    prefix = f"cachekeeper: cannot write the env file {env_file}: "
    assert any(line.startswith(prefix) for line in lines), proc.stderr
    strict = ck("prejob", "--workload", "w", "--cache-dir", str(tmp_path / "c"), "--strict",
                "--env-file", str(env_file), cwd=tmp_path)  # fmt: skip
    assert strict.returncode != 0 and strict.stdout == ""


def test_snapshot_to_an_unwritable_archive_is_one_line(
    tmp_path: Path, unwritable: Path, cache: Path
) -> None:
    out = unwritable / "cache.tar.zst"
    proc = ck("snapshot", str(cache), "-o", str(out), cwd=tmp_path)
    assert proc.returncode == 1
    one_error_line(proc, f"error: {out}: ")


def test_restore_into_an_unwritable_dir_is_one_line(
    tmp_path: Path, unwritable: Path, cache: Path
) -> None:
    archive = tmp_path / "cache.tar.zst"
    assert ck("snapshot", str(cache), "-o", str(archive), cwd=tmp_path).returncode == 0
    proc = ck("restore", str(archive), "--cache-dir", str(unwritable / "c"), cwd=tmp_path)
    assert proc.returncode == 1
    one_error_line(proc, "error: ", str(unwritable / "c"))


def test_push_with_an_unwritable_local_store_is_one_line(
    tmp_path: Path, unwritable: Path, cache: Path, tiny_server: LiveServer
) -> None:
    proc = ck("push", str(cache), "--workload", "cpu-tiny", "--server", tiny_server.url,
              cwd=tmp_path, home=unwritable / "ck-home")  # fmt: skip
    assert proc.returncode == 1
    one_error_line(proc, "error: ", str(unwritable / "ck-home"))


def test_pull_into_an_unwritable_dir_is_one_line(
    tmp_path: Path, unwritable: Path, cache: Path, tiny_server: LiveServer
) -> None:
    pushed = ck(
        "push", str(cache), "--workload", "cpu-tiny", "--server", tiny_server.url, cwd=tmp_path
    )
    assert pushed.returncode == 0, pushed.stderr
    proc = ck("pull", "--workload", "cpu-tiny", "--cache-dir", str(unwritable / "c"),
              "--server", tiny_server.url, cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 1
    one_error_line(proc, "error: ", str(unwritable / "c"))


# -- 17.2: an empty path is refused, and nothing lands in the cwd ----------------------
@pytest.mark.parametrize(
    "args",
    [
        ["prejob", "--workload", "w", "--cache-dir", ""],
        ["prejob", "--workload", "w", "--env-file", ""],
        ["pull", "--workload", "w", "--cache-dir", "", "--server", "http://127.0.0.1:9"],
        ["verify", str(TINY), "--cache-dir", ""],
        ["prewarm", str(TINY), "--cache-dir", " "],
        ["restore", "x.tar.zst", "--cache-dir", ""],
        ["snapshot", ""],
        ["push", "", "--workload", "w"],
    ],
    ids=lambda a: f"{a[0]}:{a[a.index('') if '' in a else -1]!s}",
)
def test_an_empty_path_is_a_usage_error(tmp_path: Path, args: list[str]) -> None:
    work = tmp_path / "cwd"
    work.mkdir()
    proc = ck(*args, cwd=work, home=tmp_path / "home")
    assert proc.returncode == 2, proc.stderr
    assert "an empty path is not allowed" in proc.stderr
    assert list(work.iterdir()) == []


# -- 17.6: push names what it publishes ------------------------------------------------
def test_push_of_an_unregistered_workload_is_refused_unless_allowed(
    tmp_path: Path, cache: Path, tiny_server: LiveServer
) -> None:
    proc = ck("push", str(cache), "--workload", "typo", "--server", tiny_server.url, cwd=tmp_path)
    assert proc.returncode == 1
    one_error_line(proc, "no workload 'typo' is registered", "--allow-unregistered",
                   "[workload_not_found]")  # fmt: skip
    listed = httpx.get(f"{tiny_server.url}/v1/snapshots", params={"workload": "typo"}).json()
    assert listed["snapshots"] == []
    proc = ck("push", str(cache), "--workload", "typo", "--allow-unregistered",
              "--server", tiny_server.url, "--json", cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["verified"] is False


def test_push_says_the_snapshot_is_unverified_and_why(
    tmp_path: Path, cache: Path, tiny_server: LiveServer
) -> None:
    # A prewarm record for another workload, as `cachekeeper prewarm` leaves it.
    record = cache / ".cachekeeper" / "prewarm" / "other.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"workload": "other", "stats": {"verify": {"effective": True}}}))
    proc = ck(
        "push", str(cache), "--workload", "cpu-tiny", "--server", tiny_server.url, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    warning = proc.stderr.strip().splitlines()[-1]
    assert warning.startswith("warning: snapshot ")
    assert "published unverified" in warning
    assert "prewarmed and verified for 'other', not for 'cpu-tiny'" in warning
    assert "(unverified)" in proc.stdout


# -- 17.13: messages a newcomer meets -------------------------------------------------
def test_inspect_of_a_missing_file_says_file_not_found(tmp_path: Path) -> None:
    proc = ck("inspect", "missing.tar.zst", cwd=tmp_path)
    assert proc.returncode == 1
    one_error_line(proc, "missing.tar.zst", "file not found")


def test_a_short_id_prefix_says_it_needs_4_characters(tmp_path: Path, cache: Path) -> None:
    assert ck("snapshot", str(cache), cwd=tmp_path).returncode == 0
    proc = ck("rm", "073", "--yes", cwd=tmp_path)
    assert proc.returncode == 1
    one_error_line(proc, "'073'", "at least 4 characters")


def test_pull_help_shows_workload_as_an_option(tmp_path: Path) -> None:
    for command in ("pull", "push", "prejob"):
        text = ck(command, "--help", cwd=tmp_path).stdout
        description = " ".join(text.split("Options:")[0].split())
        assert "WORKLOAD" not in description, (command, description)
        assert "--workload NAME" in description


# -- 17.10: progress on stderr, the report alone on stdout; agent lines carry the time -----
QUICK_TOML = """\
name = "quick"
[[entrypoint]]
target = "fixtures_pkg.warmup:sleep"
kwargs = { seconds = 0 }
"""


@pytest.mark.slow  # two torch children start
def test_prewarm_json_prints_progress_on_stderr_and_only_json_on_stdout(tmp_path: Path) -> None:
    """An entrypoint that compiles nothing: the children start torch, nothing is cached,
    so the verify finds no hit (exit 1); the claim is only where each line goes."""
    workload = tmp_path / "quick.toml"
    workload.write_text(QUICK_TOML)
    fixtures = REPO / "tests" / "e2e"
    proc = ck("prewarm", str(workload), "--cache-dir", str(tmp_path / "c"), "--device", "cpu",
              "--json", cwd=tmp_path, PYTHONPATH=str(fixtures))  # fmt: skip
    assert proc.returncode in (0, 1), proc.stderr
    report = json.loads(proc.stdout)  # the whole of stdout is one JSON document
    assert report["workload"] == "quick"
    progress = [line for line in proc.stderr.splitlines() if "entrypoint" in line]
    assert any(line.rstrip().endswith("...") for line in progress), proc.stderr
    assert any("cpu prewarm entrypoint[0]" in line for line in progress), proc.stderr
    assert any("cpu verify entrypoint[0]" in line for line in progress), proc.stderr


def test_agent_log_lines_carry_a_utc_timestamp(tmp_path: Path) -> None:
    with start_server(Settings(data_dir=tmp_path / "server")) as server:
        proc = ck("agent", "--server", server.url, "--once", "--device", "cpu", "--json",
                  "--work-dir", str(tmp_path / "work"), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines and any("round done" in line for line in lines), proc.stderr
    for line in lines:
        assert re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ ", line), line
    assert json.loads(proc.stdout)["outcomes"] == []
