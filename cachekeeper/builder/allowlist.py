"""What a builder agrees to run: the agent's allowlist (``agent --allow`` / ``--allow-file``).

A workload registered on the server can make a builder run code: a ``[[command]]`` (its
program, arguments, ``env`` and ``cwd`` alike), an ``[[entrypoint]]``, a mask or score
factory named by import path (``Workload.code``). The agent runs only what its own operator
admitted, whoever registered the workload. The grammar is structured, so that nothing in a
workload can walk around an entry (docs/security.md, "The allowlist", has the threat model)::

    # /etc/cachekeeper/allow.toml   (--allow-file; a file whose name ends in .toml)
    imports = ["mytrainer.warmup:step", "mytrainer.masks:*"]

    [[command]]
    program = "/opt/venv/bin/torchrun"   # or a bare name, looked up on the agent's PATH
    args = ["--nproc-per-node", "[1-8]", "--standalone", "-m", "mytrainer.train"]
    rest = "--*"                  # optional: any number of further arguments, each matching
    env = { WANDB_MODE = "disabled", "NCCL_*" = "*" }   # what the workload's env may set
    cwd = ["/srv/mytrainer"]      # optional: where it may start (real paths)

- **Arguments** are matched one by one: ``args[i]`` is a glob (``fnmatch``: ``*``, ``?``,
  ``[...]``) over argument ``i`` alone, so no pattern spans two arguments. Without
  ``rest`` the command has exactly ``len(args)`` arguments; with it, every further one
  matches ``rest``.
- **The program** (``argv[0]``) is where it really runs from: a bare name is looked up on
  the PATH the command will have, a relative path from its ``cwd``; then its folder is
  resolved to its real path (``..`` and links in folders followed) and its own name kept
  (a venv's ``python`` is a link, and the venv's, not its target's). ``program`` is
  resolved the same way when the allowlist is loaded; a glob in it never crosses a ``/``.
  The command then runs that very file (``commands.run_command``).
- **env**: every variable the workload's ``env`` sets must be admitted by a ``NAME = "value
  glob"`` of the entry; ``NAME`` may be a glob, except for *loader variables*
  (``is_loader_variable``: those that make Python, the dynamic loader, a shell or a
  compiler load or run other code, ``LD_PRELOAD``, ``PYTHONPATH``, ``PYTHONWARNINGS``,
  ``BROWSER``, ``PATH`` ...), which only an entry that names them exactly admits.
- **cwd**: a workload's ``cwd`` must resolve to one of the entry's; without ``cwd`` in the
  entry, the workload may not set one.
- **Import paths** (``module:attribute``): ``module`` is a glob over the dotted name (it may
  span dots: ``mytrainer.*``), ``attribute`` a glob over the attribute path (``*`` when
  left out). The builder also admits an import path only for an object its module defines
  (``check_defined``: a ``def`` or ``class`` at the top of the module's source, read
  without importing it), so ``mytrainer.*`` never admits ``mytrainer.warmup:os.system``.

``--allow LINE`` (and the lines of an ``--allow-file`` not named ``*.toml``) is the short
form: a word that looks like an import pattern (it has a ``.`` or ``:``, and no ``/``:
``mytrainer.*``, ``mytrainer.warmup:step``) is one; anything else is a command line,
``shlex``-split, its words the program and one glob per argument, ``...`` last for any
further arguments. It admits no ``env`` and no ``cwd``: those need a TOML entry. With no
entry at all, the agent builds only workloads without code.
"""

from __future__ import annotations

import ast
import fnmatch
import importlib.machinery
import os
import re
import shlex
import sys
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cachekeeper.builder.kinds.base import CodeRef
from cachekeeper.builder.kinds.command_spec import Command
from cachekeeper.builder.programs import canonical, program_path
from cachekeeper.builder.workload import Workload
from cachekeeper.errors import WorkloadInvalid

__all__ = [
    "Allowlist",
    "CommandRule",
    "ImportRule",
    "Refusal",
    "LOADER_VARIABLES",
    "LOADER_PREFIXES",
    "is_loader_variable",
    "check_defined",
]

# Variables that make a process load or run code other than the command's own: the dynamic
# loader's, Python's, the shells', other interpreters', the compilers Inductor and Triton
# run, the libraries CUDA, NCCL and OpenSSL load, and the folders whose contents run (a
# user site's .pth files follow HOME). docs/security.md lists them with why.
LOADER_PREFIXES = ("LD_", "PYTHON", "TRITON_", "BASH_FUNC_", "GIT_", "DYLD_")
LOADER_VARIABLES = frozenset(
    {
        # the dynamic loader and the C library
        "GLIBC_TUNABLES", "GCONV_PATH", "LOCPATH", "NLSPATH", "HOSTALIASES", "MALLOC_CHECK_",
        # Python beyond PYTHON*: webbrowser runs $BROWSER (PYTHONWARNINGS can import it)
        "BROWSER", "VIRTUAL_ENV",
        # where programs, configuration and per-user packages are found
        "PATH", "HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_DIRS",
        "XDG_DATA_DIRS", "TMPDIR",
        # shells
        "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "PS4", "PROMPT_COMMAND", "IFS", "CDPATH",
        "SHELL", "PAGER", "EDITOR", "VISUAL", "TERMINFO", "TERMINFO_DIRS",
        # other interpreters a launcher may start
        "PERL5LIB", "PERL5OPT", "PERLLIB", "RUBYLIB", "RUBYOPT", "NODE_OPTIONS", "NODE_PATH",
        "JAVA_TOOL_OPTIONS", "_JAVA_OPTIONS", "JDK_JAVA_OPTIONS", "LUA_PATH", "LUA_CPATH",
        # the compilers Inductor and Triton run, and what they include and link
        "CC", "CXX", "CPP", "LD", "AR", "AS", "CFLAGS", "CXXFLAGS", "CPPFLAGS", "LDFLAGS",
        "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH", "LIBRARY_PATH", "COMPILER_PATH",
        "GCC_EXEC_PREFIX", "CUDA_HOME", "CUDA_PATH", "CUDA_ROOT", "ROCM_PATH", "ROCM_HOME",
        "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR",
        # libraries CUDA, NCCL, ROCm and OpenSSL load by name
        "CUDA_INJECTION64_PATH", "NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH",
        "CUDA_CACHE_PATH", "NCCL_NET_PLUGIN", "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN",
        "NCCL_ENV_PLUGIN", "HSA_TOOLS_LIB", "ROCP_TOOL_LIB", "OPENSSL_CONF", "OPENSSL_ENGINES",
        "OPENSSL_MODULES",
    }
)  # fmt: skip

_GLOB_CHARS = re.compile(r"[*?\[]")
_IMPORT_GLOB = re.compile(r"^[A-Za-z0-9_*?\[\]!.-]+(:[A-Za-z0-9_*?\[\]!.-]+)?$")
_RULE_KEYS = frozenset({"program", "args", "rest", "env", "cwd"})
_FILE_KEYS = frozenset({"imports", "command"})


def is_loader_variable(name: str) -> bool:
    """Whether setting ``name`` can make a process load or run other code (see above)."""
    return name in LOADER_VARIABLES or name.startswith(LOADER_PREFIXES)


def _path_matches(candidate: str, pattern: str) -> bool:
    """A glob over a path whose wildcards never cross a ``/``."""
    parts, wanted = candidate.split("/"), pattern.split("/")
    return len(parts) == len(wanted) and all(
        fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted, strict=True)
    )


def _program_pattern(raw: str, *, where: str) -> str:
    """An entry's ``program``: a real path (its glob-free folder resolved), or a bare name
    found on this process's PATH. ValueError names ``where``."""
    text = os.path.expanduser(raw.strip())
    if not text:
        raise ValueError(f"{where}: the program is empty")
    if os.sep not in text:
        if _GLOB_CHARS.search(text):
            raise ValueError(
                f"{where}: program {raw!r} is a glob without a folder; give a path"
                " (/opt/venv/bin/*)"
            )
        found = program_path(text, cwd=os.getcwd(), path=os.environ.get("PATH"))
        if found is None:
            raise ValueError(
                f"{where}: program {raw!r} is not on this builder's PATH; give its path"
            )
        return found
    if not os.path.isabs(text):
        raise ValueError(f"{where}: program {raw!r} is a relative path; give an absolute one")
    parts = text.split("/")
    fixed = next((i for i, part in enumerate(parts) if _GLOB_CHARS.search(part)), len(parts))
    if fixed == len(parts):
        return canonical(text)
    head = os.path.realpath("/".join(parts[:fixed]) or os.sep)
    return "/".join([head.rstrip("/"), *parts[fixed:]])


@dataclass(frozen=True)
class ImportRule:
    """Admits ``module:attribute`` import paths: a glob over each half (see above)."""

    module: str
    attribute: str
    source: str  # where the operator gave it, for messages

    def admits(self, value: str) -> bool:
        module, _, attribute = value.partition(":")
        return fnmatch.fnmatchcase(module, self.module) and fnmatch.fnmatchcase(
            attribute, self.attribute
        )


@dataclass(frozen=True)
class CommandRule:
    """Admits a ``[[command]]``: its program, each argument, its env and cwd (see above)."""

    program: str  # a real path, or a glob whose wildcards stay within one component
    args: tuple[str, ...] = ()
    rest: str | None = None  # each argument past ``args``; None: there may be none
    env: tuple[tuple[str, str], ...] = ()  # (name glob, value glob)
    cwd: tuple[str, ...] = ()  # real paths; empty: the workload may not set one
    source: str = ""

    def program_matches(self, program: str) -> bool:
        return _path_matches(program, self.program)

    def mismatch(self, command: Command, *, program: str) -> str | None:
        """Why this entry does not admit ``command`` (whose program resolved to
        ``program``); None when it does."""
        if not self.program_matches(program):
            return f"its program {program} is not {self.program}"
        given = command.argv[1:]
        if len(given) < len(self.args) or (self.rest is None and len(given) > len(self.args)):
            takes = f"exactly {len(self.args)}" if self.rest is None else f"{len(self.args)}+"
            return f"it has {len(given)} argument(s); {self.source} takes {takes}"
        for i, arg in enumerate(given, start=1):
            want = self.args[i - 1] if i <= len(self.args) else self.rest
            assert want is not None
            if not fnmatch.fnmatchcase(arg, want):
                return f"argument {i} {arg!r} does not match {want!r}"
        for name, value in command.env.items():
            named = [(n, v) for n, v in self.env if n == name]
            if not named and not is_loader_variable(name):
                named = [(n, v) for n, v in self.env if fnmatch.fnmatchcase(name, n)]
            if not named:
                loader = (
                    " (a loader variable: only an entry that names it exactly admits it)"
                    if is_loader_variable(name)
                    else ""
                )
                return f"env {name} is not admitted{loader}"
            if not any(fnmatch.fnmatchcase(value, v) for _, v in named):
                return f"env {name}={value!r} does not match {named[0][1]!r}"
        if command.cwd is not None:
            real = os.path.realpath(os.path.expanduser(command.cwd))
            if real not in self.cwd:
                allowed = ", ".join(self.cwd) if self.cwd else "none: the entry sets no cwd"
                return f"cwd {real} is not admitted ({allowed})"
        return None


@dataclass(frozen=True)
class Refusal:
    """One piece of a workload's code no entry admits, and why (one line)."""

    ref: CodeRef
    why: str


@dataclass(frozen=True)
class Allowlist:
    """The import and command entries a builder's operator gave (see the module docstring)."""

    imports: tuple[ImportRule, ...] = ()
    commands: tuple[CommandRule, ...] = ()

    @property
    def empty(self) -> bool:
        return not self.imports and not self.commands

    @classmethod
    def load(cls, lines: Iterable[str] = (), files: Iterable[Path] = ()) -> Allowlist:
        """``--allow`` lines, then each ``--allow-file``; ValueError names a bad entry."""
        imports: list[ImportRule] = []
        commands: list[CommandRule] = []
        for line in lines:
            _line(line, f"--allow {line!r}", imports, commands)
        for path in files:
            try:
                text = Path(path).read_text("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ValueError(f"--allow-file {path}: cannot read it: {why}") from exc
            if Path(path).suffix == ".toml":
                _toml_file(text, str(path), imports, commands)
                continue
            for number, raw in enumerate(text.splitlines(), start=1):
                line = raw.split("#", 1)[0].strip()
                if line:
                    _line(line, f"{path}:{number}", imports, commands)
        return cls(tuple(imports), tuple(commands))

    def refused(self, workload: Workload) -> tuple[Refusal, ...]:
        """The code of ``workload`` no entry admits (empty: the agent may build it)."""
        out: list[Refusal] = []
        for ref in workload.code:
            why = self._why_not(ref)
            if why is not None:
                out.append(Refusal(ref, why))
        return tuple(out)

    def _why_not(self, ref: CodeRef) -> str | None:
        if ref.form == "import":
            if any(rule.admits(ref.value) for rule in self.imports):
                return None
            return "no import entry matches it"
        command = ref.command
        if command is None:  # a CodeRef made by hand, without its table
            command = Command(argv=tuple(shlex.split(ref.value)))
        cwd = os.path.expanduser(command.cwd) if command.cwd else os.getcwd()
        path = command.env.get("PATH", os.environ.get("PATH"))
        program = program_path(command.argv[0], cwd=cwd, path=path)
        if program is None:
            return f"its program {command.argv[0]!r} is not found on this builder"
        reasons = [rule.mismatch(command, program=program) for rule in self.commands]
        if any(reason is None for reason in reasons):
            return None
        same_program = [
            r
            for rule, r in zip(self.commands, reasons, strict=True)
            if rule.program_matches(program)
        ]
        if same_program:
            return same_program[0]
        return f"no entry admits its program {program}"

    def explain(self, refused: Sequence[Refusal]) -> str:
        """One line saying what was refused, why, and how to admit it."""
        first = refused[0]
        ref = first.ref
        what = "command" if ref.form == "command" else "import path"
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        count = len(self.imports) + len(self.commands)
        how = "none was given" if self.empty else f"{count} entr{'y' if count == 1 else 'ies'}"
        if ref.form == "import":
            hint = f"agent --allow {ref.value!r}"
        elif ref.command is not None and (ref.command.env or ref.command.cwd):
            hint = "a [[command]] entry with its env and cwd in --allow-file (docs/security.md)"
        else:
            hint = f"agent --allow {ref.value!r} or a [[command]] entry in --allow-file"
        return (
            f"refused: {ref.where} {what} {ref.value!r}{more} is not on this builder's"
            f" allowlist ({how}): {first.why}; its operator can admit it with {hint}"
        )


def _line(line: str, where: str, imports: list[ImportRule], commands: list[CommandRule]) -> None:
    """One ``--allow`` line: an import pattern or a command line (module docstring)."""
    text = line.strip()
    if not text:
        raise ValueError(f"{where}: an empty entry admits nothing; leave it out")
    if text == "*":
        raise ValueError(
            f"{where}: '*' no longer admits everything (a command is matched argument by"
            " argument now): admit import paths with '*:*' and each program by its path,"
            " '/opt/venv/bin/* ...' for any program of a folder with any arguments"
        )
    if " " not in text and "/" not in text and ("." in text or ":" in text):
        if not _IMPORT_GLOB.match(text):
            raise ValueError(f"{where}: {text!r} is not an import pattern (module:attribute)")
        module, _, attribute = text.partition(":")
        imports.append(ImportRule(module, attribute or "*", where))
        return
    try:
        words = shlex.split(text)
    except ValueError as exc:
        raise ValueError(f"{where}: cannot split it into words: {exc}") from exc
    rest = None
    if words[-1] == "..." and len(words) > 1:
        words, rest = words[:-1], "*"
    if "..." in words:
        raise ValueError(f"{where}: '...' (any further arguments) may only come last")
    program = _program_pattern(words[0], where=where)
    commands.append(CommandRule(program, tuple(words[1:]), rest, source=where))


def _toml_file(
    text: str, where: str, imports: list[ImportRule], commands: list[CommandRule]
) -> None:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"--allow-file {where}: not valid TOML: {exc}") from exc
    unknown = sorted(set(data) - _FILE_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (allowed: imports, [[command]])")
    listed = data.get("imports", [])
    if not isinstance(listed, list) or not all(isinstance(x, str) for x in listed):
        raise ValueError(f"{where}: imports must be an array of strings")
    for i, pattern in enumerate(listed):
        spot = f"{where}: imports[{i}]"
        if not _IMPORT_GLOB.match(pattern.strip()):
            raise ValueError(f"{spot}: {pattern!r} is not an import pattern (module:attribute)")
        module, _, attribute = pattern.strip().partition(":")
        imports.append(ImportRule(module, attribute or "*", spot))
    tables = data.get("command", [])
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ValueError(f"{where}: command must be an array of tables ([[command]])")
    for i, table in enumerate(tables):
        commands.append(_command_rule(table, f"{where}: command[{i}]"))


def _command_rule(table: Mapping[str, Any], where: str) -> CommandRule:
    unknown = sorted(set(table) - _RULE_KEYS)
    if unknown:
        raise ValueError(
            f"{where}.{unknown[0]}: unknown key (allowed: {', '.join(sorted(_RULE_KEYS))})"
        )
    program = table.get("program")
    if not isinstance(program, str):
        raise ValueError(f"{where}.program: required, a path (or a name on PATH)")
    args = table.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise ValueError(f"{where}.args: must be an array of strings, one glob per argument")
    rest = table.get("rest")
    if rest is not None and not isinstance(rest, str):
        raise ValueError(f"{where}.rest: must be a string, the glob every further argument matches")
    env = table.get("env", {})
    if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
        raise ValueError(f'{where}.env: must be a table of NAME = "value glob"')
    cwd = table.get("cwd", [])
    cwd_list = [cwd] if isinstance(cwd, str) else cwd
    if not isinstance(cwd_list, list) or not all(isinstance(c, str) for c in cwd_list):
        raise ValueError(f"{where}.cwd: must be a path or an array of paths")
    for c in cwd_list:
        if not os.path.isabs(os.path.expanduser(c)):
            raise ValueError(f"{where}.cwd: {c!r} is not an absolute path")
    return CommandRule(
        program=_program_pattern(program, where=f"{where}.program"),
        args=tuple(args),
        rest=rest,
        env=tuple((str(k), v) for k, v in env.items()),
        cwd=tuple(os.path.realpath(os.path.expanduser(c)) for c in cwd_list),
        source=where,
    )


def check_defined(value: str, *, field: str, search_path: Sequence[str] | None = None) -> None:
    """Refuse ``value`` (``module:attr``) unless its module's source defines ``attr``.

    The module is found as an import would find it (``importlib.machinery.PathFinder`` over
    ``search_path``, default ``sys.path``) without executing anything, not even its
    packages' ``__init__``; its source is parsed with ``ast``. ``attr`` must be a top-level
    ``def``, ``async def`` or ``class`` (and ``attr.sub`` a ``def`` or ``class`` in that
    class's body): a name the module imports, or assigns, is not an object it defines.
    WorkloadInvalid names ``field``.
    """
    module, _, attr_path = value.partition(":")
    locations: Sequence[str] | None = list(search_path if search_path is not None else sys.path)
    spec = None
    parts = module.split(".")
    for depth in range(len(parts)):
        name = ".".join(parts[: depth + 1])
        spec = importlib.machinery.PathFinder.find_spec(name, locations)
        if spec is None:
            raise WorkloadInvalid(f"{field}: {value!r}: module {name!r} is not found")
        locations = spec.submodule_search_locations
        if locations is None and depth < len(parts) - 1:
            raise WorkloadInvalid(f"{field}: {value!r}: {name!r} is not a package")
    assert spec is not None
    origin = spec.origin
    if spec.submodule_search_locations is not None and (origin is None or origin == "namespace"):
        raise WorkloadInvalid(f"{field}: {value!r}: {module!r} is a namespace package, no source")
    if origin is None or not origin.endswith(".py"):
        raise WorkloadInvalid(
            f"{field}: {value!r}: the source of {module!r} is not a .py file ({origin}); the"
            " allowlist admits only objects whose definition it can read"
        )
    try:
        tree = ast.parse(Path(origin).read_bytes(), filename=origin)
    except (OSError, SyntaxError, ValueError) as exc:
        raise WorkloadInvalid(f"{field}: {value!r}: cannot read {origin}: {exc}") from exc
    body: list[ast.stmt] = tree.body
    where = module
    for attr in attr_path.split("."):
        found = next(
            (
                node
                for node in body
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and node.name == attr
            ),
            None,
        )
        if found is None:
            raise WorkloadInvalid(
                f"{field}: {value!r}: {attr!r} is not defined in {where} ({origin}) by a def"
                " or class; a builder's allowlist admits only an object the named module"
                " defines (name the module that defines it)"
            )
        body = found.body if isinstance(found, ast.ClassDef) else []
        where = f"{where}.{attr}"
