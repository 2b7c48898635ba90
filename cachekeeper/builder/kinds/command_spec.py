"""``Command``: what one ``[[command]]`` table says, as data.

The command kind parses it (``cachekeeper.builder.kinds.command``), a ``CodeRef`` carries
it to the allowlist that judges it (``cachekeeper.builder.kinds.base``,
``cachekeeper.builder.allowlist``), and ``cachekeeper.builder.commands`` runs it. It lives
here, importing none of them, so that each of them imports it and none imports another
back for it.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Command"]


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
