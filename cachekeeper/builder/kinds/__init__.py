"""The workload kinds, registered by table name: one module per table of a workload file.

    attention.py    [[attention]]   a flex_attention regime          (a device kind)
    entrypoint.py   [[entrypoint]]  the training code's warm-up step (a device kind)
    command.py      [[command]]     the site's own launcher          (a process kind)
    command_spec.py ``Command``, a [[command]] table's data (the allowlist and the run read it)
    base.py         what a kind is: ``Kind``, ``DeviceKind``, ``ProcessKind``, ``CodeRef``

The workload parser (``cachekeeper.builder.workload``) reads the tables of every registered
kind, in the order they were registered (the built-in ones above first): that is the order
of parse errors and of a child's steps. Prewarm, verify, the agent, the allowlist and the
server's admin rule go through the protocol and never name a kind, so a new kind is its
module (and its tests), added to ``_BUILT_IN`` below, or registered from elsewhere with
``register`` (a site's own kind; the test suite's toy kind). A kind registered from
elsewhere is known to the process that registered it (the server that judges a workload,
the agent that runs its process kinds); the prewarm child parses the workload again and
knows the built-in kinds only, so a device kind belongs in ``_BUILT_IN``.
"""

from __future__ import annotations

import re

from cachekeeper.builder.kinds import attention, command, entrypoint
from cachekeeper.builder.kinds.base import (
    FILE_KEYS,
    CodeRef,
    DeviceKind,
    Kind,
    ProcessKind,
    Validator,
)

__all__ = [
    "CodeRef",
    "DeviceKind",
    "Kind",
    "ProcessKind",
    "Validator",
    "kind_named",
    "kinds",
    "register",
    "unregister",
]

_BUILT_IN: tuple[Kind, ...] = (attention.KIND, entrypoint.KIND, command.KIND)
_TABLE_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
_KINDS: dict[str, Kind] = {}


def register(kind: Kind) -> Kind:
    """Read ``[[kind.table]]`` tables in every workload parsed from now on, after those of
    the kinds registered before it. ValueError when the table name is taken, is one of the
    file's own keys, or is not a lower-case TOML key; or when ``kind.limits`` does not bound
    its number of tables."""
    name = getattr(kind, "table", "")
    if not isinstance(name, str) or not _TABLE_NAME.match(name):
        raise ValueError(f"a workload kind's table must be a lower-case name, got {name!r}")
    if name in FILE_KEYS:
        raise ValueError(f"[[{name}]]: {name!r} is a key of the workload file itself")
    if name in _KINDS:
        raise ValueError(f"[[{name}]]: a kind is registered for it already ({_KINDS[name]!r})")
    if not isinstance(kind.limits.get(name), int):
        raise ValueError(f"[[{name}]]: its limits must bound its tables (limits[{name!r}])")
    _KINDS[name] = kind
    return kind


def unregister(table: str) -> Kind:
    """Stop reading ``[[table]]`` tables (a workload that has one is refused, as any
    unknown key); returns the kind. KeyError when none is registered."""
    return _KINDS.pop(table)


def kinds() -> tuple[Kind, ...]:
    """The registered kinds, in the order their tables are read."""
    return tuple(_KINDS.values())


def kind_named(table: str) -> Kind:
    """The kind that reads ``[[table]]``; KeyError when none does."""
    return _KINDS[table]


for _kind in _BUILT_IN:
    register(_kind)
