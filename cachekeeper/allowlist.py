"""What a builder agrees to run: the agent's allowlist (``agent --allow`` / ``--allow-file``).

A workload registered on the server can make a builder run code: a ``[[command]]``, an
``[[entrypoint]]``, a mask or score factory named by import path (``Workload.code``). The
agent runs only what its own operator admitted, whoever registered the workload::

    cachekeeper agent --allow 'mytrainer.*' --allow 'torchrun *-m mytrainer.train *'
    cachekeeper agent --allow-file /etc/cachekeeper/allow     # one pattern per line, '#' comments

A pattern is a shell-style glob (``fnmatch``, case-sensitive; ``*`` matches any characters,
``:`` and ``/`` included). It admits:

- an import path when it matches the whole ``pkg.mod:attr`` (``mytrainer.*`` admits every
  import path under ``mytrainer``);
- a command when it matches its ``argv[0]`` exactly as written (``torchrun``,
  ``/opt/venv/bin/python``: any arguments then) or its whole command line
  (``shlex.join(argv)``, the form ``cachekeeper status`` shows: only those arguments).

Built-in masks and score mods are not code and need no pattern. With no pattern, the
agent builds only workloads without code. ``*`` admits everything: the agent then trusts
every holder of the server's admin scope with code execution on this builder.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cachekeeper.workload import CodeRef, Workload

__all__ = ["Allowlist"]


@dataclass(frozen=True)
class Allowlist:
    """Glob patterns over import paths and commands (see the module docstring)."""

    patterns: tuple[str, ...] = ()

    @classmethod
    def load(cls, patterns: Iterable[str] = (), files: Iterable[Path] = ()) -> Allowlist:
        """Patterns given one by one, then those of each file; ValueError names a bad one."""
        found = [p.strip() for p in patterns]
        for path in files:
            try:
                text = Path(path).read_text("utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
                raise ValueError(f"--allow-file {path}: cannot read it: {why}") from exc
            for line in text.splitlines():
                line = line.split("#", 1)[0].strip()
                if line:
                    found.append(line)
        for pattern in found:
            if not pattern:
                raise ValueError("--allow: an empty pattern admits nothing; leave it out")
        return cls(tuple(found))

    def admits(self, ref: CodeRef) -> bool:
        targets = [ref.value] if ref.kind == "import" else [ref.argv0, ref.value]
        return any(fnmatch.fnmatchcase(t, p) for p in self.patterns for t in targets)

    def refused(self, workload: Workload) -> tuple[CodeRef, ...]:
        """The code of ``workload`` no pattern admits (empty: the agent may build it)."""
        return tuple(ref for ref in workload.code if not self.admits(ref))

    def explain(self, refused: tuple[CodeRef, ...]) -> str:
        """One line saying what was refused and how to admit it."""
        first = refused[0]
        what = "command" if first.kind == "command" else "import path"
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        how = "none was given" if not self.patterns else f"{len(self.patterns)} pattern(s) given"
        hint = first.argv0 if first.kind == "command" else first.value
        return (
            f"refused: {first.where} {what} {first.value!r}{more} is not on this builder's"
            f" allowlist ({how}); its operator can admit it with agent --allow {hint!r}"
            " or --allow-file"
        )
