"""What a prewarm or verify run proved: per-device results, verdicts, reports.

The verdict rule (docs/workloads.md, "What prewarm and verify report"): a cache dir is
**effective** for a workload on a device only if a fresh process that runs the workload
against it sees ``fxgraph_cache_miss == 0``, ``fxgraph_cache_bypass == 0`` and
``autograd_cache_miss == 0``, with at least one ``fxgraph_cache_hit``. A cache
that is installed but not used must never pass.

Those counters are what the process under test says about itself. The judge also looks from
outside (``CacheWatch``, made by ``cachekeeper.builder.cache_watch``): a verify whose cache dir
gained or changed an FX graph or AOTAutograd entry missed, whatever any process reported;
a command's verify in which no entry was read hit nothing; and every process of a command
that imported ``torch._dynamo`` must have left its end record (``CommandRun.gaps``).

The runs themselves happen in ``cachekeeper.builder.prewarm`` and
``cachekeeper.builder.verify`` (through ``cachekeeper.builder.children`` and
``cachekeeper.builder.commands``); this module only reads their results, so it imports
neither torch nor subprocess machinery. Their text for people:
``cachekeeper.builder.report_text``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from cachekeeper import wire
from cachekeeper.environment.devices import format_devices
from cachekeeper.errors import ColdCompileBroken, PrewarmFailed

__all__ = [
    "ErrorInfo",
    "RegimeResult",
    "DeviceRun",
    "ProcessEvidence",
    "CacheWatch",
    "CommandRun",
    "VerifyReport",
    "PrewarmReport",
    "ProgressEvent",
    "Progress",
    "is_effective",
    "miss_reason",
    "command_miss_reasons",
]

DeviceStatus = Literal["ok", "error", "invalid", "crashed", "timeout"]
# A command: "ok" exit 0, "error" exit non-zero, "invalid" could not start, "timeout" killed,
# "command_failed" a cold run that exited non-zero having compiled nothing (a usage error).
CommandStatus = Literal["ok", "error", "invalid", "timeout", "command_failed"]
VerifyStatus = Literal["verified", "not_effective", "failed"]
PrewarmStatus = Literal[
    "verified", "not_effective", "cold_compile_broken", "command_failed", "failed"
]
_EXIT_CODES = {
    "verified": 0,
    "not_effective": 1,
    "failed": PrewarmFailed.exit_code,
    "command_failed": PrewarmFailed.exit_code,  # an error of the command, not of a compile
    "cold_compile_broken": ColdCompileBroken.exit_code,
}


def is_effective(counters: dict[str, int]) -> bool:
    """The verdict rule on one run's counters (see the module docstring)."""
    return (
        counters.get("fxgraph_cache_miss", 0) == 0
        and counters.get("fxgraph_cache_bypass", 0) == 0
        and counters.get("autograd_cache_miss", 0) == 0
        and counters.get("fxgraph_cache_hit", 0) >= 1
    )


def _regime_verdict(counters: dict[str, int], *, mode: str) -> str:
    misses = counters.get("fxgraph_cache_miss", 0) + counters.get("autograd_cache_miss", 0)
    if counters.get("fxgraph_cache_bypass", 0):
        return "bypass"
    if mode == "prewarm":
        if misses:
            return "compiled"
        return "cached" if counters.get("fxgraph_cache_hit", 0) else "no_compile"
    if misses:
        return "miss"
    return "hit" if counters.get("fxgraph_cache_hit", 0) else "no_compile"


@dataclass(frozen=True)
class ProgressEvent:
    """One progress line from a child: a regime step started or finished on a device."""

    device: str  # "" for a command (its ranks choose their devices)
    mode: str  # "prewarm" | "verify"
    regime: str  # "attention[0]", "entrypoint[1]", "command[0]"
    event: str  # "start" | "done" | "running" (a command's heartbeat)
    elapsed_s: float  # since the child started
    label: str = ""
    seq: int | None = None
    seconds: float | None = None  # the step's own time ("done" only)

    def describe(self) -> str:
        seq = f" seq {self.seq}" if self.seq is not None else ""
        what = f"{self.device} {self.mode} {self.regime} {self.label}{seq}".strip()
        if self.event == "start":
            return f"[{self.elapsed_s:7.1f}s] {what} ..."
        if self.event == "running":  # a command's heartbeat: label is its last output line
            return f"[{self.elapsed_s:7.1f}s] {self.mode} {self.regime} running: {self.label}"
        return f"[{self.elapsed_s:7.1f}s] {what}: {self.seconds or 0.0:.1f} s"


Progress = Callable[[ProgressEvent], None]


@dataclass(frozen=True)
class ErrorInfo:
    """An exception from a child, or why a child produced no result."""

    type: str
    message: str
    where: str = ""
    traceback_tail: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ErrorInfo:
        return cls(
            type=str(raw.get("type", "")),
            message=str(raw.get("message", "")),
            where=str(raw.get("where", "")),
            traceback_tail=tuple(str(x) for x in raw.get("traceback_tail", ())),
        )


@dataclass(frozen=True)
class RegimeResult:
    """One regime (or entrypoint) on one device: time, counters and verdict."""

    name: str
    label: str
    seconds: float
    seq_seconds: tuple[float, ...]
    counters: dict[str, int]
    verdict: str  # prewarm: compiled|cached|no_compile|bypass; verify: hit|miss|no_compile|bypass

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)


@dataclass(frozen=True)
class DeviceRun:
    """One child process: a workload run on one device, for a prewarm or a verify."""

    device: str
    mode: str
    status: DeviceStatus
    seconds: float
    regimes: tuple[RegimeResult, ...] = ()
    counters: dict[str, int] = field(default_factory=dict)
    error: ErrorInfo | None = None

    @property
    def effective(self) -> bool:
        return self.status == "ok" and is_effective(self.counters)

    @classmethod
    def from_result(cls, raw: dict[str, Any], *, seconds: float) -> DeviceRun:
        mode = str(raw["mode"])
        return cls(
            device=str(raw["device"]),
            mode=mode,
            status=raw["status"],
            seconds=round(seconds, 3),
            regimes=tuple(
                RegimeResult(
                    name=r["name"],
                    label=r["label"],
                    seconds=float(r["seconds"]),
                    seq_seconds=tuple(float(s) for s in r.get("seq_seconds", ())),
                    counters={k: int(v) for k, v in r["counters"].items()},
                    verdict=_regime_verdict(r["counters"], mode=mode),
                )
                for r in raw.get("regimes", ())
            ),
            counters={k: int(v) for k, v in (raw.get("counters") or {}).items()},
            error=ErrorInfo.from_dict(raw["error"]) if raw.get("error") else None,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "device": self.device,
            "mode": self.mode,
            "status": self.status,
            "seconds": self.seconds,
            "regimes": [r.to_dict() for r in self.regimes],
            "counters": dict(self.counters),
            "error": self.error.to_dict() if self.error else None,
        }
        if self.mode == "verify":
            out["effective"] = self.effective
        return out


_COUNTED = (
    "fxgraph_cache_hit",
    "fxgraph_cache_miss",
    "fxgraph_cache_bypass",
    "autograd_cache_hit",
    "autograd_cache_miss",
)


@dataclass(frozen=True)
class ProcessEvidence:
    """One Python process a command started, as cachekeeper's evidence hook recorded it at
    exit (``cachekeeper/builder/_evidence_hook/sitecustomize.py``)."""

    pid: int
    rank: int | None
    device: str
    counters: dict[str, int]
    exit_status: str = "ok"  # "ok" | "exit" | "exception"
    exit_code: int = 0
    error: str = ""
    ppid: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    threads: int | None = None
    argv: tuple[str, ...] = ()

    @property
    def compiled(self) -> bool:
        """Whether the process looked anything up in the FX graph or AOTAutograd caches."""
        return any(self.counters.get(key, 0) for key in _COUNTED)

    @property
    def effective(self) -> bool:
        return is_effective(self.counters)

    @property
    def label(self) -> str:
        """``rank 1 (pid 4242, cuda:1)``, or ``pid 4242 (cpu)`` without a rank."""
        where = f"pid {self.pid}, {self.device}"
        return (
            f"rank {self.rank} ({where})"
            if self.rank is not None
            else f"pid {self.pid} ({self.device})"
        )

    @classmethod
    def from_record(cls, raw: dict[str, Any]) -> ProcessEvidence:
        def opt_int(key: str) -> int | None:
            value = raw.get(key)
            return int(value) if isinstance(value, int) and not isinstance(value, bool) else None

        ending: dict[str, Any] = raw["exit"] if isinstance(raw.get("exit"), dict) else {}
        return cls(
            pid=int(raw["pid"]),
            rank=opt_int("rank"),
            device=str(raw.get("device") or "cpu"),
            counters={str(k): int(v) for k, v in (raw.get("counters") or {}).items()},
            exit_status=str(ending.get("status", "ok")),
            exit_code=int(ending.get("code", 0) or 0),
            error=str(ending.get("error", ""))[:500],
            ppid=opt_int("ppid"),
            local_rank=opt_int("local_rank"),
            world_size=opt_int("world_size"),
            threads=opt_int("threads"),
            argv=tuple(str(a) for a in raw.get("argv") or ())[:12],
        )

    def to_dict(self) -> dict[str, Any]:
        out = wire.to_dict(self)
        out["compiled"] = self.compiled
        return out


@dataclass(frozen=True)
class CacheWatch:
    """A cache dir seen from outside the processes of a verify
    (``cachekeeper.builder.cache_watch``): the FX graph and AOTAutograd entries it had,
    those it gained or that changed (a miss writes one), and how many were read (None: not
    measured, because the dir is not the verify's own copy or its filesystem does not record
    reads)."""

    entries: int
    gained: tuple[str, ...] = ()  # relative paths, the first few
    gained_count: int = 0
    read: int | None = None

    @property
    def clean(self) -> bool:
        """Nothing gained or changed, and (where measured) at least one entry read."""
        return self.gained_count == 0 and self.read != 0

    def describe(self) -> str:
        """Why the view is not clean, in one clause ("" when it is)."""
        if self.gained_count:
            first = ", ".join(self.gained[:3])
            return (
                f"the cache dir gained or changed {self.gained_count} FX graph/AOTAutograd"
                f" entr{'ies' if self.gained_count != 1 else 'y'} during the run ({first}):"
                " something missed, whatever the processes reported"
            )
        if self.read == 0:
            return (
                f"none of the cache dir's {self.entries} FX graph/AOTAutograd entries was read"
                " during the run: nothing hit it, whatever the processes reported"
            )
        return ""

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CacheWatch:
        return cls(
            entries=int(raw.get("entries", 0)),
            gained=tuple(str(x) for x in raw.get("gained") or ()),
            gained_count=int(raw.get("gained_count", 0)),
            read=None if raw.get("read") is None else int(raw["read"]),
        )


@dataclass(frozen=True)
class CommandRun:
    """One run of a process kind's table (a ``[[command]]``): its exit, its log's tail, and
    every process's evidence; ``table`` is the kind's table name (``name``: ``command[0]``).

    ``gaps`` are what the evidence folder does not account for (a start record with no end,
    an end record with no start); ``watch`` is the verify's outside view of its cache copy;
    ``left_running`` the processes still running when the command's main process ended (the
    supervisor stopped them); ``sandbox`` what confined the run ("" when nothing did).
    """

    index: int
    mode: str  # "prewarm" | "verify"
    command: str  # the command line (Command.describe())
    status: CommandStatus
    seconds: float
    exit_code: int | None = None
    processes: tuple[ProcessEvidence, ...] = ()
    log_tail: tuple[str, ...] = ()
    error: ErrorInfo | None = None
    gaps: tuple[str, ...] = ()
    watch: CacheWatch | None = None
    left_running: tuple[str, ...] = ()
    sandbox: str = ""
    table: str = "command"

    @property
    def name(self) -> str:
        return f"{self.table}[{self.index}]"

    @property
    def compiling(self) -> tuple[ProcessEvidence, ...]:
        """The processes that looked anything up in the caches (the ranks that compiled)."""
        return tuple(p for p in self.processes if p.compiled)

    @property
    def effective(self) -> bool:
        """Exit 0, every process that compiled anything effective (at least one), every
        process accounted for (no gaps), and the outside view clean."""
        found = self.compiling
        return (
            self.status == "ok"
            and bool(found)
            and all(p.effective for p in found)
            and not self.gaps
            and (self.watch is None or self.watch.clean)
        )

    @property
    def counters(self) -> dict[str, int]:
        """The counters of every process, summed."""
        total: dict[str, int] = {}
        for proc in self.processes:
            for key, value in proc.counters.items():
                total[key] = total.get(key, 0) + value
        return total

    @property
    def devices(self) -> tuple[str, ...]:
        """The devices of the processes that compiled (a snapshot's coverage)."""
        return tuple(sorted({p.device for p in self.compiling}))

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "mode": self.mode,
            "command": self.command,
            "status": self.status,
            "seconds": self.seconds,
            "exit_code": self.exit_code,
            "counters": self.counters,
            "devices": list(self.devices),
            "processes": [p.to_dict() for p in self.processes],
            "log_tail": list(self.log_tail),
            "error": self.error.to_dict() if self.error else None,
            "gaps": list(self.gaps),
            "watch": self.watch.to_dict() if self.watch else None,
            "left_running": list(self.left_running),
            "sandbox": self.sandbox,
        }
        if self.mode == "verify":
            out["effective"] = self.effective
        return out


@dataclass(frozen=True)
class VerifyReport:
    """A verify of one workload against one cache dir: on each device, and per command."""

    workload: str
    workload_digest: str
    cache_dir: str
    devices: tuple[DeviceRun, ...]
    seconds: float
    built_devices: tuple[str, ...] = ()  # what the cache dir was built on, when known
    commands: tuple[CommandRun, ...] = ()
    watch: CacheWatch | None = None  # the cache dir itself while the device runs ran

    @property
    def effective(self) -> bool:
        runs: tuple[DeviceRun | CommandRun, ...] = (*self.devices, *self.commands)
        outside = self.watch is None or self.watch.gained_count == 0
        return bool(runs) and outside and all(run.effective for run in runs)

    @property
    def reasons(self) -> list[str]:
        """One line per device, command rank or command that was not effective, naming it
        (see ``miss_reason`` and ``command_miss_reasons``), and one for what the cache dir
        gained while the device runs ran."""
        found = [miss_reason(run, built_devices=self.built_devices) for run in self.devices]
        reasons = [reason for reason in found if reason]
        if self.watch is not None and self.watch.gained_count:
            reasons.append(f"devices: {self.watch.describe()}")
        for command in self.commands:
            reasons += command_miss_reasons(command)
        return reasons

    @property
    def covered_devices(self) -> tuple[str, ...]:
        """The device runs' devices and the devices the commands' ranks reported."""
        found = {run.device for run in self.devices}
        for command in self.commands:
            found.update(command.devices)
        return tuple(sorted(found))

    @property
    def status(self) -> VerifyStatus:
        runs: tuple[DeviceRun | CommandRun, ...] = (*self.devices, *self.commands)
        if any(run.status != "ok" for run in runs):
            return "failed"
        return "verified" if self.effective else "not_effective"

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self.status]

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "workload_digest": self.workload_digest,
            "cache_dir": self.cache_dir,
            "status": self.status,
            "effective": self.effective,
            "seconds": self.seconds,
            "devices": [run.to_dict() for run in self.devices],
            "built_devices": list(self.built_devices),
            "commands": [run.to_dict() for run in self.commands],
            "watch": self.watch.to_dict() if self.watch else None,
            "reasons": self.reasons,
        }


def miss_reason(run: DeviceRun, *, built_devices: tuple[str, ...] = ()) -> str | None:
    """Why ``run`` (a verify) was not effective, naming its device; None when it was.

    ``built_devices`` are the devices the cache dir was built on, when known. A device
    outside them missed because the device index is in Inductor's key: that is said, with
    the fix.
    """
    if run.mode != "verify" or run.effective:
        return None
    if run.status != "ok":
        return f"{run.device}: the verify run {run.status}"
    counters = run.counters
    fx = counters.get("fxgraph_cache_miss", 0)
    aot = counters.get("autograd_cache_miss", 0)
    bypass = counters.get("fxgraph_cache_bypass", 0)
    if fx or aot:
        what = (
            f"{run.device} missed {fx} FX graph{'s' if fx != 1 else ''} and {aot}"
            f" AOTAutograd entr{'ies' if aot != 1 else 'y'}"
        )
    elif bypass:
        what = f"{run.device} bypassed the FX graph cache {bypass} time{'s' if bypass != 1 else ''}"
    else:
        what = f"{run.device} compiled nothing through the FX graph cache (no hit)"
    if built_devices and run.device not in built_devices:
        return (
            f"{what}: this cache dir was built on {format_devices(list(built_devices))} only,"
            " and the device index is in Inductor's key: prewarm --device"
            f" {run.device} too (or give each rank one visible GPU, so that every rank is"
            " cuda:0)"
        )
    return f"{what}: the workload compiled what the cache dir does not hold"


def command_miss_reasons(run: CommandRun) -> list[str]:
    """Why a command's verify run was not effective: one line per failing rank, or one for
    the command; empty when it was effective."""
    if run.mode != "verify" or run.effective:
        return []
    if run.status != "ok":
        why = {"error": f"exited with status {run.exit_code}", "timeout": "timed out"}
        detail = f": {run.error.message}" if run.error and run.error.message else ""
        return [f"{run.name}: the verify run {why.get(run.status, 'could not start')}{detail}"]
    out: list[str] = []
    if run.watch is not None and not run.watch.clean:
        out.append(f"{run.name}: {run.watch.describe()}")
    out += [f"{run.name}: {gap}" for gap in run.gaps]
    if not run.compiling:
        out.append(
            f"{run.name}: no process reported a cache lookup (it compiled nothing, or its"
            " Python ignored PYTHONPATH, where cachekeeper's evidence hook is: -I, -E or -S)"
        )
        return out
    for proc in run.compiling:
        if proc.effective:
            continue
        fx = proc.counters.get("fxgraph_cache_miss", 0)
        aot = proc.counters.get("autograd_cache_miss", 0)
        bypass = proc.counters.get("fxgraph_cache_bypass", 0)
        if fx or aot:
            what = (
                f"missed {fx} FX graph{'s' if fx != 1 else ''} and {aot} AOTAutograd"
                f" entr{'ies' if aot != 1 else 'y'}"
            )
        elif bypass:
            what = f"bypassed the FX graph cache {bypass} time{'s' if bypass != 1 else ''}"
        else:
            what = "hit nothing in the FX graph cache"
        out.append(
            f"{run.name} {proc.label} {what}: this rank compiled what the cold run did not"
            " (a shape, mask or option that differs between runs, or another device index)"
        )
    return out


@dataclass(frozen=True)
class PrewarmReport:
    """A prewarm: cold compiles per device, the merge into the cache dir, then a verify."""

    workload: str
    workload_digest: str
    cache_dir: str
    devices: tuple[DeviceRun, ...]
    seconds: float
    merged: dict[str, dict[str, Any]] = field(default_factory=dict)  # device -> restore report
    verify: VerifyReport | None = None
    error: ErrorInfo | None = None  # a failure outside any child (the merge)
    commands: tuple[CommandRun, ...] = ()  # the commands' cold runs

    @property
    def status(self) -> PrewarmStatus:
        runs: tuple[DeviceRun | CommandRun, ...] = (*self.devices, *self.commands)
        if any(run.status == "error" for run in runs):
            return "cold_compile_broken"
        if any(run.status == "command_failed" for run in self.commands):
            return "command_failed"  # exited non-zero before compiling anything
        if self.error is not None or any(run.status != "ok" for run in runs):
            return "failed"
        if self.verify is None:
            return "failed"
        return self.verify.status

    @property
    def exit_code(self) -> int:
        return _EXIT_CODES[self.status]

    @property
    def stats(self) -> dict[str, Any]:
        """The manifest's ``stats``: verified when ``stats["verify"]["effective"]``."""
        verify: dict[str, Any] = {"effective": False, "status": self.status}
        if self.verify is not None:
            verify = {
                "effective": self.verify.effective,
                "status": self.verify.status,
                "seconds": self.verify.seconds,
                "devices": {run.device: _run_stats(run) for run in self.verify.devices},
            }
            if self.verify.commands:
                verify["commands"] = [_command_stats(run) for run in self.verify.commands]
        prewarm: dict[str, Any] = {
            "status": self.status,
            "seconds": self.seconds,
            "devices": {run.device: _run_stats(run) for run in self.devices},
        }
        if self.commands:
            prewarm["commands"] = [_command_stats(run) for run in self.commands]
        return {"prewarm": prewarm, "verify": verify, "devices": list(self.covered_devices)}

    @property
    def covered_devices(self) -> tuple[str, ...]:
        """The devices the cache holds kernels for: each device run's, and those the
        commands' compiling processes reported (their verify's when it ran)."""
        found = [run.device for run in self.devices]
        commands = self.verify.commands if self.verify and self.verify.commands else self.commands
        for run in commands:
            found += [d for d in run.devices if d not in found]
        return tuple(found)

    def raise_for_status(self) -> None:
        """Raise ColdCompileBroken or PrewarmFailed unless the cache is verified effective."""
        if self.status == "verified":
            return
        runs: tuple[DeviceRun | CommandRun, ...] = (*self.devices, *self.commands)
        first = self.error or next((r.error for r in runs if r.error), None)
        detail = f"{first.type}: {first.message} ({first.where})" if first else self.status
        if self.status == "cold_compile_broken":
            raise ColdCompileBroken(f"workload {self.workload!r}: cold compile raised {detail}")
        raise PrewarmFailed(f"workload {self.workload!r}: prewarm {self.status}: {detail}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "workload_digest": self.workload_digest,
            "cache_dir": self.cache_dir,
            "status": self.status,
            "seconds": self.seconds,
            "devices": [run.to_dict() for run in self.devices],
            "merged": {k: dict(v) for k, v in self.merged.items()},
            "verify": self.verify.to_dict() if self.verify else None,
            "error": self.error.to_dict() if self.error else None,
            "commands": [run.to_dict() for run in self.commands],
            "stats": self.stats,
        }


def _run_stats(run: DeviceRun) -> dict[str, Any]:
    out: dict[str, Any] = {
        "status": run.status,
        "seconds": run.seconds,
        "counters": dict(run.counters),
        "regimes": [r.to_dict() for r in run.regimes],
    }
    if run.mode == "verify":
        out["effective"] = run.effective
    return out


def _command_stats(run: CommandRun) -> dict[str, Any]:
    out: dict[str, Any] = {
        "command": run.command,
        "status": run.status,
        "seconds": run.seconds,
        "exit_code": run.exit_code,
        "counters": run.counters,
        "devices": list(run.devices),
        "ranks": [
            {"rank": p.rank, "device": p.device, "counters": dict(p.counters)}
            for p in run.compiling
        ],
    }
    if run.mode == "verify":
        out["effective"] = run.effective
        if run.watch is not None:
            out["outside"] = run.watch.to_dict()
    return out
