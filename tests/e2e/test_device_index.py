"""The device index is in Inductor's key: a cache built on one GPU index misses on another.

No GPU here, so the GPUs are mocked, in two ways the suite already uses:
``CACHEKEEPER_TEST_FAKE_CUDA=1`` runs a ``cuda:N`` child on the CPU with N put into
Inductor's key (as a real index is; see ``cachekeeper.builder._child``), and
``CACHEKEEPER_FINGERPRINT_OVERRIDES`` gives this machine a fingerprint with two GPUs.
The compiles, the verify runs, the server and every CLI call are real.

One cold compile (cpu-tiny on fake ``cuda:0``) is shared; the verify on ``cuda:1``
compiles once more (that is its point: it misses).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cachekeeper.builder.prewarm import prewarm
from cachekeeper.builder.workload import load_workload
from tests.helpers.live_server import LiveServer
from tests.helpers.requires import require

pytestmark = pytest.mark.compile  # real torch.compile runs in children

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "workloads" / "cpu-tiny.toml"
TWO_GPUS = json.dumps(
    {"gpus": [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(2)]}
)


@pytest.fixture(scope="module")
def two_gpu_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """The environment of a (mocked) node with two GPUs, for children and CLI calls."""
    require("torch")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEKEEPER_")}
    env.update(
        CACHEKEEPER_TEST_FAKE_CUDA="1",
        CACHEKEEPER_FINGERPRINT_OVERRIDES=TWO_GPUS,
        CACHEKEEPER_HOME=str(tmp_path_factory.mktemp("ck-home")),
    )
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        yield env


@pytest.fixture(scope="module")
def index0_cache(two_gpu_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """cpu-tiny prewarmed on (fake) cuda:0 alone, and verified there."""
    cache = tmp_path_factory.mktemp("index0") / "inductor"
    report = prewarm(load_workload(TINY), cache, devices=["cuda:0"], timeout_s=900)
    assert report.status == "verified", report.to_dict()
    return cache


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    exe = str(Path(sys.executable).with_name("cachekeeper"))
    return subprocess.run(
        [exe, *args], env=env, capture_output=True, text=True, timeout=900, check=False
    )


def test_a_cache_of_index_0_verified_on_index_1_is_not_effective_and_names_the_index(
    index0_cache: Path, two_gpu_env: dict[str, str], tmp_path: Path
) -> None:
    cache = tmp_path / "inductor"
    shutil.copytree(index0_cache, cache)  # the verify adds what it compiles: keep the original
    proc = _cli(two_gpu_env, "verify", str(TINY), "--cache-dir", str(cache), "--device", "cuda:1")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cuda:1  verify ok" in proc.stdout and "NOT effective" in proc.stdout
    reason = next(ln for ln in proc.stdout.splitlines() if ln.startswith("  NOT effective: "))
    assert reason.startswith("  NOT effective: cuda:1 missed 1 FX graph")
    assert "built on cuda:0 only, and the device index is in Inductor's key" in reason
    assert "prewarm --device cuda:1 too" in reason


def test_explain_and_prejob_say_the_snapshot_lacks_index_1(
    index0_cache: Path, two_gpu_env: dict[str, str], tiny_server: LiveServer, tmp_path: Path
) -> None:
    archive = tmp_path / "index0.tar.zst"
    made = _cli(two_gpu_env, "snapshot", str(index0_cache), "-o", str(archive),
                "--workload", "cpu-tiny", "--json")  # fmt: skip
    assert made.returncode == 0, made.stderr
    assert json.loads(made.stdout)["devices"] == ["cuda:0"]

    explained = _cli(two_gpu_env, "explain", str(archive))
    assert explained.returncode == 1, explained.stdout + explained.stderr
    assert "devices      snapshot covers cuda:0; this node asks for cuda:0,1: cuda:1 never" in (
        explained.stdout
    )
    assert "build cuda:1 on a builder with >= 2 GPUs" in explained.stdout
    as_json = json.loads(_cli(two_gpu_env, "explain", str(archive), "--json").stdout)
    assert [m["field"] for m in as_json["mismatches"]] == ["devices"]
    assert _cli(two_gpu_env, "explain", str(archive), "--device", "cuda:0").returncode == 0

    pushed = _cli(two_gpu_env, "push", str(index0_cache), "--workload", "cpu-tiny",
                  "--server", tiny_server.url)  # fmt: skip
    assert pushed.returncode == 0, pushed.stderr
    node_dir = tmp_path / "node"
    cold = _cli(two_gpu_env, "prejob", "--workload", "cpu-tiny", "--server", tiny_server.url,
                "--cache-dir", str(node_dir))  # fmt: skip
    assert cold.returncode == 0, cold.stderr  # never fails the job
    assert "will compile cold" in cold.stderr
    assert "snapshot covers cuda:0; this node asks for cuda:0,1: cuda:1 never built" in (
        cold.stderr
    )
    # a job that gives each rank one visible GPU asks for cuda:0 only: restored
    one = _cli(two_gpu_env, "prejob", "--workload", "cpu-tiny", "--server", tiny_server.url,
               "--cache-dir", str(node_dir), "--device", "cuda:0", "--json")  # fmt: skip
    assert one.returncode == 0, one.stderr
    assert json.loads(one.stdout)["outcome"] == "restored"


def test_a_builder_asked_for_more_indices_than_it_has_refuses_before_building(
    two_gpu_env: dict[str, str], tmp_path: Path
) -> None:
    for command in (
        ("agent", "--server", "http://127.0.0.1:9", "--once"),
        ("prewarm", str(TINY), "--cache-dir", str(tmp_path / "c")),
    ):
        proc = _cli(two_gpu_env, *command, "--device", "cuda:0-7")
        assert proc.returncode == 2, proc.stderr
        assert "cuda:2-7 is not visible (visible: cuda:0,1)" in proc.stderr
        assert ">= 8 GPUs" in proc.stderr and "one visible GPU per rank" in proc.stderr
    assert not (tmp_path / "c").exists()
