"""The allowlist walked around (issue 32, class 3), each reproducer against a real agent round.

The third attack got past ``agent --allow`` four ways: a ``*`` that spanned arguments
(``torchrun * -m mytrainer.train *`` admitted ``--no-python /bin/sh -c ...``), an argv[0]
matched as written (``/opt/venv/bin/../../../bin/sh`` passed ``/opt/venv/bin/*``), ``env``
outside the entry (``PYTHONWARNINGS`` + ``BROWSER`` ran a shell command under an exact pinned
line) and an import pattern that admitted a name the module only imports
(``mytrainer.*`` -> ``mytrainer.warmup:os.system``). Each test first runs the payload for real,
outside the agent, to prove it does what the attacker wants (a marker file appears), then
registers it with an admin token on a real server and runs a real agent round whose
allowlist is the one the attack walked around: the marker never appears. Nothing compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.client.agent import AgentOptions, WorkloadOutcome, run_round
from cachekeeper.client.api import CacheClient
from cachekeeper.server.settings import Settings
from tests.helpers.live_server import start_server

TOKENS = {"builder-tok": "write", "ops-tok": "admin"}
BIN = Path(sys.executable).parent
TORCHRUN = str(BIN / "torchrun")


def _round(tmp_path: Path, toml: str, allow: Allowlist) -> WorkloadOutcome:
    """Register ``toml`` as an admin, run one agent round with ``allow``: its outcome."""
    with start_server(Settings(data_dir=tmp_path / "data", tokens=TOKENS)) as live:
        httpx.put(
            f"{live.url}/v1/workloads/evil",
            content=toml,
            headers={"Authorization": "Bearer ops-tok"},
        ).raise_for_status()
        options = AgentOptions(
            devices=("cpu",), work_dir=tmp_path / "work", name="builder", allow=allow
        )
        with CacheClient(base_url=live.url, token="builder-tok") as client:
            (outcome,) = run_round(options, client=client).outcomes
    return outcome


def _command(argv: list[str], env: dict[str, str] | None = None) -> str:
    lines = ['name = "evil"', "[[command]]", f"argv = {json.dumps(argv)}", 'timeout = "2m"']
    if env:
        lines.append("env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }")
    return "\n".join(lines) + "\n"


@pytest.mark.slow  # torchrun imports torch to run the payload once, for real
def test_a_glob_never_spans_arguments(tmp_path: Path, reliability) -> None:
    marker = tmp_path / "ran"
    argv = [TORCHRUN, "--no-python", "/bin/sh", "-c", f"touch {marker}", "-m", "mytrainer.train"]
    argv.append("x")
    subprocess.run(argv, capture_output=True, timeout=300, cwd=tmp_path)
    assert marker.exists(), "the payload itself must work"
    marker.unlink()
    outcome = _round(
        tmp_path, _command(argv), Allowlist.load([f"{TORCHRUN} * -m mytrainer.train *"])
    )
    assert outcome.status == "refused" and not outcome.prewarm_ran, outcome
    assert "it has 7 argument(s)" in outcome.detail and "takes exactly 4" in outcome.detail
    assert not marker.exists()
    reliability.record(
        "allowlist walk-around: 'torchrun * -m mytrainer.train *' against"
        " '--no-python /bin/sh -c ...' (a '*' spanning arguments)",
        tries=1,
        outcome="refused",
        area="allowlist",
    )


def test_argv0_is_judged_where_it_really_is(tmp_path: Path, reliability) -> None:
    venv_bin = tmp_path / "opt" / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    up = "../" * len(venv_bin.parts[1:])
    program = f"{venv_bin}/{up}bin/sh"
    assert Path(program).resolve() == Path("/bin/sh").resolve()
    marker = tmp_path / "ran"
    argv = [program, "-c", f"touch {marker}"]
    subprocess.run(argv, check=True, timeout=30)
    assert marker.exists(), "the payload itself must work"
    marker.unlink()
    outcome = _round(tmp_path, _command(argv), Allowlist.load([f"{venv_bin}/* ..."]))
    assert outcome.status == "refused", outcome
    assert f"no entry admits its program {os.path.realpath('/bin')}/sh" in outcome.detail
    assert not marker.exists()
    reliability.record(
        "allowlist walk-around: argv[0] '/opt/venv/bin/../../../bin/sh' against"
        " '/opt/venv/bin/* ...' (argv[0] resolved to its real folder)",
        tries=1,
        outcome="refused",
        area="allowlist",
    )


@pytest.mark.parametrize(
    "variable",
    ["PYTHONWARNINGS", "LD_PRELOAD", "PYTHONPATH", "PATH"],
)
def test_env_is_part_of_the_entry(tmp_path: Path, variable: str, reliability) -> None:
    """An exact pinned line; the payload rides in the workload's env. PYTHONWARNINGS (with
    BROWSER) is run for real first; the other loader variables are refused the same way."""
    marker = tmp_path / "ran"
    browser = tmp_path / "browser.sh"
    browser.write_text(f"#!/bin/sh\ntouch {marker}\n")
    browser.chmod(0o755)
    env = {"PYTHONWARNINGS": "ignore::antigravity.x", "BROWSER": str(browser)}
    argv = [sys.executable, "-c", "pass"]
    if variable == "PYTHONWARNINGS":
        subprocess.run(argv, env={**os.environ, **env}, timeout=60, capture_output=True)
        assert marker.exists(), "the payload itself must work"
        marker.unlink()
    else:
        env = {variable: str(tmp_path)}
    pinned = Allowlist.load([f"{sys.executable} -c pass"])
    outcome = _round(tmp_path, _command(argv, env), pinned)
    assert outcome.status == "refused", outcome
    assert f"env {variable} is not admitted (a loader variable" in outcome.detail, outcome.detail
    assert not marker.exists()
    reliability.record(
        f"allowlist walk-around: {variable} in the workload's env under an exact pinned"
        " command line (loader variables are part of the entry)",
        tries=1,
        outcome="refused",
        area="allowlist",
    )


def test_an_import_pattern_admits_only_what_the_module_defines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reliability
) -> None:
    pkg = tmp_path / "site" / "mytrainer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "warmup.py").write_text("import os\n\n\ndef step() -> None:\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    marker = tmp_path / "ran"
    target = "mytrainer.warmup:os.system"
    show = (
        "from cachekeeper.mods import load_object\n"
        f"load_object({target!r}, field='t')(command='touch {marker}')\n"
    )
    subprocess.run([sys.executable, "-c", show], check=True, timeout=60)
    assert marker.exists(), "the payload itself must work"
    marker.unlink()
    toml = (
        'name = "evil"\n[[entrypoint]]\n'
        f'target = "{target}"\nkwargs = {{ command = "touch {marker}" }}\n'
    )
    outcome = _round(tmp_path, toml, Allowlist.load(["mytrainer.*"]))
    assert outcome.status == "failed", outcome
    assert "'os' is not defined in mytrainer.warmup" in outcome.detail, outcome.detail
    assert not marker.exists()
    reliability.record(
        "allowlist walk-around: 'mytrainer.*' admitting 'mytrainer.warmup:os.system' (an"
        " import path admitted only for a def or class of its module)",
        tries=1,
        outcome="refused",
        area="allowlist",
    )
