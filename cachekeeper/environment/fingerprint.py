"""The environment fingerprint: what must match for an Inductor cache entry to be valid.

Collected without importing torch (the pre-job hook must start fast): versions come from
package metadata and from the text of ``torch/version.py``; GPUs from NVML (nvidia-ml-py)
when present, else ``nvidia-smi``; the driver from NVML or ``/proc/driver/nvidia/version``.

The GPU query is bounded (``collect``'s ``gpu_timeout_s``): NVML runs in a daemon thread
that is given up on, and ``nvidia-smi`` is killed and never waited for, so a driver hung in
the kernel cannot hold the caller (the pre-job hook runs it inside its deadline). A query
that does not answer in time raises ``FingerprintUnavailable``: a fingerprint without the
GPUs would be a wrong one, never a safe guess.

The ``cpu`` field (schema 2) is the process state that changes what Inductor compiles for
the CPU: the thread count, the vector ISA (``cachekeeper.environment.cpu``). It is compared only for
snapshots that cover the ``cpu`` device; a fingerprint without it (schema 1) is not a
mismatch, and ``unchecked`` names it so ``explain`` can say it was not checked.

Identity (``digest_of``) is the sha256 of the canonical JSON of the fingerprint *without
its provenance* (``PROVENANCE``: ``cpu.threads_from``, which says where the thread count
came from, ``OMP_NUM_THREADS=1`` or ``1 cpus this process may use``). Two processes that
compile the same kernels are one environment however their values were set: before issue
31 the digest covered the whole JSON, so a node with ``OMP_NUM_THREADS=1`` exported by hand
was another environment than the torchrun ranks that built its snapshot, and the status
counted its restores in no row. ``json_digest`` is that older digest, the sha256 of the
whole JSON: manifests keep it in their ``fingerprint_digest`` key (a checksum of the
fingerprint as written, which every reader, old or new, checks), so no snapshot id moves.

Matching (``compare``) is exact on every field but the driver; for the driver the default
policy (``"newer"``) accepts a node driver at least as new as the builder's, since a kernel
built by a newer ptxas can fail to load on an older driver, and no Inductor key holds it.

The shape (``Fingerprint``, ``Gpu``, ``CpuState``) and its check (``parse``) are
``cachekeeper.environment.shape``'s, which ``cpu`` and ``remote_tier`` type against too; this
module re-exports them. A user's script imports all of it as ``cachekeeper.fingerprint``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast

from cachekeeper import config, remote_tier
from cachekeeper.environment import cpu
from cachekeeper.environment.devices import coverage_advice
from cachekeeper.environment.shape import CpuState, Fingerprint, Gpu, parse
from cachekeeper.errors import FingerprintUnavailable
from cachekeeper.wire import Mismatch

__all__ = [
    "SCHEMA",
    "CpuState",
    "DriverPolicy",
    "Fingerprint",
    "Gpu",
    "Mismatch",
    "collect",
    "canonical_json",
    "digest_of",
    "identity",
    "json_digest",
    "PROVENANCE",
    "compare",
    "is_compatible",
    "format_mismatches",
    "parse",
    "unchecked",
    "visible_gpus",
    "with_cpu",
]

SCHEMA = 2
DriverPolicy = Literal["newer", "exact", "any"]
GPU_TIMEOUT_S = 10.0  # how long NVML and nvidia-smi may take together, by default

# Environment variables that change Inductor/Dynamo keys or behaviour. Paths and pure
# logging switches do not change what is compiled, so they stay out of the fingerprint.
_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_COMPILE_")
# Outside those prefixes: TORCH_ALLOW_TF32_CUBLAS_OVERRIDE turns TF32 matmuls on at start-up,
# and the CUDA matmul precision is in Inductor's FX graph key (torch 2.13).
_ENV_NAMES = frozenset({"TORCH_ALLOW_TF32_CUBLAS_OVERRIDE"})
# The per-key tier's switches that are in no key, and its URL (which holds a token), stay
# out; its key-relevant switches are recorded like any variable (cachekeeper.remote_tier).
_ENV_IGNORED = frozenset(
    {
        "TORCHINDUCTOR_CACHE_DIR",
        "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT",
        "TORCH_COMPILE_DEBUG_DIR",
        *remote_tier.NOT_IN_KEYS,
    }
)

# Fields that say where a value came from, not what it is: (field, key inside it). They are
# shown (``explain``, the status page) and never part of an identity (``digest_of``).
PROVENANCE: tuple[tuple[str, str], ...] = tuple(("cpu", key) for key in cpu.PROVENANCE)

# Fields compared exactly, in the order an explanation lists them.
_EXACT_FIELDS = ("torch", "triton", "cuda", "cuda_wheels", "python", "arch", "gpus", "env")


def with_cpu(fingerprint: Fingerprint, state: CpuState) -> Fingerprint:
    """``fingerprint`` with ``state`` as its ``cpu`` field: the environment of a cache
    compiled by processes in that CPU state (a prewarm's children, a command's ranks)."""
    return {**fingerprint, "cpu": state}


def canonical_json(value: Any) -> str:
    """The one JSON text that digests are computed over: sorted keys, no spaces, UTF-8."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def identity(fingerprint: Fingerprint) -> dict[str, Any]:
    """The fingerprint without its provenance (``PROVENANCE``): what its digest covers.
    Every other field, known to this version or not, stays as it is."""
    out: dict[str, Any] = dict(fingerprint)
    for name, key in PROVENANCE:
        inner = out.get(name)
        if isinstance(inner, Mapping) and key in inner:
            out[name] = {k: v for k, v in inner.items() if k != key}
    return out


def digest_of(fingerprint: Fingerprint) -> str:
    """The environment's identity: sha256 (lowercase hex) of the canonical JSON of
    ``identity(fingerprint)``. Status rows, agents, job reports and the hook's default
    cache dir are named by it."""
    return hashlib.sha256(canonical_json(identity(fingerprint)).encode()).hexdigest()


def json_digest(fingerprint: Fingerprint) -> str:
    """sha256 of the whole fingerprint's canonical JSON, provenance included: a manifest's
    ``fingerprint_digest`` key (see the module docstring), and ``digest_of`` before issue 31."""
    return hashlib.sha256(canonical_json(dict(fingerprint)).encode()).hexdigest()


def _installed_versions() -> dict[str, str]:
    """{normalized distribution name: version} from ``*.dist-info`` folder names on sys.path.

    Reading folder names instead of importlib.metadata keeps this at a few milliseconds
    (importing importlib.metadata and parsing every METADATA file costs ~100 ms).
    """
    found: dict[str, str] = {}
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info") and "-" in name:
                dist, _, version = name[: -len(".dist-info")].partition("-")
                found.setdefault(dist.lower().replace("_", "-").replace(".", "-"), version)
    return found


def _torch_build(versions: Mapping[str, str]) -> tuple[str | None, str | None]:
    """(torch version with local tag, CUDA version torch was built with), without import."""
    spec = importlib.util.find_spec("torch") if "torch" not in sys.modules else None
    if "torch" in sys.modules:  # already imported by the caller: read it, it costs nothing
        torch = sys.modules["torch"]
        return str(torch.__version__), getattr(torch.version, "cuda", None)
    if spec is None or not spec.submodule_search_locations:
        return versions.get("torch"), None
    for location in spec.submodule_search_locations:
        text_path = Path(location) / "version.py"
        if text_path.is_file():
            text = text_path.read_text(encoding="utf-8", errors="replace")
            version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
            cuda = re.search(r"^cuda\s*(?::[^=]+)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
            return (
                version.group(1) if version else versions.get("torch"),
                cuda.group(1) if cuda else None,
            )
    return versions.get("torch"), None


def _cuda_wheels(versions: Mapping[str, str]) -> dict[str, str]:
    """Versions of installed ``nvidia-*`` wheels (cuBLAS, cuDNN, NVRTC, nvJitLink, ...)."""
    return {
        name: version
        for name, version in sorted(versions.items())
        if name.startswith("nvidia-") and name != "nvidia-ml-py"
    }


def _visible_indices(count: int, uuids: list[str]) -> list[int]:
    """Physical GPU indices in the order CUDA_VISIBLE_DEVICES makes visible."""
    raw = os.environ.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return list(range(count))
    out: list[int] = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            break
        if item.isdigit():
            idx = int(item)
            if idx >= count:
                break
            out.append(idx)
        else:
            matches = [i for i, u in enumerate(uuids) if u.startswith(item) or item in u]
            if len(matches) != 1:
                break
            out.append(matches[0])
    return out


def _gpus_from_nvml() -> tuple[list[Gpu], str | None] | None:
    try:
        import pynvml  # nvidia-ml-py
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        count = pynvml.nvmlDeviceGetCount()
        physical: list[tuple[str, str]] = []  # (name, capability) by physical index
        uuids: list[str] = []
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(handle)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            uuids.append(uuid.decode() if isinstance(uuid, bytes) else str(uuid))
            physical.append((name, f"{major}.{minor}"))
        gpus = [
            Gpu(index=visible, name=physical[phys][0], capability=physical[phys][1])
            for visible, phys in enumerate(_visible_indices(count, uuids))
        ]
        return gpus, driver
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _gpus_from_nvml_within(timeout_s: float) -> tuple[list[Gpu], str | None] | None:
    """``_gpus_from_nvml`` in a daemon thread; FingerprintUnavailable when it does not
    return in ``timeout_s`` (a C call into a hung driver cannot be interrupted, only left)."""
    found: list[tuple[list[Gpu], str | None] | None] = [None]

    def run() -> None:
        found[0] = _gpus_from_nvml()

    worker = threading.Thread(target=run, name="cachekeeper-nvml", daemon=True)
    worker.start()
    worker.join(max(timeout_s, 0.0))
    if worker.is_alive():
        raise FingerprintUnavailable(
            f"NVML did not answer within {timeout_s:.1f} s (is the GPU driver hung?)"
        )
    return found[0]


def _gpus_from_smi(timeout_s: float) -> tuple[list[Gpu], str | None] | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.Popen(
            [exe, "--query-gpu=name,compute_cap,driver_version,uuid", "--format=csv,noheader"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        proc.kill()  # not waited for: one stuck in the driver (state D) never dies
        raise FingerprintUnavailable(
            f"nvidia-smi did not answer within {timeout_s:.1f} s (is the GPU driver hung?)"
        ) from None
    if proc.returncode != 0:
        return None
    rows = [[c.strip() for c in line.split(",")] for line in out.splitlines() if line.strip()]
    rows = [r for r in rows if len(r) >= 4]
    if not rows:
        return None
    uuids = [r[3] for r in rows]
    gpus = [
        Gpu(index=visible, name=rows[phys][0], capability=rows[phys][1])
        for visible, phys in enumerate(_visible_indices(len(rows), uuids))
    ]
    return gpus, rows[0][2]


def _driver_from_proc() -> str | None:
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module(?: for [^ ]+)?\s+([0-9]+(?:\.[0-9]+)+)", text)
    return found.group(1) if found else None


def _compile_env(environ: Mapping[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in sorted(environ.items())
        if (k.startswith(_ENV_PREFIXES) or k in _ENV_NAMES) and k not in _ENV_IGNORED
    }


def collect(
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    gpu_timeout_s: float = GPU_TIMEOUT_S,
) -> Fingerprint:
    """This machine's fingerprint, every field present (see the module docstring).

    ``gpu_timeout_s`` bounds the GPU query (NVML, then nvidia-smi, together); past it,
    ``FingerprintUnavailable``. ``overrides`` replaces fields after collection. It exists
    for tests and for the ``CACHEKEEPER_FINGERPRINT_OVERRIDES`` variable (a JSON object)
    that the test suite uses to simulate another environment; it is not a user-facing
    option, and its values are not checked.
    """
    env = os.environ if environ is None else environ
    versions = _installed_versions()
    torch_version, cuda = _torch_build(versions)
    until = time.monotonic() + gpu_timeout_s
    gpu_info = _gpus_from_nvml_within(gpu_timeout_s) or _gpus_from_smi(until - time.monotonic())
    gpus, driver = gpu_info if gpu_info else ([], None)
    if driver is None:
        driver = _driver_from_proc()
    fingerprint: Fingerprint = {
        "schema": SCHEMA,
        "torch": torch_version,
        "triton": versions.get("triton") or versions.get("pytorch-triton"),
        "cuda": cuda,
        "cuda_wheels": _cuda_wheels(versions),
        "driver": driver,
        "gpus": gpus,
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
        "arch": platform.machine(),
        "env": _compile_env(env),
        "cpu": cpu.state(env),
    }
    replaced = {**config.fingerprint_overrides(env), **(overrides or {})}
    return cast(Fingerprint, {**fingerprint, **replaced}) if replaced else fingerprint


def visible_gpus() -> list[int]:
    """The CUDA indices this process can see (``collect``'s ``gpus``, no torch import): what
    ``cachekeeper.environment.devices.select_devices`` checks a ``--device`` against."""
    return [gpu["index"] for gpu in collect()["gpus"]]


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version))


def _gpu_models(gpus: Sequence[Gpu]) -> list[dict[str, str | None]]:
    return [{"name": g.get("name"), "capability": g.get("capability")} for g in gpus]


def _compared_gpus(
    node: Fingerprint, snapshot: Fingerprint, devices: list[str] | None
) -> tuple[list[dict[str, str | None]], list[dict[str, str | None]]]:
    """The GPU models ``compare`` holds against each other: at the covered indices, when
    the snapshot's ``devices`` are known, else all of them. Read with ``get``: a row an
    older server stored was checked only as a JSON object."""
    a, b = node.get("gpus") or [], snapshot.get("gpus") or []
    if devices is None:
        return _gpu_models(a), _gpu_models(b)
    covered = {int(d.split(":", 1)[1]) for d in devices if d.startswith("cuda:")}
    node_by_idx = {g.get("index"): g for g in a}
    snap_by_idx = {g.get("index"): g for g in b}
    both = sorted(covered & node_by_idx.keys() & snap_by_idx.keys())
    return _gpu_models([node_by_idx[i] for i in both]), _gpu_models([snap_by_idx[i] for i in both])


def compare(
    node: Fingerprint,
    snapshot: Fingerprint,
    *,
    driver_policy: DriverPolicy = "newer",
    devices: list[str] | None = None,
    node_devices: list[str] | None = None,
    built_by: str | None = None,
) -> list[Mismatch]:
    """Fields on which ``node`` cannot use a cache built under ``snapshot``; empty = compatible.

    ``built_by`` (``Manifest.built_by``) goes with a ``cpu`` mismatch, for its advice.

    ``devices`` are the devices a snapshot covers (``["cuda:0", "cuda:1"]`` or ``["cpu"]``).
    When given, GPU models are compared only at the covered indices (a snapshot built on
    cuda:0 of an 8-GPU builder suits a 1-GPU node of the same model), and the devices the
    node will use (``node_devices``, default: every visible GPU index) must all be covered,
    since Inductor's key holds the device index. A field one side lacks compares as null.
    """
    out: list[Mismatch] = []
    for field in _EXACT_FIELDS:
        a: object
        b: object
        if field == "gpus":
            a, b = _compared_gpus(node, snapshot, devices)
        else:
            a, b = node.get(field), snapshot.get(field)
        if a != b:
            out.append(Mismatch(field=field, node=a, snapshot=b))
    node_cpu, snap_cpu = node.get("cpu"), snapshot.get("cpu")
    if _cpu_compiled(snapshot, devices) and cpu.differences(node_cpu, snap_cpu):
        kind = built_by if built_by in ("command", "workload") else None
        out.append(Mismatch(field="cpu", node=node_cpu, snapshot=snap_cpu, built_by=kind))  # type: ignore[arg-type]
    if devices is not None:
        wanted = node_devices
        if wanted is None:
            wanted = [f"cuda:{g['index']}" for g in node.get("gpus") or []] or ["cpu"]
        uncovered = [d for d in wanted if d not in devices]
        if uncovered:
            out.append(Mismatch(field="devices", node=sorted(wanted), snapshot=sorted(devices)))
    node_driver, snap_driver = node.get("driver"), snapshot.get("driver")
    if driver_policy != "any" and node_driver != snap_driver:
        if driver_policy == "exact" or node_driver is None or snap_driver is None:
            out.append(Mismatch(field="driver", node=node_driver, snapshot=snap_driver))
        elif _version_tuple(node_driver) < _version_tuple(snap_driver):
            out.append(Mismatch(field="driver", node=node_driver, snapshot=snap_driver))
    return out


def _cpu_compiled(snapshot: Fingerprint, devices: list[str] | None) -> bool:
    """Whether the snapshot holds CPU kernels (it covers ``cpu``, or is a GPU-less build)."""
    if devices is not None:
        return "cpu" in devices
    return not snapshot.get("gpus")


def unchecked(
    node: Fingerprint, snapshot: Fingerprint, *, devices: list[str] | None = None
) -> list[str]:
    """Fields ``compare`` could not check because one side does not record them.

    Today only ``cpu`` (added in fingerprint schema 2), and only where it matters.
    """
    if not _cpu_compiled(snapshot, devices):
        return []
    return ["cpu"] if (node.get("cpu") is None) != (snapshot.get("cpu") is None) else []


def is_compatible(
    node: Fingerprint,
    snapshot: Fingerprint,
    *,
    driver_policy: DriverPolicy = "newer",
    devices: list[str] | None = None,
    node_devices: list[str] | None = None,
) -> bool:
    """True when ``compare`` finds no mismatch: the node can use the snapshot."""
    return not compare(
        node, snapshot, driver_policy=driver_policy, devices=devices, node_devices=node_devices
    )


def describe_mismatch(mismatch: Mismatch) -> str:
    """One mismatch in words: ``torch 2.11.0+cu130 != 2.11.0+cu128``, or the device and CPU
    advice for those two fields."""
    if mismatch.field == "devices":  # node: the devices asked for; snapshot: those it covers
        return coverage_advice(covered=mismatch.snapshot, wanted=mismatch.node)
    if mismatch.field == "cpu":  # node / snapshot: cachekeeper.environment.cpu.state() of each
        found = cpu.differences(mismatch.node, mismatch.snapshot, built_by=mismatch.built_by)
        return "cpu: " + "; ".join(found)
    if mismatch.field == "signature":  # node: the key ids it trusts; snapshot: why not (server)
        keys = ", ".join(str(k) for k in mismatch.node or []) or "none"
        return f"signature: {_short(mismatch.snapshot)} (this node trusts key(s) {keys})"
    return f"{mismatch.field} {_short(mismatch.node)} != {_short(mismatch.snapshot)}"


def _short(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, str):
        return value
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def format_mismatches(mismatches: list[Mismatch]) -> str:
    """One line: ``torch 2.11.0+cu130 != 2.11.0+cu128; driver 570.1 != 580.2``."""
    return "; ".join(describe_mismatch(m) for m in mismatches)
