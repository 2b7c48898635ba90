"""Running a ``[[command]]`` (cachekeeper/builder/commands.py) and its evidence hook
(cachekeeper/builder/_evidence_hook/sitecustomize.py), with real processes and no compiles.

The hook records a process only when it imported ``torch._dynamo``; the processes here
import it for real (a few seconds each) and compile nothing, so their counters are zero.
The compiling cases (torchrun ranks that hit and miss) are in tests/e2e/test_commands.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from cachekeeper import remote_tier
from cachekeeper.builder.commands import EVIDENCE_HOOK, command_environ, read_evidence, run_command
from cachekeeper.builder.kinds.command_spec import Command
from cachekeeper.builder.report_text import format_prewarm, format_verify
from cachekeeper.builder.verdicts import CommandRun, PrewarmReport, ProcessEvidence, VerifyReport
from cachekeeper.errors import PrewarmFailed

PY = sys.executable


def _run(tmp_path: Path, *argv: str, **options: object):
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    cache = tmp_path / "cache"
    cache.mkdir(exist_ok=True)
    command = Command(argv=tuple(argv), **options)  # type: ignore[arg-type]
    return run_command(command, index=0, mode="prewarm", cache_dir=cache, work=work)


def test_the_environment_is_the_builders_plus_what_the_workload_says(tmp_path: Path) -> None:
    base = {"PATH": "/bin", "PYTHONPATH": "/site", "TRITON_CACHE_DIR": "/t", "KEEP": "1"}
    base["CACHEKEEPER_TOKEN"] = "agent-secret"  # the agent's: never a build's
    command = Command(argv=("x",), env={"WANDB_MODE": "disabled"})
    env = command_environ(command, cache_dir=tmp_path / "c", evidence=tmp_path / "e", base=base)
    assert env == {
        "PATH": "/bin",
        "KEEP": "1",
        "WANDB_MODE": "disabled",
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "c"),
        "CACHEKEEPER_EVIDENCE_DIR": str(tmp_path / "e"),
        "PYTHONPATH": f"{EVIDENCE_HOOK}{os.pathsep}/site",  # the hook first, the site's kept
        "TORCHINDUCTOR_REDIS_URL": remote_tier.OFF_URL,  # no way to the tier (issue 32)
    }
    # A workload that names a tier with no switch on (its code could turn one on) is cut
    # off too: no tier value reaches what a builder signs.
    sneaky = Command(argv=("x",), env={"TORCHINDUCTOR_REDIS_HOST": "cache", "X": "1"})
    env = command_environ(sneaky, cache_dir=tmp_path / "c", evidence=tmp_path / "e", base=base)
    assert "TORCHINDUCTOR_REDIS_HOST" not in env and env["X"] == "1"
    assert env["TORCHINDUCTOR_REDIS_URL"] == remote_tier.OFF_URL
    # the per-key tier's switches stay (they are in torch's keys), the tier is never reached
    tiered = Command(argv=("x",), env={"TORCHINDUCTOR_REDIS_URL": "redis://cache:6379"})
    env = command_environ(
        tiered,
        cache_dir=tmp_path / "c",
        evidence=tmp_path / "e",
        base={**base, "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1"},
    )
    assert env["TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE"] == "1"
    assert env["TORCHINDUCTOR_REDIS_URL"] == remote_tier.OFF_URL


@pytest.mark.slow  # a tree of Python processes
def test_every_python_process_reports_its_rank_and_how_it_ended(tmp_path: Path) -> None:
    """A parent that starts three children (as torchrun starts ranks): one exits 0, one
    calls sys.exit(3), one raises; each imports torch._dynamo and writes its record. The
    parent imports no torch and leaves none."""
    child = (
        "import os, sys, torch._dynamo.utils\n"
        "how = os.environ['HOW']\n"
        "if how == 'exit': sys.exit(3)\n"
        "if how == 'raise': raise RuntimeError('cold compile broke\\nsecond line')\n"
    )
    parent = (
        "import os, subprocess, sys\n"
        f"child = {child!r}\n"
        "for rank, how in enumerate(['ok', 'exit', 'raise']):\n"
        "    env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE='3', HOW=how)\n"
        "    subprocess.run([sys.executable, '-c', child], env=env)\n"
    )
    run = _run(tmp_path, PY, "-c", parent)
    assert run.status == "ok" and run.exit_code == 0, run
    endings = [(p.rank, p.world_size, p.exit_status, p.exit_code, p.error) for p in run.processes]
    assert endings == [
        (0, 3, "ok", 0, ""),
        (1, 3, "exit", 3, "3"),
        (2, 3, "exception", 1, "RuntimeError: cold compile broke"),
    ]
    assert all(p.device == "cpu" and p.threads and not p.compiled for p in run.processes)
    assert run.compiling == () and not run.effective  # nothing compiled: never effective


def test_the_sites_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    marker = tmp_path / "site-ran"
    (site / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('yes')\n")
    show = "import sitecustomize; print(sitecustomize.__file__)"
    run = _run(tmp_path, PY, "-c", show, env={"PYTHONPATH": str(site)})
    assert run.status == "ok", run
    assert marker.read_text() == "yes"
    assert run.log_tail == (str(site / "sitecustomize.py"),)  # the site's module, as without us


def test_a_failing_command_keeps_its_output_tail(tmp_path: Path) -> None:
    run = _run(tmp_path, PY, "-c", "import sys\nfor i in range(100): print('line', i)\nsys.exit(7)")
    assert run.status == "command_failed" and run.exit_code == 7  # it compiled nothing
    assert run.log_tail[-1] == "line 99" and len(run.log_tail) == 40
    assert run.error is not None
    assert run.error.message == "exited with status 7 before compiling anything"


# What a torchrun job prints when a rank's argparse refuses its arguments: the rank's usage
# and error line, then torchrun's ChildFailedError traceback, longer than the kept tail.
LAUNCHER = """
import subprocess, sys
train = "import argparse; p = argparse.ArgumentParser(prog='train.py'); p.add_argument('--steps'); p.parse_args()"
code = subprocess.run([sys.executable, "-c", train, *sys.argv[1:]]).returncode
print("Traceback (most recent call last):", file=sys.stderr)
for i in range(45):
    print(f'  File "/opt/venv/torch/distributed/run.py", line {i}, in main', file=sys.stderr)
print("torch.distributed.elastic.multiprocessing.errors.ChildFailedError:", file=sys.stderr)
sys.exit(1)
"""


def test_a_usage_error_before_any_compile_is_command_failed_with_its_error_line(
    tmp_path: Path,
) -> None:
    """Issue 31: ``--stepz`` was reported cold_compile_broken and the line saying what is
    wrong was cut from the 40-line tail."""
    run = _run(tmp_path, PY, "-c", LAUNCHER, "--stepz", "2")
    assert run.status == "command_failed" and run.exit_code == 1
    error_line = "train.py: error: unrecognized arguments: --stepz 2"
    assert run.log_tail[0] == error_line and run.log_tail[1] == "..."
    assert run.log_tail[-1].startswith("torch.distributed.elastic") and len(run.log_tail) == 41
    assert run.error is not None
    assert run.error.message == f"exited with status 1 before compiling anything: {error_line}"
    assert run.error.traceback_tail[0] == error_line
    report = PrewarmReport(
        workload="w", workload_digest="d", cache_dir="c", devices=(), seconds=1.0, commands=(run,)
    )
    assert report.status == "command_failed" and report.exit_code == 2
    text = format_prewarm(report)
    assert error_line in text and "failed before compiling anything" in text
    with pytest.raises(PrewarmFailed, match="unrecognized arguments"):
        report.raise_for_status()


def test_a_failure_after_the_compile_started_is_still_cold_compile_broken(
    tmp_path: Path,
) -> None:
    """The same exit with something in the cache dir (a compile wrote it) is the canary."""
    (tmp_path / "cache" / "fxgraph").mkdir(parents=True)
    (tmp_path / "cache" / "fxgraph" / "entry").write_bytes(b"compiled before the crash")
    run = _run(tmp_path, PY, "-c", "import sys; sys.exit(1)")
    assert run.status == "error"
    report = PrewarmReport(
        workload="w", workload_digest="d", cache_dir="c", devices=(), seconds=1.0, commands=(run,)
    )
    assert report.status == "cold_compile_broken" and report.exit_code == 3


def test_a_command_that_cannot_start_names_the_field(tmp_path: Path) -> None:
    missing = _run(tmp_path, "no-such-launcher-xyz", "--steps", "2")
    assert missing.status == "invalid" and missing.error is not None
    assert missing.error.message == (
        "command[0].argv[0]: 'no-such-launcher-xyz' is not found on PATH on this builder"
    )
    no_dir = _run(tmp_path, PY, "-c", "pass", cwd=str(tmp_path / "nowhere"))
    assert no_dir.status == "invalid" and no_dir.error is not None
    assert (
        no_dir.error.message
        == f"command[0].cwd: {tmp_path / 'nowhere'} is not a directory on this builder"
    )


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


@pytest.mark.slow  # waits out a timeout
def test_a_timeout_stops_the_whole_tree_even_ranks_in_their_own_session(tmp_path: Path) -> None:
    """torchrun starts each rank with start_new_session: a process-group kill misses it."""
    pids = tmp_path / "pids"
    script = (
        "import subprocess, sys, time\n"
        "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
        " start_new_session=True)\n"
        f"open({str(pids)!r}, 'w').write(str(rank.pid))\n"
        "time.sleep(600)\n"
    )
    run = _run(tmp_path, PY, "-c", script, timeout_s=3.0)
    assert run.status == "timeout" and run.error is not None
    assert "no exit after 3 s" in run.error.message
    rank = int(pids.read_text())
    deadline = time.monotonic() + 10
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_a_verify_report_names_each_rank(tmp_path: Path) -> None:
    """The human report of a command's verify: one line per compiling rank."""
    hit = {"fxgraph_cache_hit": 2, "autograd_cache_hit": 2}
    miss = {"fxgraph_cache_hit": 1, "fxgraph_cache_miss": 1, "autograd_cache_miss": 1}
    run = CommandRun(
        index=0,
        mode="verify",
        command="torchrun --nproc-per-node 2 train.py",
        status="ok",
        seconds=3.0,
        exit_code=0,
        processes=(
            ProcessEvidence(pid=11, rank=0, device="cuda:0", counters=hit),
            ProcessEvidence(pid=12, rank=1, device="cuda:1", counters=miss),
            ProcessEvidence(pid=10, rank=None, device="cpu", counters={}),
        ),
    )
    report = VerifyReport(
        workload="w", workload_digest="d", cache_dir="/c", devices=(), seconds=3.0, commands=(run,)
    )
    assert report.status == "not_effective" and report.covered_devices == ("cuda:0", "cuda:1")
    (reason,) = report.reasons
    assert reason.startswith("command[0] rank 1 (pid 12, cuda:1) missed 1 FX graph and 1")
    text = format_verify(report)
    assert "rank 0 (pid 11, cuda:0)" in text and "  hit" in text and "  MISS" in text
    assert "(1 other Python process(es) compiled nothing)" in text


def test_records_that_cannot_be_read_are_skipped_and_pairs_are_judged(tmp_path: Path) -> None:
    """An end record counts only with its start record; a start without an end is a gap."""
    for pid in (2, 4):
        (tmp_path / f"start-{pid}.json").write_text(f'{{"pid": {pid}, "argv": ["train.py"]}}')
    (tmp_path / "proc-1.json").write_text("{not json")
    (tmp_path / "proc-2.json").write_text('{"pid": 2, "rank": 0, "counters": {}}')
    (tmp_path / "proc-3.json").write_text('{"rank": 1}')  # no pid
    (tmp_path / "proc-5.json").write_text('{"pid": 5, "rank": 1, "counters": {}}')  # no start
    found = read_evidence(tmp_path)
    assert [p.pid for p in found.processes] == [2]
    assert found.gaps == (
        "an end record for pid 5 has no start record: cachekeeper's evidence hook did not write it",
        "pid 4 (train.py) imported torch._dynamo and left no end record: it was killed or"
        " ended below Python, so what it compiled is unknown",
    )


@pytest.mark.slow  # a tree of Python processes
@pytest.mark.parametrize("flag", ["-I", "-E"])
def test_a_python_that_ignores_pythonpath_reports_nothing(tmp_path: Path, flag: str) -> None:
    """The documented limit: such a process is not seen, and a verify then says so."""
    run = _run(tmp_path, PY, flag, "-c", "import torch._dynamo.utils")
    assert run.status == "ok" and run.processes == ()
