"""The builder agent: keep every registered workload warm for this node's environment.

One round (``run_round``):

1. Collect the fingerprint again (a torch, Triton, CUDA wheel or driver upgrade changes its
   digest) and register with the server; the agent is one per name (its id is its name's),
   so registering is idempotent and a changed environment updates the same agent.
2. List the registered workloads. For each, in name order: ask the server to resolve it
   for the fingerprint its build compiles under (the agent's, with the CPU state of the
   workload's ``[process] omp_num_threads``: what the snapshot carries and the workload's
   events name) and these devices. A *verified* snapshot built from the same
   workload text counts as warm: report ``skipped`` and compile nothing. A signing agent
   (``--sign-key``) asks with its own public key as the node's trust (resolve's
   ``trusted_keys``) and checks the answer's signature itself: a snapshot its own key did
   not sign, or whose "verified" its key did not sign, is not warm. Otherwise build:
   report ``building``, prewarm on every selected device (one fresh process per device,
   cold, then a verify run; each ``[[command]]`` once cold, then again in a fresh copy),
   push only when verified, and report ``built``, ``cold_compile_broken`` (with the
   traceback tail) or ``failed``. One workload's crash or timeout never stops the others.
3. Code runs only when this builder's operator allowed it (``cachekeeper.builder.allowlist``,
   ``agent --allow`` / ``--allow-file``): a workload whose command (program, arguments,
   env, cwd) or import path no entry admits is reported ``refused`` with why and what to
   allow, and nothing of it runs. Every process of a build runs under a supervisor that
   reaps its whole tree (``cachekeeper.builder.confine``); an import path must name a def or class
   of its module; with ``--sign-key`` the key is read once, before any build, and hidden
   from every build's processes (``cachekeeper.builder.landlock``): a host that cannot hide it is
   refused at start (``BuildsUnconfined``) unless the operator passed ``--unconfined-builds``.
4. Promotion, under the rule that **a builder signs only bytes it compiled itself in
   that round; a harvest is at most a hint of what to compile** (``cachekeeper.builder.harvest``):
   a warm workload with a ``[[command]]`` whose snapshot has harvested deltas
   (``postjob --push`` from training nodes, same fingerprint digest) is built again, cold,
   in a fresh empty dir, like any build; no delta is ever restored or loaded here, only
   their manifests are read. When its own run compiled harvested entries the snapshot
   lacks, its own build is pushed (signed, verified) and reported ``built`` saying how
   many; the rest are kept back with why, and nothing is published when none was
   compiled here (``skipped``). A set of deltas is judged once per agent process.

Where each part is:

- ``cachekeeper.builder.agent.rounds``: ``run_round`` (1) and ``run_agent``, the daemon;
- ``cachekeeper.builder.agent.keep_warm``: ``KeepWarm``, one workload's resolve, skip,
  promotion (4), refusal (3) or build, and its report; the build folders it makes, always
  removed, and ``sweep_stale_builds`` for those a killed agent left;
- ``cachekeeper.builder.agent.options``: ``AgentOptions`` and ``prepare_options`` (the
  signing key read once, builds refused where it cannot be hidden), ``AgentMemory``;
- ``cachekeeper.builder.agent.outcomes``: ``WorkloadOutcome`` and ``RoundReport``;
- ``cachekeeper.builder.agent.stop``: ``StopSignal`` (SIGTERM/SIGINT: between rounds the
  agent wakes at once; a build is abandoned, reported ``failed``, and the agent returns
  cleanly), ``AgentStopped``.
"""

from __future__ import annotations

from cachekeeper.builder.agent.keep_warm import sweep_stale_builds
from cachekeeper.builder.agent.options import (
    DEFAULT_BUILD_TIMEOUT_S,
    AgentMemory,
    AgentOptions,
    prepare_options,
)
from cachekeeper.builder.agent.outcomes import RoundReport, WorkloadOutcome
from cachekeeper.builder.agent.rounds import KEEP_REPORTS, run_agent, run_round
from cachekeeper.builder.agent.stop import AgentStopped, StopSignal

__all__ = [
    "DEFAULT_BUILD_TIMEOUT_S",
    "KEEP_REPORTS",
    "AgentMemory",
    "AgentOptions",
    "AgentStopped",
    "RoundReport",
    "StopSignal",
    "WorkloadOutcome",
    "prepare_options",
    "run_agent",
    "run_round",
    "sweep_stale_builds",
]
