"""The CLI's nouns (issue 33): what a command acts on, then the verb, as in ``hf cache ls``.

The spellings before them (``ls``, ``rm``, ``gc``, ``gc --server``) are aliases for one
release: they must print exactly what the new spelling prints on stdout (where --json
goes), exit the same, and say their new spelling in one line on stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from cachekeeper.cli import ALIASES, COMMANDS, cli
from tests.helpers.live_server import LiveServer


def invoke(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_every_old_spelling_runs_as_its_new_one_and_names_it(
    ck_home: Path, cache: Path, open_server: LiveServer
) -> None:
    snap = json.loads(invoke("snapshot", str(cache), "--json").stdout)
    url = open_server.url
    pairs = [
        (["ls", "--json"], ["local", "ls", "--json"], "local ls"),
        (["ls"], ["local", "ls"], "local ls"),
        (["rm", snap["id"][:8], "--dry-run", "--json"], ["local", "rm", snap["id"][:8],
         "--dry-run", "--json"], "local rm"),
        (["gc", "--dry-run", "--json"], ["local", "gc", "--dry-run", "--json"], "local gc"),
        (["gc", "--server", url, "--dry-run", "--json"],
         ["snapshots", "gc", "--server", url, "--dry-run", "--json"], "snapshots gc"),
        (["gc", "--server", url, "--dry-run"], ["snapshots", "gc", "--server", url, "--dry-run"],
         "snapshots gc"),
        (["rm", "ffffffff", "--yes"], ["local", "rm", "ffffffff", "--yes"], "local rm"),
    ]  # fmt: skip
    assert {old[0] for old, _, _ in pairs} == {"ls", "rm", "gc"}
    for old, new, spelled in pairs:
        was, now = invoke(*old), invoke(*new)
        assert (was.exit_code, was.stdout) == (now.exit_code, now.stdout), (old, was.output)
        note = f"cachekeeper: '{' '.join(old[:2]) if '--server' in old else old[0]}' is now"
        lines = was.stderr.splitlines()
        assert (
            lines[0] == f"{note} 'cachekeeper {spelled}'; the old spelling goes in the next release"
        )
        assert lines[1:] == now.stderr.splitlines(), (old, was.stderr, now.stderr)
        assert "old spelling" not in now.stderr
    assert json.loads(invoke("ls", "--json").stdout)["snapshots"][0]["id"] == snap["id"]
    assert "no snapshot 'ffffffff'" in invoke("rm", "ffffffff", "--yes").stderr


def test_gc_server_without_a_url_still_reads_the_configured_server(
    ck_home: Path, open_server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CACHEKEEPER_SERVER", open_server.url)
    was = invoke("gc", "--server", "--dry-run", "--json")
    assert was.exit_code == 0 and "snapshots_evicted" in json.loads(was.stdout)
    assert "'gc --server' is now 'cachekeeper snapshots gc'" in was.stderr


def test_the_new_spellings_are_in_help_and_the_old_ones_say_what_replaces_them() -> None:
    top = invoke("--help").stdout
    assert "local " in top and "List, remove and garbage-collect the local store" in top
    for noun, verbs in {
        "local": ("ls", "rm", "gc"),
        "snapshots": ("ls", "pin", "unpin", "rm", "gc"),
        "cache": ("ls", "prune"),
        "workload": ("register", "ls", "rm"),
    }.items():
        text = invoke(noun, "--help").stdout
        listed = text.split("Commands:", 1)[1].split()
        assert all(verb in listed for verb in verbs), (noun, text)
    for old in ("ls", "rm", "gc"):
        assert old in COMMANDS and "Old spelling" in COMMANDS[old][1]
        text = invoke(old, "--help").stdout
        assert f"Old spelling of 'cachekeeper {ALIASES[old]}'" in " ".join(text.split())
    assert "'cachekeeper snapshots gc'" in " ".join(invoke("gc", "--help").stdout.split())
