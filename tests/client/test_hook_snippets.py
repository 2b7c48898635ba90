"""The shell snippets of docs/hooks.md, taken from the doc itself and run with bash.

A snippet users copy must do what the doc says; a test of a copy of it would not notice
the doc drifting, so the test reads the code block out of the Markdown. Only what cannot
exist here is replaced: install paths (/opt/cachekeeper/bin, /etc/cachekeeper), the pod's
volume (a temp dir) and the trainer (a flex_attention probe per rank, on the CPU).

The slow tests (issue 25) run the torchrun wrapper and the Kubernetes pod's two commands
with ``--nproc-per-node 2`` against a real server holding a snapshot compiled as torchrun's
ranks run (``OMP_NUM_THREADS=1``), and check each rank's misses, not only the restore: the
recipes restored and then both ranks missed, since the hook fingerprinted the shell's
thread count.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml  # pyyaml comes with the dev extra (schemathesis)

from cachekeeper.client.api import CacheClient
from cachekeeper.client.push import push
from cachekeeper.fingerprint import collect
from cachekeeper.server.settings import Settings
from cachekeeper.store import LocalStore
from tests.helpers.caches import make_cache
from tests.helpers.live_server import TOKENS, LiveServer, start_server
from tests.helpers.requires import require

REPO = Path(__file__).resolve().parents[2]
HOOKS_MD = REPO / "docs" / "hooks.md"
BIN = Path(sys.executable).parent
TOML = 'name = "drafter-gqa"\n[[entrypoint]]\ntarget = "train:step"\n'


def doc_block(heading: str, contains: str, *, lang: str = "bash") -> str:
    """The first ``lang`` block after ``heading`` in docs/hooks.md that holds ``contains``."""
    section = HOOKS_MD.read_text().split(heading, 1)[1]
    for block in re.findall(rf"```{lang}\n(.*?)```", section, re.S):
        if contains in block:
            return block
    raise AssertionError(f"docs/hooks.md lost the {contains!r} block under {heading!r}")


def ck_torchrun_snippet() -> str:
    """The bash block under "## torchrun wrapper" in docs/hooks.md."""
    return doc_block("## torchrun wrapper", "# ck-torchrun")


def _run(script: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def fake_torchrun(tmp_path: Path, env: dict[str, str], *, status: int = 0) -> Path:
    """Put first on ``env``'s PATH a torchrun that touches the returned marker and exits
    ``status``."""
    marker = tmp_path / "torchrun-ran"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "torchrun").write_text(f"#!/bin/sh\ntouch {marker}\nexit {status}\n")
    (fake_bin / "torchrun").chmod(0o755)
    env["PATH"] = f"{fake_bin}{os.pathsep}{env['PATH']}"
    return marker


@pytest.fixture
def wrapper(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    script = tmp_path / "ck-torchrun"
    script.write_text(ck_torchrun_snippet())
    env = {
        k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
    }
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["CACHEKEEPER_HOME"] = str(tmp_path / "ck-home")
    return script, env


def test_ck_torchrun_stops_with_a_message_when_the_workload_is_unset(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    script, env = wrapper
    # A torchrun that records that it ran: the claim is that it is never reached.
    marker = fake_torchrun(tmp_path, env)
    proc = _run(script, env, "train.py")
    assert proc.returncode != 0
    assert "CACHEKEEPER_WORKLOAD" in proc.stderr
    assert "set CACHEKEEPER_WORKLOAD" in proc.stderr
    assert not marker.exists(), "torchrun started although the workload was unset"


@pytest.mark.slow  # torchrun starts its workers
def test_ck_torchrun_runs_torchrun_with_the_hook_exports(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """With no server the hook starts cold but still exports; the real torchrun sees it."""
    if shutil.which("torchrun", path=wrapper[1]["PATH"]) is None:
        pytest.skip("torchrun is not installed")
    script, env = wrapper
    env["CACHEKEEPER_WORKLOAD"] = "drafter-gqa"
    cache = tmp_path / "cache dir"  # a space: the export must be quoted
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nprint('TICD=' + os.environ['TORCHINDUCTOR_CACHE_DIR'])\n")
    proc = _run(script, env, "--nproc-per-node", "1", "--standalone", str(probe))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"TICD={cache}" in proc.stdout
    assert "this job will compile cold" in proc.stderr
    assert "cachekeeper: postjob:" in proc.stderr  # the epilog ran, after the job


def test_ck_torchrun_keeps_the_jobs_exit_status(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """The post-job line runs after a failed job and the job's status is the wrapper's."""
    script, env = wrapper
    fake_torchrun(tmp_path, env, status=3)
    env["CACHEKEEPER_WORKLOAD"] = "drafter-gqa"
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / "cache")
    proc = _run(script, env, "train.py")
    assert proc.returncode == 3, proc.stderr
    assert "cachekeeper: postjob:" in proc.stderr


def test_ck_torchrun_starts_the_job_when_the_hook_cannot_run(
    wrapper: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    """A bad CACHEKEEPER_TIMEOUT made `cachekeeper prejob` a usage error, and `set -e`
    ended the wrapper before torchrun: a hook recipe never stops the job."""
    script, env = wrapper
    marker = fake_torchrun(tmp_path, env)
    env.update(CACHEKEEPER_WORKLOAD="w", CACHEKEEPER_TIMEOUT="sixty")
    proc = _run(script, env, "train.py")
    assert proc.returncode == 0 and marker.exists(), proc.stderr
    assert "cachekeeper prejob failed; starting without a restored cache" in proc.stderr


# -- SLURM's task prolog and epilog, with a real server ---------------------------------


def _slurm_script(tmp_path: Path, name: str, contains: str, token_file: Path) -> Path:
    text = doc_block("## SLURM", contains)
    text = text.replace("/opt/cachekeeper/bin/", f"{BIN}/")
    text = text.replace("/etc/cachekeeper/read-token", str(token_file))
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_task_prolog_reads_the_token_file_and_the_epilog_finds_the_dir(
    authed_server: LiveServer, tmp_path: Path
) -> None:
    """The prolog gets the read token from the site's file; the epilog has no
    TORCHINDUCTOR_CACHE_DIR (the prolog's exports reach the task only) and finds the dir
    as postjob does, where it failed with a usage error."""
    src = tmp_path / "src"
    make_cache(src)
    with CacheClient(base_url=authed_server.url, token="write-token") as client:
        pushed = push(src, client=client, workload="drafter-gqa",
                      store=LocalStore(home=tmp_path / "b"), fingerprint=collect())  # fmt: skip
    token_file = tmp_path / "read-token"
    token_file.write_text("read-token\n")
    prolog = _slurm_script(tmp_path, "prolog.sh", "cachekeeper-task-prolog", token_file)
    epilog = _slurm_script(tmp_path, "epilog.sh", "cachekeeper-task-epilog", token_file)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CACHEKEEPER_", "TORCHIND"))}
    env.update(CACHEKEEPER_HOME=str(tmp_path / "home"), CACHEKEEPER_WORKLOAD="drafter-gqa",
               CACHEKEEPER_SERVER=authed_server.url, SLURM_JOB_ID="77", SLURM_LOCALID="0")  # fmt: skip
    before = _run(prolog, env)
    assert before.returncode == 0, before.stderr
    assert f"restored snapshot {pushed.snapshot_id}" in before.stderr, before.stderr
    (line,) = before.stdout.splitlines()
    assert line.startswith("export TORCHINDUCTOR_CACHE_DIR=")
    after = _run(epilog, env)  # no TORCHINDUCTOR_CACHE_DIR here, as under SLURM
    assert after.returncode == 0 and "Usage" not in after.stderr, after.stderr
    assert f"compiled nothing new on top of snapshot {pushed.snapshot_id[:12]}" in after.stdout
    assert "did not take the report" not in after.stderr, after.stderr


# -- the recipes as a job runs them: two ranks, real compiles (issue 25) -----------------

RANK = """\
import json, os, sys
import torch
from torch._dynamo.utils import counters
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx

q, k, v = (torch.randn(1, 2, 128, 16) for _ in range(3))
mask = create_block_mask(causal, B=None, H=None, Q_LEN=128, KV_LEN=128, device="cpu")
with torch.no_grad():
    torch.compile(flex_attention)(q, k, v, block_mask=mask)
out = os.path.join(sys.argv[1], "rank-" + os.environ["RANK"] + ".json")
with open(out, "w") as fh:
    json.dump({"threads": torch.get_num_threads(), **counters["inductor"]}, fh)
"""


@pytest.fixture(scope="module")
def ranks_snapshot(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server with drafter-gqa registered and a snapshot of the rank script's compile as
    torchrun's ranks run it (OMP_NUM_THREADS=1): one cold compile for the module."""
    require("torch")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: with one, every process has 1 thread anyway")
    root = tmp_path_factory.mktemp("ranks")
    cache, out = root / "built", root / "out"
    out.mkdir()
    (root / "rank.py").write_text(RANK)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "RANK": "0"}  # fmt: skip
    subprocess.run([sys.executable, str(root / "rank.py"), str(out)], env=env, check=True,
                   timeout=600)  # fmt: skip
    tokens = {**TOKENS, "admin-token": "admin"}  # the workload names code: admin registers it
    live = start_server(Settings(data_dir=root / "server", tokens=tokens))
    try:
        with CacheClient(base_url=live.url, token="admin-token") as client:
            client.register_workload("drafter-gqa", TOML)
            push(cache, client=client, workload="drafter-gqa", store=LocalStore(home=root / "s"),
                 fingerprint=collect(environ={"OMP_NUM_THREADS": "1"}))  # fmt: skip
        yield live
    finally:
        live.stop()


def _job_env(tmp_path: Path, live: LiveServer) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_", "OMP_", "MKL_"))}  # fmt: skip
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", CACHEKEEPER_SERVER=live.url,
               CACHEKEEPER_TOKEN="read-token", CACHEKEEPER_HOME=str(tmp_path / "home"))  # fmt: skip
    return env


def _ranks(out: Path) -> list[dict]:
    found = sorted(out.glob("rank-*.json"))
    assert [p.name for p in found] == ["rank-0.json", "rank-1.json"], found
    return [json.loads(p.read_text()) for p in found]


@pytest.mark.compile
def test_the_torchrun_wrapper_as_written_hits_on_both_ranks(
    ranks_snapshot: LiveServer, tmp_path: Path
) -> None:
    script = tmp_path / "ck-torchrun"
    script.write_text(ck_torchrun_snippet())
    (tmp_path / "rank.py").write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()
    env = _job_env(tmp_path, ranks_snapshot) | {"CACHEKEEPER_WORKLOAD": "drafter-gqa"}
    proc = _run(script, env, "--nproc-per-node", "2", "--standalone",
                str(tmp_path / "rank.py"), str(out))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cachekeeper: restored snapshot" in proc.stderr, proc.stderr[-3000:]
    for rank in _ranks(out):
        assert rank["threads"] == 1, rank
        assert rank.get("fxgraph_cache_miss", 0) == 0 and rank.get("fxgraph_cache_hit", 0) >= 1, (
            rank
        )
    assert "compiled nothing new on top of snapshot" in proc.stderr, proc.stderr[-3000:]


@pytest.mark.compile
def test_the_kubernetes_pod_as_written_hits_on_both_ranks(
    ranks_snapshot: LiveServer, tmp_path: Path
) -> None:
    pod = yaml.safe_load(doc_block("## Kubernetes", "kind: Pod", lang="yaml"))
    (init,) = pod["spec"]["initContainers"]
    (trainer,) = pod["spec"]["containers"]
    volume = tmp_path / "volume"  # the pod's /cache mount
    volume.mkdir()
    (tmp_path / "rank.py").write_text(RANK)
    out = tmp_path / "out"
    out.mkdir()

    def container_env(container: dict) -> dict[str, str]:
        env = _job_env(tmp_path, ranks_snapshot)
        for item in container["env"]:
            if "value" in item:
                env[item["name"]] = str(item["value"])
        env.update(CACHEKEEPER_SERVER=ranks_snapshot.url, CACHEKEEPER_TOKEN="read-token")
        return env

    def on_volume(text: str) -> str:
        return text.replace("/cache/", f"{volume}/")

    first = subprocess.run([on_volume(a) for a in init["command"]], env=container_env(init),
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert first.returncode == 0 and "restored snapshot" in first.stderr, first.stderr
    shell, flag, body = trainer["command"]
    body = on_volume(body).replace("--nproc-per-node 8 train.py",
                                   f"--nproc-per-node 2 --standalone {tmp_path}/rank.py {out}")  # fmt: skip
    job = subprocess.run([shell, flag, body], env=container_env(trainer), capture_output=True,
                         text=True, timeout=600)  # fmt: skip
    assert job.returncode == 0, job.stderr[-3000:]
    for rank in _ranks(out):
        assert rank["threads"] == 1, rank
        assert rank.get("fxgraph_cache_miss", 0) == 0 and rank.get("fxgraph_cache_hit", 0) >= 1, (
            rank
        )
    assert "compiled nothing new on top of snapshot" in job.stderr, job.stderr[-3000:]
