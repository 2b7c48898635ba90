"""Issue 31's two-node scenario, run the way a site runs it, for a test and for a screenshot.

A real server with admin / write / read tokens; two workloads registered with the admin
token: ``block`` (the site's own two-rank ``torchrun`` job, a ``[[command]]``) and
``foreign`` (a command whose program the builder does not allow). One real agent round on
this machine (``cachekeeper agent --once --device cpu``, ``--allow`` for torchrun only): it
compiles ``block`` under its ranks' thread count (1), so that row is in the ranks'
environment, and refuses ``foreign`` in its own (this machine's CPUs). A second round,
started from a shell that sets its thread count another way (``OMP_NUM_THREADS`` to the
same value), compiles nothing and is the same agent. Then two training nodes (``node-1``,
``node-2``: their own ``CACHEKEEPER_HOME``, the hook's default cache dir), each as
docs/hooks.md says: ``OMP_NUM_THREADS=1`` exported before ``prejob`` (the ranks' count),
the job (the same ``torchrun``, its ranks' own cache counters kept), then ``postjob``.

Used by tests/e2e/test_operator_truth.py (which asserts what an operator is told) and by
scripts/ui_screenshot.py (docs/status-page.png). A few minutes of compiles on two cores.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = ["ADMIN", "NODE", "BUILDER", "TOKENS", "Scenario", "run_scenario"]

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
CK = str(BIN / "cachekeeper")
TORCHRUN = str(BIN / "torchrun")
PROGRAM = REPO / "tests" / "programs" / "train_block.py"

ADMIN, BUILDER, NODE = "ops-secret", "builder-secret", "node-secret"
TOKENS = {ADMIN: "admin", BUILDER: "write", NODE: "read"}


def _command_toml(name: str, argv: list[str]) -> str:
    return f'name = "{name}"\n[[command]]\nargv = {json.dumps(argv)}\ntimeout = "10m"\n'


WORKLOADS = {
    "block": _command_toml(
        "block", [TORCHRUN, "--nproc-per-node", "2", "--standalone", str(PROGRAM)]
    ),
    "foreign": _command_toml("foreign", ["/opt/vendor/bin/launch", "--steps", "2"]),
}


@dataclass
class Node:
    """One training node's hooks and job: what each printed, and the ranks' counters."""

    name: str
    cache_dir: str
    prejob: str  # stderr: the one line the hook prints
    postjob: str  # stdout: postjob's line
    ranks: dict[int, dict[str, int]]


@dataclass
class Scenario:
    url: str
    agent_rounds: list[dict[str, Any]] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)

    def outcome(self, workload: str) -> dict[str, Any]:
        """The first agent round's outcome for ``workload``."""
        return next(o for o in self.agent_rounds[0]["outcomes"] if o["workload"] == workload)


def _env(home: Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("CACHEKEEPER_", "TORCHINDUCTOR_"))
        and k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CACHEKEEPER_TEST_FAKE_CUDA")
    }
    env.update(CACHEKEEPER_HOME=str(home), **extra)
    return env


def _run(argv: list[str], env: dict[str, str], *, timeout: float = 900) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(argv)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout + proc.stderr if argv[1:2] == ["prejob"] else proc.stdout


def _agent(url: str, root: Path, **shell: str) -> dict[str, Any]:
    env = _env(root / "builder-home", CACHEKEEPER_SERVER=url, CACHEKEEPER_TOKEN=BUILDER, **shell)
    argv = [CK, "agent", "--once", "--device", "cpu", "--json", "--name", "builder",
            "--work-dir", str(root / "builder-work"), "--allow", f"{TORCHRUN} ..."]  # fmt: skip
    out = _run(argv, env, timeout=1500)
    return json.loads(out.strip().splitlines()[-1])


def _node(url: str, root: Path, name: str) -> Node:
    home = root / name
    # docs/hooks.md: the hook runs with the ranks' thread count (torchrun gives each 1)
    env = _env(home, CACHEKEEPER_SERVER=url, CACHEKEEPER_TOKEN=NODE, NODE_NAME=name)
    hook = subprocess.run(
        [CK, "prejob", "--workload", "block", "--device", "cpu"],
        capture_output=True,
        text=True,
        env={**env, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    if hook.returncode != 0:
        raise RuntimeError(f"prejob on {name} exited {hook.returncode}: {hook.stderr}")
    exports = dict(
        line.removeprefix("export ").split("=", 1) for line in hook.stdout.splitlines() if line
    )
    cache_dir = shlex.split(exports["TORCHINDUCTOR_CACHE_DIR"])[0]
    report = home / "report"
    job = {**env, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "TORCHELASTIC_RUN_ID": f"{name}-job"}
    _run([TORCHRUN, "--nproc-per-node", "2", "--standalone", str(PROGRAM),
          "--report", str(report)], job)  # fmt: skip
    ranks = {r: json.loads((report / f"rank-{r}.json").read_text()) for r in (0, 1)}
    after = _run([CK, "postjob", "--workload", "block", "--cache-dir", cache_dir], job)
    return Node(name=name, cache_dir=cache_dir, prejob=hook.stderr, postjob=after, ranks=ranks)


def run_scenario(url: str, root: Path) -> Scenario:
    """Run the scenario (see the module docstring) against the server at ``url``."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
        for name, text in WORKLOADS.items():
            c.put(f"/v1/workloads/{name}", content=text).raise_for_status()
    done = Scenario(url=url)
    done.agent_rounds.append(_agent(url, root))
    cpus = str(len(os.sched_getaffinity(0)))  # the same count, set another way
    done.agent_rounds.append(_agent(url, root, OMP_NUM_THREADS=cpus))
    for name in ("node-1", "node-2"):
        done.nodes.append(_node(url, root, name))
    return done
