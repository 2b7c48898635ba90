"""Issue 17.4: the hook names a CPU thread-count mismatch (no compile: the snapshot's files
are stand-ins; what is checked is the server's match and the hook's cold line).

A CPU snapshot built with 2 threads, a job with torchrun's ``OMP_NUM_THREADS=1``: the
real hook process starts cold saying why, and with ``OMP_NUM_THREADS=2`` it restores.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from cachekeeper.environment import cpu
from cachekeeper.environment.fingerprint import collect
from tests.helpers.live_server import LiveServer
from tests.server.conftest import make_snapshot, push

CK = str(Path(sys.executable).parent / "cachekeeper")
REPO = Path(__file__).resolve().parents[2]
WORKLOAD = REPO / "examples" / "workloads" / "cpu-tiny.toml"


def _prejob(
    open_server: LiveServer, tmp_path: Path, threads: str | None, workload: str = "cpu-tiny"
) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
        and k not in ("MKL_NUM_THREADS", "OMP_NUM_THREADS")
    }
    env.update(
        CACHEKEEPER_SERVER=open_server.url, CACHEKEEPER_HOME=str(tmp_path / f"home{threads}")
    )
    if threads is not None:  # None: a plain shell, as a site's prolog runs the hook
        env["OMP_NUM_THREADS"] = threads
    command = [CK, "prejob", "--workload", workload, "--device", "cpu",
               "--cache-dir", str(tmp_path / f"cache{threads}")]  # fmt: skip
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 threads")
def test_prejob_names_the_thread_count_a_cpu_snapshot_was_built_with(
    open_server: LiveServer, tmp_path: Path
) -> None:
    node = collect(environ={})  # this machine, as the hook process collects it
    built = dict(node, cpu=cpu.with_threads(node["cpu"], 2))
    manifest, blobs = make_snapshot(
        {"fxgraph/ab/entry": b"graph"},
        workload="cpu-tiny",
        fingerprint=built,
        devices=("cpu",),
        verified=True,
    )
    with httpx.Client(base_url=open_server.url) as c:
        assert c.put("/v1/workloads/cpu-tiny", content=WORKLOAD.read_bytes()).is_success
        assert push(c, manifest, blobs).status_code == 201

    cold = _prejob(open_server, tmp_path, "1")
    assert cold.returncode == 0, cold.stderr
    assert "this job will compile cold" in cold.stderr, cold.stderr
    assert (
        "cpu: built with 2 threads (OMP_NUM_THREADS=2); this job has 1 (OMP_NUM_THREADS=1)"
        in cold.stderr
    ), cold.stderr
    assert not (tmp_path / "cache1" / "fxgraph").exists()

    warm = _prejob(open_server, tmp_path, "2")
    assert warm.returncode == 0, warm.stderr
    assert (tmp_path / "cache2" / "fxgraph" / "ab" / "entry").read_bytes() == b"graph"


COMMAND = 'name = "ranks"\n[[command]]\nargv = ["torchrun", "--nproc-per-node", "2", "train.py"]\n'
ATTENTION = WORKLOAD.read_text().replace('name = "cpu-tiny"', 'name = "ranks"')


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs for 2 threads")
@pytest.mark.parametrize(
    ("kind", "toml", "stats"),
    [
        ("command", COMMAND, {"prewarm": {"commands": [{"name": "command[0]"}]}}),
        ("workload", ATTENTION, {"prewarm": {"devices": {"cpu": {}}}}),
    ],
)
def test_the_thread_advice_is_the_one_that_works_for_the_workloads_kind(
    open_server: LiveServer, tmp_path: Path, kind: str, toml: str, stats: dict
) -> None:
    # Issue 31: a [[command]] workload (torchrun, 1 thread per rank) built on the builder;
    # the hook, run in a plain shell (2 threads), was told to set "[process]
    # omp_num_threads" and prewarm again, which does nothing for a command.
    node = collect(environ={})
    built = dict(node, cpu=cpu.with_threads(node["cpu"], 1))
    manifest, blobs = make_snapshot(
        {"fxgraph/ab/entry": b"graph"},
        workload="ranks",
        fingerprint=built,
        devices=("cpu",),
        verified=True,
    )
    manifest = dataclasses.replace(manifest, stats={**stats, "verify": {"effective": True}})
    assert manifest.built_by == kind
    with httpx.Client(base_url=open_server.url) as c:
        assert c.put("/v1/workloads/ranks", content=toml).is_success
        assert push(c, manifest, blobs).status_code == 201

    cold = _prejob(open_server, tmp_path, None, workload="ranks")
    assert cold.returncode == 0 and "this job will compile cold" in cold.stderr, cold.stderr
    line = cold.stderr
    assert "cpu: built with 1 threads (OMP_NUM_THREADS=1); this job has 2" in line, line
    assert "export OMP_NUM_THREADS=1 before prejob" in line, line
    if kind == "command":
        assert "[process] omp_num_threads does not reach a command" in line, line
        assert "set [process] omp_num_threads" not in line, line
        assert 'OMP_NUM_THREADS = "2" in the [[command]]\'s env' in line, line
    else:
        assert "set [process] omp_num_threads = 2 in the workload and prewarm again" in line

    # the advice, followed, works: the hook with the ranks' OMP_NUM_THREADS restores
    warm = _prejob(open_server, tmp_path, "1", workload="ranks")
    assert "restored snapshot" in warm.stderr, warm.stderr
