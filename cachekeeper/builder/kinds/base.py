"""What a workload kind is: the module of one table of a workload file, behind one protocol.

A workload file holds tables of several kinds (``[[attention]]``, ``[[entrypoint]]``,
``[[command]]``). Each kind is one module of ``cachekeeper/builder/kinds/``, registered by
its table name (``cachekeeper.builder.kinds.register``), the way torch's remote caches pick
a backend class by name. Nothing outside a kind's module asks which kind a table is. A kind:

- **parses** one of its tables into a frozen spec (``parse``: every error through
  ``Validator``, which names the file, the table and the field) and checks what all of its
  tables add up to (``check``: the sequence lengths of all regimes); ``limits[table]`` is how
  many of its tables one workload may hold, and the rest of ``limits`` its own bounds;
- says what **code** a table makes a builder run (``code``: import paths and commands, as
  ``CodeRef``): the server asks for the admin scope to register a workload that has any, the
  agent's allowlist must admit each one, and the prewarm child checks that an import path
  names a ``def`` or ``class`` before anything runs; none of them asks the kind;
- **describes** a table in one line (``describe``: the agent's log, progress lines);
- **runs**, cold in a prewarm and again in a verify, in one of two ways:

  ``DeviceKind``, a step of the fresh child a prewarm or verify starts on each device
  (``cachekeeper.builder._child``, torch imported there, every GPU visible, the real
  index): the child runs the device kinds' tables in order, each through ``run_step``, and
  the verdict is per device (``verdicts.DeviceRun``, one ``RegimeResult`` per table). A
  verify runs them against the cache dir itself.

  ``ProcessKind``, processes of its own, once per table, that choose their own devices and
  ranks (the site's launcher): ``run`` returns a ``verdicts.CommandRun``, judged per
  process. A verify runs each in a fresh copy of the cache dir, watched from outside.

``parse``, ``check``, ``code`` and ``describe`` are all the server uses: a kind's module
imports nothing of a build at module level (torch inside ``run_step``, the run machinery
inside ``run``), so parsing a workload stays as light as the server needs.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, NoReturn, Protocol, TypedDict

from cachekeeper.errors import WorkloadInvalid

if TYPE_CHECKING:
    from cachekeeper.builder.confine import Confinement
    from cachekeeper.builder.kinds.command_spec import Command
    from cachekeeper.builder.verdicts import CommandRun, Progress

__all__ = [
    "FILE_KEYS",
    "CodeRef",
    "DeviceKind",
    "Kind",
    "ProcessKind",
    "SetupError",
    "StepContext",
    "StepResult",
    "Validator",
    "is_import_path",
]

# The workload file's own top-level keys (``name``, the ``[process]`` table): no kind is
# named so.
FILE_KEYS = frozenset({"name", "process"})
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH_RE = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")


def is_import_path(value: str) -> bool:
    """Whether ``value`` has the form ``package.module:attribute``."""
    return bool(_IMPORT_PATH_RE.match(value))


@dataclass(frozen=True)
class CodeRef:
    """Something a workload makes a builder run: an import path, or a command.

    ``form`` is ``"import"`` (``value`` is ``pkg.mod:attr``) or ``"command"`` (``value`` is
    the command line, ``argv0`` its program, ``command`` the whole table: its ``env`` and
    ``cwd`` are code too, and the allowlist judges them); ``where`` names the field. A kind
    says its code in these two forms, so that the allowlist and the admin rule judge a new
    kind's tables without knowing it.
    """

    form: Literal["import", "command"]
    value: str
    where: str
    argv0: str = ""
    command: Command | None = None


class Validator:
    """Checks on a workload's TOML that raise ``WorkloadInvalid`` naming the file
    (``source``), the table and the field: ``t.toml: attention[0].kv_heads: ...``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> NoReturn:
        prefix = f"{self.source}: {where}: " if where else f"{self.source}: "
        raise WorkloadInvalid(prefix + message)

    def unknown_keys(self, table: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            key = f"{where}.{unknown[0]}" if where else unknown[0]
            self.fail(key, f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def required(self, table: Mapping[str, Any], key: str, kind: type, where: str) -> Any:
        if key not in table:
            self.fail(join(where, key), "required field is missing")
        return self.typed(table[key], kind, join(where, key))

    def typed(self, value: Any, kind: type, where: str) -> Any:
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            self.fail(where, f"expected {type_name(kind)}, got {type_name(type(value))}")
        return float(value) if kind is float else value

    def at_most(self, where: str, count: int, limit: int, what: str, *, per: str = "") -> None:
        if count > limit:
            self.fail(where, f"{count} {what}; at most {limit}{per} (docs/workloads.md, 'Limits')")

    def positive(self, table: Mapping[str, Any], key: str, where: str) -> int:
        value = self.required(table, key, int, where)
        if value <= 0:
            self.fail(join(where, key), f"must be a positive integer, got {value}")
        return int(value)


def join(where: str, key: str) -> str:
    """``where.key`` (``key`` alone at the top of the file)."""
    return f"{where}.{key}" if where else key


def type_name(kind: type) -> str:
    """How an error names a TOML type: ``an integer``, ``a table``."""
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "a table",
    }.get(kind, kind.__name__)


class SetupError(Exception):
    """A device kind's table cannot be set up on this device (an import path that does not
    resolve, a factory that refuses its arguments): the child's run is ``invalid``, not a
    broken cold compile. Its message is the field and the reason, without the file."""


class StepResult(TypedDict):
    """What one device kind's step reports (the child's ``regimes[i]``)."""

    name: str  # the table: "attention[0]"
    label: str
    seconds: float
    seq_seconds: list[float]
    counters: dict[str, int]


class StepContext(Protocol):
    """What the child gives a device kind's step (``cachekeeper.builder._child``)."""

    @property
    def device(self) -> Any:
        """The ``torch.device`` the step runs on (the CPU for the test suite's fake GPUs)."""
        ...

    def at(self, where: str) -> None:
        """Name what runs now: a failure from here on is reported in it."""
        ...

    def emit(self, name: str, event: str, **extra: Any) -> None:
        """A progress line (``start`` / ``done``) the prewarm relays."""
        ...

    def sync(self) -> None:
        """Wait for the device's queued work (a step's time ends there)."""
        ...

    def counters(self) -> dict[str, int]:
        """The process's FX graph and AOTAutograd cache counters so far."""
        ...


class Kind(ABC):
    """One table of a workload file: parse, check, code, describe (module docstring)."""

    table: ClassVar[str]  # the TOML array of tables this kind reads: [[table]]
    limits: ClassVar[Mapping[str, int]]  # limits[table]: tables per workload; then its own

    @abstractmethod
    def parse(self, v: Validator, raw: dict[str, Any], *, where: str) -> Any:
        """One table (``where`` is ``table[i]``) as this kind's frozen spec."""

    def check(self, v: Validator, specs: tuple[Any, ...]) -> None:
        """What all of a workload's tables of this kind may add up to (nothing by default)."""
        return None

    @abstractmethod
    def code(self, spec: Any, *, where: str) -> tuple[CodeRef, ...]:
        """What ``spec`` makes a builder run: import paths and commands."""

    @abstractmethod
    def describe(self, spec: Any) -> str:
        """``spec`` in one line for people."""


class DeviceKind(Kind):
    """A kind whose tables run as steps of the fresh child on each device."""

    @abstractmethod
    def run_step(self, spec: Any, *, name: str, child: StepContext) -> StepResult:
        """Run ``spec`` once in the child (torch is imported here, never at module level);
        raise ``SetupError`` when it cannot be set up, anything else when it is broken."""


class ProcessKind(Kind):
    """A kind whose tables start processes of their own, once each."""

    @abstractmethod
    def run(
        self,
        spec: Any,
        *,
        index: int,
        mode: str,
        cache_dir: Path,
        work: Path,
        progress: Progress | None,
        timeout_s: float | None,
        confinement: Confinement | None,
    ) -> CommandRun:
        """Run ``spec`` once against ``cache_dir`` (``mode``: prewarm or verify); never
        raises for what its processes do."""
