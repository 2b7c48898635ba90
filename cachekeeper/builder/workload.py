"""Workload files: the training shapes a prewarm compiles, parsed and validated.

A workload is a TOML file (format in docs/workloads.md)::

    name = "drafter-gqa"
    [[attention]]                 # one flex_attention regime; several allowed
    batch = 1
    q_heads = 32
    kv_heads = 8
    head_dim = 128
    seq_lens = [4096, 8192]
    dtype = "bfloat16"
    mask = "document_causal"
    mask_args = { doc_len = 1024 }
    [[entrypoint]]                # the training code's own warm-up step
    target = "mytrainer.warmup:step"
    kwargs = { seq_len = 4096 }
    [[command]]                   # the site's own launcher, run as it is (no shell)
    argv = ["torchrun", "--nproc-per-node", "8", "-m", "mytrainer.train", "--steps", "2"]
    env = { WANDB_MODE = "disabled" }
    cwd = "/srv/mytrainer"
    timeout = "30m"
    [process]                     # optional: the process state training's ranks run with
    omp_num_threads = 1           # torchrun's default; CPU kernels are keyed on it

Each table is read by its kind (``cachekeeper.builder.kinds``: one module per table name,
``[[attention]]``, ``[[entrypoint]]``, ``[[command]]``); this module reads the file itself
(its size, ``name``, ``[process]``) and which tables it holds, and never asks what a kind
does with them. A workload is bounded (``LIMITS`` lists it all): its text, and through each
kind's ``limits`` its tables, the sequence lengths of a regime and of the whole file (each
one a cold compile), a command's argv and env. A file past one is refused naming the field
and the limit, so no registered workload can keep a builder compiling for days (the agent's
build timeout bounds what is left).

This module never imports torch, user code or what runs a build: the server validates
workloads with it. Whether an import path (``"pkg.mod:attr"``) resolves is checked by the
prewarm child; whether a command's ``argv[0]`` exists, when it runs. ``Workload.code``
lists what a workload would make a builder run (import paths and commands, as each kind
says): the server asks for the admin scope to register it, and the agent runs it only when
its allowlist admits it.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachekeeper.builder.kinds import kinds
from cachekeeper.builder.kinds.base import (
    FILE_KEYS,
    CodeRef,
    DeviceKind,
    Kind,
    ProcessKind,
    Validator,
)
from cachekeeper.errors import WorkloadInvalid

__all__ = [
    "LIMITS",
    "Table",
    "Workload",
    "load_workload",
    "parse_workload",
]

# What the file itself may be (docs/workloads.md, "Limits"); its tables are bounded by
# their kinds' ``limits``.
_FILE_LIMITS = {
    "bytes": 1 << 20,  # the file's text, UTF-8
}
# Every limit docs/workloads.md lists, by the name it has always had here
# (``cachekeeper.workload.LIMITS``): the file's, then the built-in kinds'. A copy for
# readers: the parser reads the file's and each kind's own.
LIMITS: dict[str, int] = {
    **_FILE_LIMITS,
    **{key: value for kind in kinds() for key, value in kind.limits.items()},
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_PROCESS_KEYS = frozenset({"omp_num_threads"})


@dataclass(frozen=True)
class Table:
    """One table of a workload, as its kind parsed it: ``spec`` is the kind's (a ``Regime``,
    an ``Entrypoint``, a ``Command``), ``index`` its place among the tables of its kind."""

    kind: Kind
    index: int
    spec: Any

    @property
    def name(self) -> str:
        """``attention[0]``: how reports, progress lines and errors name it."""
        return f"{self.kind.table}[{self.index}]"


@dataclass(frozen=True)
class Workload:
    """A parsed, validated workload file. ``digest`` is the sha256 of its TOML text.

    ``tables`` are in the order of the registered kinds, then of the file. ``source`` is the
    name error messages use for it (the file name, or the registered workload's name on the
    server).
    """

    name: str
    tables: tuple[Table, ...]
    digest: str
    text: str
    source: str = ""
    omp_num_threads: int | None = None  # [process]: the thread count training's ranks have

    def specs(self, table: str) -> tuple[Any, ...]:
        """The parsed tables of one kind, by its table name, in file order."""
        return tuple(t.spec for t in self.tables if t.kind.table == table)

    @property
    def device_tables(self) -> tuple[Table, ...]:
        """The tables that run as steps of the fresh child on each device."""
        return tuple(t for t in self.tables if isinstance(t.kind, DeviceKind))

    @property
    def process_tables(self) -> tuple[Table, ...]:
        """The tables that start processes of their own, which choose their own devices,
        ranks and CPU state (the site's launcher)."""
        return tuple(t for t in self.tables if isinstance(t.kind, ProcessKind))

    @property
    def code(self) -> tuple[CodeRef, ...]:
        """Every import path and command this workload would make a builder run."""
        return tuple(ref for t in self.tables for ref in t.kind.code(t.spec, where=t.name))


def load_workload(path: Path) -> Workload:
    """Read and validate the workload file at ``path``."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise WorkloadInvalid(f"{path}: cannot read workload file: {exc.strerror}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadInvalid(f"{path.name}: workload file is not valid UTF-8") from exc
    return parse_workload(text, source=path.name)


def parse_workload(text: str, *, source: str) -> Workload:
    """Parse and validate workload TOML; errors name ``source``, the table and the field."""
    size = len(text.encode("utf-8", errors="surrogatepass"))
    if size > _FILE_LIMITS["bytes"]:
        raise WorkloadInvalid(
            f"{source}: the file is {size} bytes; "
            f"a workload file is at most {_FILE_LIMITS['bytes']}"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadInvalid(f"{source}: not valid TOML: {exc}") from exc
    except RecursionError as exc:  # tomllib recurses per nesting level
        raise WorkloadInvalid(
            f"{source}: not valid TOML: arrays or tables nested too deeply"
        ) from exc
    registered = kinds()
    v = Validator(source)
    v.unknown_keys(data, FILE_KEYS | {kind.table for kind in registered}, "")
    name = v.required(data, "name", str, "")
    if not _NAME_RE.match(name):
        v.fail(
            "name",
            f"{name!r} is not a valid workload name "
            "(letters, digits, '.', '_', '-'; starts with a letter or digit; at most 128)",
        )
    raw = {kind.table: _tables(v, data, kind.table) for kind in registered}
    for kind in registered:
        key = kind.table
        v.at_most(key, len(raw[key]), kind.limits[key], f"[[{key}]] tables", per=" in a workload")
    if not any(raw.values()):
        v.fail("", f"a workload needs at least one {_one_of(registered)} table")
    process = v.typed(data.get("process", {}), dict, "process")
    v.unknown_keys(process, _PROCESS_KEYS, "process")
    omp = (
        v.positive(process, "omp_num_threads", "process") if "omp_num_threads" in process else None
    )
    tables: list[Table] = []
    for kind in registered:
        specs = tuple(
            kind.parse(v, table, where=f"{kind.table}[{i}]")
            for i, table in enumerate(raw[kind.table])
        )
        kind.check(v, specs)
        tables += [Table(kind, i, spec) for i, spec in enumerate(specs)]
    return Workload(
        name=name,
        tables=tuple(tables),
        digest=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        text=text,
        source=source,
        omp_num_threads=omp,
    )


def _one_of(registered: tuple[Kind, ...]) -> str:
    """``[[attention]], [[entrypoint]] or [[command]]``."""
    names = [f"[[{kind.table}]]" for kind in registered]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _tables(v: Validator, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        v.fail(key, f"must be an array of tables ([[{key}]])")
    return list(value)
