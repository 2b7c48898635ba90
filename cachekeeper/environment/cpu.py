"""The process state that changes what Inductor compiles for the CPU, read without torch.

Inductor's FX graph key (torch/_inductor/codecache.py, ``FxGraphHashDetails``, torch 2.13)
holds, besides the graph, the inductor config and the torch/Triton/device versions that
the rest of the fingerprint records:

- ``cpp_runtime_thread_count``: ``torch.get_num_threads()`` whenever the graph has CPU C++
  kernels and ``TORCHINDUCTOR_CPP_THREADS`` / ``TORCHINDUCTOR_CPP_DYNAMIC_THREADS`` are left
  at their defaults. torch's intra-op thread count is ``MKL_NUM_THREADS``, else
  ``OMP_NUM_THREADS``, else the CPUs this process may run on (``os.sched_getaffinity``),
  and never more than those CPUs. ``torchrun`` sets ``OMP_NUM_THREADS=1``: a cache built by a
  plain ``prewarm`` on a 32-core builder misses on every rank.
- the CPU vector ISA (``torch/_inductor/cpu_vec_isa.py``) that the C++ kernels and their
  compile command are keyed on: the best ISA the CPU has (from ``/proc/cpuinfo``), capped by
  ``ATEN_CPU_CAPABILITY``.
- the deterministic-algorithms flags, the default dtype, grad mode (AOTAutograd's key,
  ``torch/_functorch/_aot_autograd/autograd_cache.py``) and the CUDA matmul precision
  (TF32) settings: set by the training code itself, which the workload's entrypoints run,
  so prewarm compiles under them. The one variable that sets one of them at start-up,
  ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``, is in the fingerprint's ``env``.
- the device index (``CUDA_VISIBLE_DEVICES`` mapping): the fingerprint's ``gpus`` and the
  snapshot's ``devices`` hold it.

``state()`` is the fingerprint's ``cpu`` field; ``differences()`` says which of it makes a
cache built under one state miss under another, in words an operator can act on.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: at run time this module stays stdlib (the hook imports it)
    from cachekeeper.environment.shape import CpuState

__all__ = ["state", "differences", "thread_advice", "COMPARED", "PROVENANCE", "THREAD_VARIABLES"]

# The fields of ``state()`` that are in Inductor's key; the rest (PROVENANCE) say where they
# came from, and are in no identity (``cachekeeper.environment.fingerprint.digest_of``).
COMPARED = ("threads", "isa", "aten_cpu_capability")
PROVENANCE = ("threads_from",)
THREAD_VARIABLES = ("MKL_NUM_THREADS", "OMP_NUM_THREADS")

# Inductor's x86 ISAs, best first, with the /proc/cpuinfo flags each needs; then Arm.
_ISAS: tuple[tuple[str, frozenset[str]], ...] = (
    ("amx", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "amx_tile"})),
    ("avx512", frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq"})),
    ("avx2", frozenset({"avx2", "fma"})),
    ("sve", frozenset({"sve"})),
    ("neon", frozenset({"asimd"})),
)


def _env_threads(raw: str | None) -> int | None:
    """An ``OMP_NUM_THREADS``-style value's first number, or None when unset or not one."""
    if raw is None:
        return None
    first = raw.split(",", 1)[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def _affinity_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _cpu_flags() -> frozenset[str]:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _isa(flags: frozenset[str]) -> str | None:
    for name, needs in _ISAS:
        if needs <= flags:
            return name
    return None


def state(environ: Mapping[str, str]) -> CpuState:
    """This process's CPU compile state (the fingerprint's ``cpu`` field)."""
    cpus = _affinity_cpus()
    threads, source = cpus, f"{cpus} cpus this process may use"
    set_by = {
        name: value
        for name in THREAD_VARIABLES
        if (value := _env_threads(environ.get(name))) is not None
    }
    if set_by:  # MKL_NUM_THREADS wins over OMP_NUM_THREADS; name OMP's when both agree
        value = set_by.get("MKL_NUM_THREADS", set_by.get("OMP_NUM_THREADS"))
        name = "OMP_NUM_THREADS" if set_by.get("OMP_NUM_THREADS") == value else "MKL_NUM_THREADS"
        threads, source = min(value or cpus, cpus), f"{name}={environ[name]}"
    return {
        "threads": threads,
        "threads_from": source,
        "isa": _isa(_cpu_flags()),
        "aten_cpu_capability": environ.get("ATEN_CPU_CAPABILITY") or None,
    }


def with_threads(cpu: CpuState, omp_num_threads: int) -> CpuState:
    """``cpu`` as a process with ``OMP_NUM_THREADS=omp_num_threads`` (and no MKL's) has it."""
    return {**cpu, "threads": omp_num_threads, "threads_from": f"OMP_NUM_THREADS={omp_num_threads}"}


def differences(
    node: CpuState | None, snapshot: CpuState | None, *, built_by: str | None = None
) -> list[str]:
    """Why a CPU cache built under ``snapshot``'s state misses under ``node``'s (empty: it hits),
    each with the advice that works for how the snapshot got its thread count (``built_by``:
    ``"command"``, a ``[[command]]``'s launcher; ``"workload"``, prewarm's children and the
    workload's ``[process] omp_num_threads``; None, not known).

    Either side missing (a fingerprint from before schema 2) is no difference: it cannot be
    checked, and ``unchecked`` callers say so.
    """
    if not isinstance(node, Mapping) or not isinstance(snapshot, Mapping):
        return []
    out: list[str] = []
    built, has = snapshot.get("threads"), node.get("threads")
    if has != built:
        out.append(
            f"built with {built} threads ({snapshot.get('threads_from')}); this job has"
            f" {has} ({node.get('threads_from')}): {thread_advice(built, has, built_by=built_by)}"
        )
    for key, what in (("isa", "CPU vector ISA"), ("aten_cpu_capability", "ATEN_CPU_CAPABILITY")):
        if node.get(key) != snapshot.get(key):
            out.append(f"built for {what} {snapshot.get(key)}; this node has {node.get(key)}")
    return out


def thread_advice(built: object, has: object, *, built_by: str | None) -> str:
    """What to do when a snapshot built with ``built`` threads meets a hook with ``has``.

    The hook fingerprints its own process, which is not the job's ranks: exporting the
    ranks' ``OMP_NUM_THREADS`` before it (as their launcher will) is the fix whenever the
    ranks run with the snapshot's count, for every kind of workload. Otherwise the builder
    must compile with the job's count, and how depends on who set the snapshot's:
    ``[process] omp_num_threads`` reaches prewarm's children only, never a ``[[command]]``
    (whose launcher sets its ranks' count; its ``env`` reaches the launcher).
    """
    torchrun = " (torchrun gives each rank 1 when it starts more than one)" if built == 1 else ""
    if built_by == "command":
        return (
            f"export OMP_NUM_THREADS={built} before prejob, as the job's launcher will for its"
            f" ranks{torchrun}; if its processes do run with {has}, set OMP_NUM_THREADS ="
            f' "{has}" in the [[command]]\'s env and prewarm again ([process] omp_num_threads'
            " does not reach a command)"
        )
    rebuild = (
        f"set [process] omp_num_threads = {has} in the workload and prewarm again"
        if built_by == "workload"
        else f"prewarm again with {has} ([process] omp_num_threads = {has}; for a [[command]],"
        f' OMP_NUM_THREADS = "{has}" in its env)'
    )
    return (
        f"if the job's processes run with {built}{torchrun}, export OMP_NUM_THREADS={built}"
        f" before prejob, as their launcher will; otherwise {rebuild}"
    )
