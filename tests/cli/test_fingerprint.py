"""fingerprint and explain (cli/fingerprint.py), through click against real archives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.cli.conftest import run


def test_fingerprint_json_has_digest(ck_home: Path) -> None:
    body = json.loads(run("fingerprint", "--json"))
    assert len(body["digest"]) == 64 and "torch" in body["fingerprint"]
    assert "digest" in run("fingerprint")


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
