"""Builds contained and judged from outside (issue 32, class 4), with real processes.

The third attack found that a build judged itself and was not contained: a command wrote its
own evidence file and was "verified" without importing torch; a child that missed and ended
with ``os._exit(0)`` left no evidence, so the run counted as verified; daemons a command
started (double fork, ``setsid``) outlived its timeout and every normal exit; and the
command could read the builder's signing key. Each reproducer runs here for real: the
verify ones against a real compiled cache (``compiled_cache``) and real compiles, the
others with real process trees and a real agent round against a real server.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.children import run_children, work_area
from cachekeeper.client.agent import AgentOptions, prepare_options, run_round
from cachekeeper.client.api import CacheClient
from cachekeeper.commands import run_command
from cachekeeper.confine import Confinement
from cachekeeper.errors import BuildsUnconfined
from cachekeeper.server.settings import Settings
from cachekeeper.signing import generate_keypair
from cachekeeper.verify import verify
from cachekeeper.workload import Command, parse_workload
from tests.helpers import seccomp
from tests.helpers.live_server import start_server

REPO = Path(__file__).resolve().parents[2]
PROBE = REPO / "tests" / "flex_probe.py"
PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _gone(pids: list[int], *, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(_alive(p) for p in pids)


def _workload(argv: list[str]) -> str:
    return f'name = "w"\n[[command]]\nargv = {json.dumps(argv)}\ntimeout = "10m"\n'


# -- judged from outside ---------------------------------------------------------------------

_FORGER = """
import json, os, sys
folder = os.environ["CACHEKEEPER_EVIDENCE_DIR"]
pid = os.getpid()
hits = {"fxgraph_cache_hit": 4, "fxgraph_cache_miss": 0, "autograd_cache_hit": 4}
end = {"pid": pid, "rank": 0, "device": "cpu", "threads": 1, "counters": hits,
       "exit": {"status": "ok", "code": 0, "error": ""}}
if sys.argv[1] == "both":
    json.dump({"pid": pid, "argv": ["train.py"]}, open(f"{folder}/start-{pid}.json", "w"))
json.dump(end, open(f"{folder}/proc-{pid}.json", "w"))
"""


@pytest.mark.parametrize("forged", ["end", "both"])
def test_a_command_that_writes_its_own_evidence_is_not_verified(
    cache_copy: Path, forged: str, reliability
) -> None:
    """It never imports torch and claims 4 hits: an end record alone (the old evidence), or
    a start and an end record (what the hook writes now). The cache copy's entries are
    never read, and that is what the judge sees."""
    workload = parse_workload(_workload([PY, "-c", _FORGER, forged]), source="w.toml")
    report = verify(workload, cache_copy, devices=[])
    (run,) = report.commands
    assert run.status == "ok" and run.exit_code == 0, run
    if forged == "both":  # the fault: the forged record is taken as a process that hit
        (proc,) = run.processes
        assert proc.effective and proc.counters["fxgraph_cache_hit"] == 4
    assert report.status == "not_effective", report.to_dict()
    assert run.watch is not None and run.watch.read == 0 and run.watch.entries >= 2
    reasons = "\n".join(report.reasons)
    assert "FX graph/AOTAutograd entries was read during the run: nothing hit it" in reasons
    if forged == "end":
        assert "has no start record: cachekeeper's evidence hook did not write it" in reasons
    reliability.record(
        f"verify of a command that writes its own evidence ({forged} record(s), 4 hits"
        " claimed) and never imports torch",
        tries=1,
        outcome="refused",
        area="verify",
    )


_MISSER = f"""
import ctypes, os, runpy, subprocess, sys
probe = {str(PROBE)!r}
# a child that misses (a shape the cache does not hold), then ends with os._exit(0)
subprocess.run([sys.executable, "-c",
    "import os, runpy, sys; sys.argv = ['probe', '256']; "
    f"runpy.run_path({{probe!r}}, run_name='__main__'); os._exit(0)"], check=True)
# a child that imports torch._dynamo and ends below Python, writing nothing
subprocess.run([sys.executable, "-c",
    "import ctypes, torch._dynamo; ctypes.CDLL(None)._exit(0)"], check=True)
# the parent hits (the shape the cache holds)
sys.argv = ["probe"]
runpy.run_path(probe, run_name="__main__")
"""


@pytest.mark.compile  # the parent and one child compile flex_attention for real
def test_a_child_that_misses_and_ends_with_os_exit_fails_the_verify(
    cache_copy: Path, reliability
) -> None:
    workload = parse_workload(_workload([PY, "-c", _MISSER]), source="w.toml")
    report = verify(workload, cache_copy, devices=[])
    (run,) = report.commands
    assert run.status == "ok" and run.exit_code == 0, run
    parent = next(p for p in run.processes if p.exit_status == "ok")
    assert parent.effective  # the fault: the process that reports best hit every entry
    assert report.status == "not_effective", report.to_dict()
    missed = next(p for p in run.processes if p.exit_status == "os_exit")
    assert missed.counters["fxgraph_cache_miss"] >= 1, missed  # os._exit is no longer silent
    assert run.watch is not None and run.watch.gained_count >= 1  # seen from outside
    reasons = "\n".join(report.reasons)
    assert "gained or changed" in reasons and "whatever the processes reported" in reasons
    assert "imported torch._dynamo and left no end record" in reasons  # the C-level _exit
    reliability.record(
        "verify of a command whose child misses and ends with os._exit(0), and whose other"
        " child imports torch and ends below Python (no evidence either way)",
        tries=1,
        outcome="refused",
        area="verify",
    )


# -- the whole tree reaped -------------------------------------------------------------------

_DAEMONS = """
import os, subprocess, sys, time
pids = sys.argv[1]
if os.fork() == 0:  # a double-forked, setsid daemon
    os.setsid()
    if os.fork() == 0:
        open(pids + ".daemon", "w").write(str(os.getpid()))
        time.sleep(600)
    os._exit(0)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                         start_new_session=True)  # a background child in its own session
open(pids + ".child", "w").write(str(child.pid))
while not os.path.exists(pids + ".daemon"):
    time.sleep(0.05)
time.sleep(float(sys.argv[2]))
"""


def _pids(prefix: Path) -> list[int]:
    return [int(Path(f"{prefix}.{kind}").read_text()) for kind in ("daemon", "child")]


@pytest.mark.parametrize("ending", ["normal exit", "timeout"])
def test_daemons_a_command_starts_never_outlive_it(tmp_path: Path, ending: str, reliability):
    pids = tmp_path / "pids"
    (tmp_path / "cache").mkdir()
    hang = ending == "timeout"
    command = Command(argv=(PY, "-c", _DAEMONS, str(pids), "600" if hang else "0"))
    run = run_command(
        command,
        index=0,
        mode="prewarm",
        cache_dir=tmp_path / "cache",
        work=tmp_path,
        timeout_s=3.0 if hang else None,
    )
    started = _pids(pids)  # the fault: both were started and outlived their parent's session
    assert _gone(started), [p for p in started if _alive(p)]
    if hang:
        assert run.status == "timeout"
    else:
        assert run.status == "ok" and len(run.left_running) == 2, run.left_running
        assert all("time.sleep" in line or "-c" in line for line in run.left_running)
    reliability.record(
        f"a command that starts a double-forked setsid daemon and a background child, then"
        f" ends ({ending}): no process of its tree survives",
        tries=1,
        outcome="kept",
        area="builds",
    )


@pytest.mark.slow  # a prewarm child imports torch
def test_daemons_an_entrypoint_starts_never_outlive_its_child(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reliability
) -> None:
    pkg = tmp_path / "site" / "warmpkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    marker = tmp_path / "daemon.pid"
    (pkg / "warmup.py").write_text(
        "import os, time\n\n\ndef step() -> None:\n    if os.fork() == 0:\n"
        "        os.setsid()\n        if os.fork() == 0:\n"
        f"            open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
        "            time.sleep(600)\n        os._exit(0)\n"
        f"    while not os.path.exists({str(marker)!r}):\n        time.sleep(0.05)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    workload = parse_workload(
        'name = "w"\n[[entrypoint]]\ntarget = "warmpkg.warmup:step"\n', source="w.toml"
    )
    cache = tmp_path / "cache"
    cache.mkdir()
    with work_area(cache) as work:
        (run,) = run_children(
            workload, {"cpu": cache}, mode="prewarm", work=work, progress=None, timeout_s=300
        )
    assert run.status == "ok", run
    daemon = int(marker.read_text())
    assert _gone([daemon])
    reliability.record(
        "an entrypoint that starts a double-forked setsid daemon in its prewarm child: gone"
        " when the child ends",
        tries=1,
        outcome="kept",
        area="builds",
    )


# -- the signing key out of reach ------------------------------------------------------------

_SNOOP = """
import os, sys
out, key = sys.argv[1], sys.argv[2]
folder, name = os.path.split(key)
supervisor = os.getppid()
stat = open(f"/proc/{supervisor}/stat").read()
agent = int(stat.rsplit(")", 1)[1].split()[1])
seen = {"token": os.environ.get("CACHEKEEPER_TOKEN")}
for what, path in (("key", key),
                   ("key via ..", f"{folder}/../{os.path.basename(folder)}/{name}"),
                   ("key via /proc/self/root", "/proc/self/root" + key),
                   ("agent environ", f"/proc/{agent}/environ"),
                   ("agent memory", f"/proc/{agent}/mem")):
    try:
        with open(path, "rb") as f:
            seen[what] = f.read(4096).decode("latin-1")
    except OSError as exc:
        seen[what] = "DENIED " + exc.strerror
open(out, "w").write(repr(seen))
"""


def test_a_command_cannot_read_the_signing_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reliability
) -> None:
    keys = tmp_path / "keys"
    key_path, _pub, _id = generate_keypair(keys / "builder")
    secret = key_path.read_text()
    monkeypatch.setenv("CACHEKEEPER_TOKEN", "builder-tok")
    (tmp_path / "out").mkdir()  # not beside the key: its folder's folders take no new files
    out = tmp_path / "out" / "seen.txt"
    argv = [PY, "-c", _SNOOP, str(out), str(key_path)]
    # The fault, unconfined: the same command reads the key.
    (tmp_path / "c").mkdir()
    run_command(Command(argv=tuple(argv)), index=0, mode="prewarm", cache_dir=tmp_path / "c",
                work=tmp_path, confinement=Confinement())  # fmt: skip
    assert "PRIVATE KEY" in out.read_text()
    out.unlink()

    tokens = {"builder-tok": "write", "ops-tok": "admin"}
    with start_server(Settings(data_dir=tmp_path / "data", tokens=tokens)) as live:
        httpx.put(
            f"{live.url}/v1/workloads/snoop",
            content=_workload(argv).replace('name = "w"', 'name = "snoop"'),
            headers={"Authorization": "Bearer ops-tok"},
        ).raise_for_status()
        options = AgentOptions(
            devices=("cpu",),
            work_dir=tmp_path / "work",
            name="builder",
            sign_key=key_path,
            allow=Allowlist.load([shlex.join([argv[0], *map(glob.escape, argv[1:])])]),
        )
        with CacheClient(base_url=live.url, token="builder-tok") as client:
            (outcome,) = run_round(options, client=client).outcomes
    assert outcome.prewarm_ran, outcome  # admitted, and it ran
    seen = eval(out.read_text())  # noqa: S307 - our own repr() of a dict of strings
    assert seen["token"] is None
    for name in ("key", "key via ..", "key via /proc/self/root", "agent environ", "agent memory"):
        assert seen[name].startswith("DENIED"), (name, seen[name][:80])
    assert secret not in out.read_text()
    reliability.record(
        "an admitted command reads the agent's signing key (directly, through '..' and"
        " /proc/self/root), the agent's environ and memory, and its token",
        tries=1,
        outcome="refused",
        area="builds",
    )


def test_an_agent_that_cannot_hide_its_key_refuses_to_start(tmp_path: Path, reliability):
    """No Landlock (the kernel refuses landlock_create_ruleset, as an older kernel or a
    container's seccomp profile does); and a key with a second hard link."""
    key_path, _pub, _id = generate_keypair(tmp_path / "keys" / "builder")
    args = [PY, "-m", "cachekeeper", "agent", "--server", "http://127.0.0.1:9", "--once",
            "--sign-key", str(key_path), "--allow", "/bin/true", "--work-dir",
            str(tmp_path / "work")]  # fmt: skip
    env = {**os.environ, "CACHEKEEPER_HOME": str(tmp_path / "home")}
    refuse = seccomp.refusing({"landlock_create_ruleset": errno.ENOSYS})
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120,
                          preexec_fn=refuse)  # fmt: skip  # noqa: PLW1509
    assert proc.returncode == 2, proc.stderr
    assert "cannot keep the key from it: Landlock is not available" in proc.stderr
    assert "[builds_unconfined]" in proc.stderr
    told = subprocess.run([*args, "--unconfined-builds"], env=env, capture_output=True,
                          text=True, timeout=120, preexec_fn=refuse)  # fmt: skip  # noqa: PLW1509
    assert "warning: --sign-key" in told.stderr and "(--unconfined-builds)" in told.stderr
    assert "[builds_unconfined]" not in told.stderr  # it went on (to a server that is not there)

    os.link(key_path, tmp_path / "keys" / "copy.key")
    options = AgentOptions(devices=("cpu",), work_dir=tmp_path / "work", sign_key=key_path,
                           allow=Allowlist.load(["/bin/true"]))  # fmt: skip
    with pytest.raises(BuildsUnconfined, match="it has 2 hard links"):
        prepare_options(options)
    reliability.record(
        "a signing agent on a host without Landlock, or with a key file that has a second"
        " hard link: refused at start (--unconfined-builds to accept it)",
        tries=2,
        outcome="refused",
        area="builds",
    )
