"""``[[command]]``: the site's own launcher, run as it is (no shell).

    [[command]]
    argv = ["torchrun", "--nproc-per-node", "8", "-m", "mytrainer.train", "--steps", "2"]
    env = { WANDB_MODE = "disabled" }   # added to the builder's environment
    cwd = "/srv/mytrainer"              # default: where prewarm runs
    timeout = "30m"                     # default: the prewarm's bound only

A process kind: each command runs once cold, in an empty staging dir, and once in a fresh
copy of the built cache dir for the verify, with cachekeeper's evidence hook in every Python
process it starts (``cachekeeper.builder.commands``, which runs it: its program, where the
allowlist judged it to be, under a supervisor). The whole table is code a builder runs:
program, arguments, ``env`` and ``cwd`` alike. Whether ``argv[0]`` exists is known only on
the builder, when it runs.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cachekeeper.builder.kinds.base import CodeRef, ProcessKind, Validator, type_name
from cachekeeper.builder.kinds.command_spec import Command
from cachekeeper.units import parse_duration

if TYPE_CHECKING:
    from cachekeeper.builder.confine import Confinement
    from cachekeeper.builder.verdicts import CommandRun, Progress

__all__ = ["KIND", "RESERVED_ENV", "CommandKind"]

_KEYS = frozenset({"argv", "env", "cwd", "timeout"})
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Variables a command's ``env`` may not set, with why: prewarm and verify own them.
RESERVED_ENV = {
    "TORCHINDUCTOR_CACHE_DIR": "prewarm and verify set it to their staging dir",
    "TRITON_CACHE_DIR": "Triton's cache must land in the cache dir (triton/<index>)",
    "CACHEKEEPER_EVIDENCE_DIR": "cachekeeper's per-process evidence goes there",
}


class CommandKind(ProcessKind):
    """``[[command]]`` tables (the module docstring)."""

    table = "command"
    limits = {
        "command": 16,  # [[command]] tables
        "argv": 1024,  # a command's arguments
        "env": 256,  # a command's variables
    }

    def parse(self, v: Validator, raw: dict[str, Any], *, where: str) -> Command:
        return _command(v, raw, where)

    def code(self, spec: Command, *, where: str) -> tuple[CodeRef, ...]:
        return (
            CodeRef("command", shlex.join(spec.argv), f"{where}.argv", spec.argv[0], command=spec),
        )

    def describe(self, spec: Command) -> str:
        return spec.describe()

    def run(
        self,
        spec: Command,
        *,
        index: int,
        mode: str,
        cache_dir: Path,
        work: Path,
        progress: Progress | None,
        timeout_s: float | None,
        confinement: Confinement | None,
    ) -> CommandRun:
        # The server parses workloads with this module: the run machinery (the supervisor,
        # the allowlist's program lookup) loads on a builder only, when a command runs.
        from cachekeeper.builder.commands import run_command

        return run_command(
            spec,
            index=index,
            mode=mode,
            cache_dir=cache_dir,
            work=work,
            progress=progress,
            timeout_s=timeout_s,
            confinement=confinement,
        )


KIND = CommandKind()


def _command(v: Validator, table: dict[str, Any], where: str) -> Command:
    v.unknown_keys(table, _KEYS, where)
    argv = v.required(table, "argv", list, where)
    if not argv:
        v.fail(f"{where}.argv", "must name at least the program to run")
    v.at_most(
        f"{where}.argv", len(argv), CommandKind.limits["argv"], "arguments", per=" per command"
    )
    for i, arg in enumerate(argv):
        v.typed(arg, str, f"{where}.argv[{i}]")
        if "\x00" in arg:
            v.fail(f"{where}.argv[{i}]", "contains a NUL character")
    if not argv[0].strip():
        v.fail(f"{where}.argv[0]", "the program to run is empty")
    env_table = v.typed(table.get("env", {}), dict, f"{where}.env")
    v.at_most(
        f"{where}.env", len(env_table), CommandKind.limits["env"], "variables", per=" per command"
    )
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
            v.fail(key_where, f"expected a string, got {type_name(type(value))}")
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
