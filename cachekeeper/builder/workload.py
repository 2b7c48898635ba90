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

A workload is bounded (``LIMITS``): its text, its tables, the sequence lengths of a regime
and of the whole file (each one a cold compile), a command's argv and env. A file past
one is refused naming the field and the limit, so no registered workload can keep a
builder compiling for days (the agent's build timeout bounds what is left).

This module never imports torch or user code: the server validates workloads with it.
Whether an import path (``"pkg.mod:attr"``) resolves is checked by the prewarm child;
whether a command's ``argv[0]`` exists, when it runs. ``Workload.code`` lists what a
workload would make a builder run (import paths and commands): the server asks for the
admin scope to register it, and the agent runs it only when its allowlist admits it.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cachekeeper import wire
from cachekeeper.errors import WorkloadInvalid
from cachekeeper.units import parse_duration

__all__ = [
    "LIMITS",
    "DTYPES",
    "MASKS",
    "SCORE_MODS",
    "MIN_HEAD_DIM",
    "Regime",
    "Entrypoint",
    "Command",
    "CodeRef",
    "Workload",
    "load_workload",
    "parse_workload",
    "is_import_path",
]

DTYPES = ("float32", "float16", "bfloat16")
# Built-in mask_mods and score_mods: name -> (required args, optional args).
MASKS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "none": ((), ()),
    "causal": ((), ()),
    "sliding_window": (("window",), ()),
    "document_causal": (("doc_len",), ()),
    "prefix_lm": (("prefix_len",), ()),
}
SCORE_MODS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "none": ((), ()),
    "softcap": (("cap",), ()),
    "alibi": ((), ("heads",)),
}
# flex_attention's Triton kernels refuse embedding dims below 16 (tl.dot's minimum);
# dims that are not powers of two are padded by Inductor (torch >= 2.6) and accepted.
MIN_HEAD_DIM = 16
# torch.compile keyword arguments a workload may set, with their TOML types.
_COMPILE_KEYS: dict[str, type | tuple[type, ...]] = {
    "dynamic": bool,
    "fullgraph": bool,
    "backend": str,
    "mode": str,
    "options": dict,
}
# What one workload file may hold (docs/workloads.md, "Limits"). Each sequence length of
# each regime is one flex_attention compile per device, cold (seconds to a minute each),
# then again in verify; a real training run has a handful.
LIMITS = {
    "bytes": 1 << 20,  # the file's text, UTF-8
    "attention": 64,  # [[attention]] tables
    "seq_lens": 64,  # per regime
    "calls": 256,  # sequence lengths of all regimes together
    "entrypoint": 64,  # [[entrypoint]] tables
    "command": 16,  # [[command]] tables
    "argv": 1024,  # a command's arguments
    "env": 256,  # a command's variables
}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_IMPORT_PATH_RE = re.compile(rf"^{_IDENT}(\.{_IDENT})*:{_IDENT}(\.{_IDENT})*$")
_TOP_KEYS = frozenset({"name", "attention", "entrypoint", "command", "process"})
_PROCESS_KEYS = frozenset({"omp_num_threads"})
_REGIME_KEYS = frozenset(
    {
        "batch",
        "q_heads",
        "kv_heads",
        "head_dim",
        "seq_lens",
        "dtype",
        "mask",
        "mask_args",
        "score_mod",
        "score_args",
        "backward",
        "compile",
        "kernel_options",
    }
)
_ENTRYPOINT_KEYS = frozenset({"target", "kwargs"})
_COMMAND_KEYS = frozenset({"argv", "env", "cwd", "timeout"})
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables a command's ``env`` may not set, with why: prewarm and verify own them.
RESERVED_ENV = {
    "TORCHINDUCTOR_CACHE_DIR": "prewarm and verify set it to their staging dir",
    "TRITON_CACHE_DIR": "Triton's cache must land in the cache dir (triton/<index>)",
    "CACHEKEEPER_EVIDENCE_DIR": "cachekeeper's per-process evidence goes there",
}


def is_import_path(value: str) -> bool:
    """Whether ``value`` has the form ``package.module:attribute``."""
    return bool(_IMPORT_PATH_RE.match(value))


@dataclass(frozen=True)
class Regime:
    """One ``[[attention]]`` table: a flex_attention call pattern, run per seq len in order."""

    batch: int
    q_heads: int
    kv_heads: int
    head_dim: int
    seq_lens: tuple[int, ...]
    dtype: str
    mask: str = "none"
    mask_args: dict[str, Any] = field(default_factory=dict)
    score_mod: str = "none"
    score_args: dict[str, Any] = field(default_factory=dict)
    backward: bool = True
    compile: dict[str, Any] = field(default_factory=dict)
    kernel_options: dict[str, Any] | None = None

    @property
    def enable_gqa(self) -> bool:
        return self.q_heads != self.kv_heads

    def describe(self, *, seqs: bool = True) -> str:
        """A one-line human label, e.g. ``causal b1 h32/8 d128 bfloat16 seq 4096,8192``."""
        mods = self.mask if self.score_mod == "none" else f"{self.mask}+{self.score_mod}"
        label = (
            f"{mods} b{self.batch} h{self.q_heads}/{self.kv_heads} d{self.head_dim} {self.dtype}"
        )
        if seqs:
            label += " seq " + ",".join(str(s) for s in self.seq_lens)
        return label

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "batch": self.batch,
            "q_heads": self.q_heads,
            "kv_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "seq_lens": list(self.seq_lens),
            "dtype": self.dtype,
            "mask": self.mask,
            "mask_args": dict(self.mask_args),
            "score_mod": self.score_mod,
            "score_args": dict(self.score_args),
            "backward": self.backward,
            "compile": dict(self.compile),
        }
        if self.kernel_options is not None:
            out["kernel_options"] = dict(self.kernel_options)
        return out


@dataclass(frozen=True)
class Entrypoint:
    """One ``[[entrypoint]]`` table: the training code's own warm-up, called with kwargs."""

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)


@dataclass(frozen=True)
class Command:
    """One ``[[command]]`` table: the site's own launcher, run without a shell.

    ``env`` is added to the builder's environment; ``cwd`` (None: where prewarm runs) is
    where it starts; ``timeout_s`` (None: no bound but the prewarm's) bounds one run.
    """

    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    timeout_s: float | None = None

    def describe(self, *, limit: int = 120) -> str:
        """The command line as a shell would show it, cut at ``limit`` characters."""
        line = shlex.join(self.argv)
        return line if len(line) <= limit else line[: limit - 3] + "..."

    def to_dict(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "env": dict(self.env),
            "cwd": self.cwd,
            "timeout_s": self.timeout_s,
        }


@dataclass(frozen=True)
class CodeRef:
    """Something a workload makes a builder run: an import path, or a command.

    ``kind`` is ``"import"`` (``value`` is ``pkg.mod:attr``) or ``"command"`` (``value`` is
    the command line, ``argv0`` its program, ``command`` the whole table: its ``env`` and
    ``cwd`` are code too, and the allowlist judges them); ``where`` names the field.
    """

    kind: str
    value: str
    where: str
    argv0: str = ""
    command: Command | None = None


@dataclass(frozen=True)
class Workload:
    """A parsed, validated workload file. ``digest`` is the sha256 of its TOML text.

    ``source`` is the name error messages use for it (the file name, or the registered
    workload's name on the server).
    """

    name: str
    regimes: tuple[Regime, ...]
    entrypoints: tuple[Entrypoint, ...]
    digest: str
    text: str
    source: str = ""
    omp_num_threads: int | None = None  # [process]: the thread count training's ranks have
    commands: tuple[Command, ...] = ()

    @property
    def code(self) -> tuple[CodeRef, ...]:
        """Every import path and command this workload would make a builder run."""
        refs: list[CodeRef] = []
        for i, regime in enumerate(self.regimes):
            for fld, value in (("mask", regime.mask), ("score_mod", regime.score_mod)):
                if ":" in value:
                    refs.append(CodeRef("import", value, f"attention[{i}].{fld}"))
        for i, entry in enumerate(self.entrypoints):
            refs.append(CodeRef("import", entry.target, f"entrypoint[{i}].target"))
        for i, command in enumerate(self.commands):
            refs.append(
                CodeRef(
                    "command",
                    shlex.join(command.argv),
                    f"command[{i}].argv",
                    command.argv[0],
                    command=command,
                )
            )
        return tuple(refs)


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
    if size > LIMITS["bytes"]:
        raise WorkloadInvalid(
            f"{source}: the file is {size} bytes; a workload file is at most {LIMITS['bytes']}"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise WorkloadInvalid(f"{source}: not valid TOML: {exc}") from exc
    except RecursionError as exc:  # tomllib recurses per nesting level
        raise WorkloadInvalid(
            f"{source}: not valid TOML: arrays or tables nested too deeply"
        ) from exc
    v = _Validator(source)
    v.unknown_keys(data, _TOP_KEYS, "")
    name = v.required(data, "name", str, "")
    if not _NAME_RE.match(name):
        v.fail(
            "name",
            f"{name!r} is not a valid workload name "
            "(letters, digits, '.', '_', '-'; starts with a letter or digit; at most 128)",
        )
    attention = _tables(v, data, "attention")
    entrypoint = _tables(v, data, "entrypoint")
    command = _tables(v, data, "command")
    for key, tables in (("attention", attention), ("entrypoint", entrypoint), ("command", command)):
        v.at_most(key, len(tables), LIMITS[key], f"[[{key}]] tables", per=" in a workload")
    if not attention and not entrypoint and not command:
        v.fail(
            "", "a workload needs at least one [[attention]], [[entrypoint]] or [[command]] table"
        )
    process = v.typed(data.get("process", {}), dict, "process")
    v.unknown_keys(process, _PROCESS_KEYS, "process")
    omp = (
        v.positive(process, "omp_num_threads", "process") if "omp_num_threads" in process else None
    )
    regimes = tuple(_regime(v, table, f"attention[{i}]") for i, table in enumerate(attention))
    calls = sum(len(r.seq_lens) for r in regimes)
    v.at_most(
        "attention",
        calls,
        LIMITS["calls"],
        "sequence lengths in all regimes (each is a cold compile per device)",
        per=" in a workload",
    )
    entrypoints = tuple(
        _entrypoint(v, table, f"entrypoint[{i}]") for i, table in enumerate(entrypoint)
    )
    commands = tuple(_command(v, table, f"command[{i}]") for i, table in enumerate(command))
    return Workload(
        name=name,
        regimes=regimes,
        entrypoints=entrypoints,
        digest=hashlib.sha256(text.encode("utf-8")).hexdigest(),
        text=text,
        source=source,
        omp_num_threads=omp,
        commands=commands,
    )


class _Validator:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, message: str) -> None:
        prefix = f"{self.source}: {where}: " if where else f"{self.source}: "
        raise WorkloadInvalid(prefix + message)

    def unknown_keys(self, table: dict[str, Any], allowed: frozenset[str], where: str) -> None:
        unknown = sorted(set(table) - allowed)
        if unknown:
            key = f"{where}.{unknown[0]}" if where else unknown[0]
            self.fail(key, f"unknown key (allowed: {', '.join(sorted(allowed))})")

    def required(self, table: dict[str, Any], key: str, kind: type, where: str) -> Any:
        if key not in table:
            self.fail(_join(where, key), "required field is missing")
        return self.typed(table[key], kind, _join(where, key))

    def typed(self, value: Any, kind: type, where: str) -> Any:
        if kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind is float:
            ok = isinstance(value, int | float) and not isinstance(value, bool)
        else:
            ok = isinstance(value, kind)
        if not ok:
            self.fail(where, f"expected {_type_name(kind)}, got {_type_name(type(value))}")
        return float(value) if kind is float else value

    def at_most(self, where: str, count: int, limit: int, what: str, *, per: str = "") -> None:
        if count > limit:
            self.fail(where, f"{count} {what}; at most {limit}{per} (docs/workloads.md, 'Limits')")

    def positive(self, table: dict[str, Any], key: str, where: str) -> int:
        value = self.required(table, key, int, where)
        if value <= 0:
            self.fail(_join(where, key), f"must be a positive integer, got {value}")
        return int(value)


def _join(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


def _type_name(kind: type) -> str:
    return {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "a boolean",
        list: "an array",
        dict: "a table",
    }.get(kind, kind.__name__)


def _tables(v: _Validator, data: dict[str, Any], key: str) -> list[dict[str, Any]]:
    value = data.get(key, [])
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        v.fail(key, f"must be an array of tables ([[{key}]])")
    return list(value)


def _regime(v: _Validator, table: dict[str, Any], where: str) -> Regime:
    v.unknown_keys(table, _REGIME_KEYS, where)
    batch = v.positive(table, "batch", where)
    q_heads = v.positive(table, "q_heads", where)
    kv_heads = v.positive(table, "kv_heads", where) if "kv_heads" in table else q_heads
    if q_heads % kv_heads:
        v.fail(
            f"{where}.kv_heads",
            f"q_heads ({q_heads}) must be a multiple of kv_heads ({kv_heads})",
        )
    head_dim = v.positive(table, "head_dim", where)
    if head_dim < MIN_HEAD_DIM:
        v.fail(
            f"{where}.head_dim",
            f"flex_attention needs head_dim >= {MIN_HEAD_DIM}, got {head_dim}",
        )
    seq_lens = v.required(table, "seq_lens", list, where)
    if not seq_lens:
        v.fail(f"{where}.seq_lens", "must list at least one sequence length")
    v.at_most(
        f"{where}.seq_lens",
        len(seq_lens),
        LIMITS["seq_lens"],
        "sequence lengths (each is a cold compile per device)",
        per=" per regime",
    )
    for i, seq in enumerate(seq_lens):
        v.typed(seq, int, f"{where}.seq_lens[{i}]")
        if seq <= 0:
            v.fail(f"{where}.seq_lens[{i}]", f"must be a positive integer, got {seq}")
    dtype = v.required(table, "dtype", str, where)
    if dtype not in DTYPES:
        v.fail(f"{where}.dtype", f"unknown dtype {dtype!r} (allowed: {', '.join(DTYPES)})")
    mask = v.typed(table.get("mask", "none"), str, f"{where}.mask")
    mask_args = _mod_args(v, table, where, "mask", mask, MASKS)
    score_mod = v.typed(table.get("score_mod", "none"), str, f"{where}.score_mod")
    score_args = _mod_args(v, table, where, "score", score_mod, SCORE_MODS, field="score_mod")
    backward = v.typed(table.get("backward", True), bool, f"{where}.backward")
    compile_kwargs = v.typed(table.get("compile", {}), dict, f"{where}.compile")
    for key, value in compile_kwargs.items():
        kind = _COMPILE_KEYS.get(key)
        if kind is None:
            v.fail(
                f"{where}.compile.{key}",
                f"not a torch.compile option this format passes (allowed: "
                f"{', '.join(sorted(_COMPILE_KEYS))})",
            )
        v.typed(value, kind, f"{where}.compile.{key}")  # type: ignore[arg-type]
    kernel_options = table.get("kernel_options")
    if kernel_options is not None:
        v.typed(kernel_options, dict, f"{where}.kernel_options")
        for key, value in kernel_options.items():
            if not isinstance(value, bool | int | float | str):
                v.fail(
                    f"{where}.kernel_options.{key}",
                    f"expected a number, boolean or string, got {_type_name(type(value))}",
                )
    return Regime(
        batch=batch,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        seq_lens=tuple(seq_lens),
        dtype=dtype,
        mask=mask,
        mask_args=mask_args,
        score_mod=score_mod,
        score_args=score_args,
        backward=backward,
        compile=dict(compile_kwargs),
        kernel_options=dict(kernel_options) if kernel_options is not None else None,
    )


def _mod_args(
    v: _Validator,
    table: dict[str, Any],
    where: str,
    prefix: str,
    name: str,
    builtins: dict[str, tuple[tuple[str, ...], tuple[str, ...]]],
    *,
    field: str | None = None,
) -> dict[str, Any]:
    field = field or prefix
    args_key = f"{prefix}_args"
    args = v.typed(table.get(args_key, {}), dict, f"{where}.{args_key}")
    if ":" in name:
        if not is_import_path(name):
            v.fail(f"{where}.{field}", f"{name!r} is not an import path of the form 'pkg.mod:attr'")
        return dict(args)  # a factory's arguments are the factory's business
    if name not in builtins:
        v.fail(
            f"{where}.{field}",
            f"unknown {field} {name!r} (built-in: {', '.join(builtins)}; or 'pkg.mod:factory')",
        )
    required, optional = builtins[name]
    for key in args:
        if key not in required and key not in optional:
            allowed = ", ".join(required + optional) or "none"
            v.fail(
                f"{where}.{args_key}.{key}", f"unknown argument for {name!r} (allowed: {allowed})"
            )
    for key in required:
        if key not in args:
            v.fail(f"{where}.{args_key}.{key}", f"{name!r} requires this argument")
    for key, value in args.items():
        arg_where = f"{where}.{args_key}.{key}"
        if key == "cap":
            if v.typed(value, float, arg_where) <= 0:
                v.fail(arg_where, f"must be positive, got {value}")
        elif key == "prefix_len":
            if v.typed(value, int, arg_where) < 0:
                v.fail(arg_where, f"must be >= 0, got {value}")
        elif v.typed(value, int, arg_where) <= 0:
            v.fail(arg_where, f"must be a positive integer, got {value}")
    return {key: float(val) if key == "cap" else val for key, val in args.items()}


def _entrypoint(v: _Validator, table: dict[str, Any], where: str) -> Entrypoint:
    v.unknown_keys(table, _ENTRYPOINT_KEYS, where)
    target = v.required(table, "target", str, where)
    if not is_import_path(target):
        v.fail(f"{where}.target", f"{target!r} is not an import path of the form 'pkg.mod:attr'")
    kwargs = v.typed(table.get("kwargs", {}), dict, f"{where}.kwargs")
    return Entrypoint(target=target, kwargs=dict(kwargs))


def _command(v: _Validator, table: dict[str, Any], where: str) -> Command:
    v.unknown_keys(table, _COMMAND_KEYS, where)
    argv = v.required(table, "argv", list, where)
    if not argv:
        v.fail(f"{where}.argv", "must name at least the program to run")
    v.at_most(f"{where}.argv", len(argv), LIMITS["argv"], "arguments", per=" per command")
    for i, arg in enumerate(argv):
        v.typed(arg, str, f"{where}.argv[{i}]")
        if "\x00" in arg:
            v.fail(f"{where}.argv[{i}]", "contains a NUL character")
    if not argv[0].strip():
        v.fail(f"{where}.argv[0]", "the program to run is empty")
    env_table = v.typed(table.get("env", {}), dict, f"{where}.env")
    v.at_most(f"{where}.env", len(env_table), LIMITS["env"], "variables", per=" per command")
    env: dict[str, str] = {}
    for key, value in env_table.items():
        key_where = f"{where}.env.{key}"
        if not _ENV_NAME_RE.match(key):
            v.fail(key_where, "not a valid environment variable name")
        if key in RESERVED_ENV:
            v.fail(key_where, f"cannot be set by a workload: {RESERVED_ENV[key]}")
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            v.fail(key_where, f"expected a string, got {_type_name(type(value))}")
        if "\x00" in value:
            v.fail(key_where, "contains a NUL character")
        env[key] = value
    cwd = None
    if "cwd" in table:
        cwd = v.typed(table["cwd"], str, f"{where}.cwd")
        if not cwd.strip() or "\x00" in cwd:
            v.fail(f"{where}.cwd", "must be a directory path")
    timeout_s = None
    if "timeout" in table:
        try:
            timeout_s = parse_duration(table["timeout"])
        except ValueError as exc:
            v.fail(f"{where}.timeout", str(exc))
    return Command(argv=tuple(argv), env=env, cwd=cwd, timeout_s=timeout_s)
