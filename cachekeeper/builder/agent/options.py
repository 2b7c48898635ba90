"""What the agent builds, where, for how long, and with which key (``cachekeeper agent``'s
options), and what an agent process remembers between rounds."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from cachekeeper.builder import landlock
from cachekeeper.builder.allowlist import Allowlist
from cachekeeper.builder.confine import Confinement
from cachekeeper.errors import BuildsUnconfined
from cachekeeper.snapshot.signing import SigningKey

__all__ = [
    "DEFAULT_BUILD_TIMEOUT_S",
    "AgentMemory",
    "AgentOptions",
    "Log",
    "prepare_options",
]

Log = Callable[[str], None]
# A build's default bound (``agent --build-timeout``): a cold compile of a real workload
# takes minutes (torchtitan's flex_attention with max-autotune, the most expensive we
# measured, 69 s per regime), so an hour per child is far past any honest build and ends
# one that a registered workload made endless (100,000 sequence lengths kept an agent busy).
DEFAULT_BUILD_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class AgentOptions:
    """What the agent builds, where, and for how long (``cachekeeper agent``'s options)."""

    devices: tuple[str, ...]
    work_dir: Path
    name: str = field(default_factory=socket.gethostname)
    # Each prewarm or verify child, and each command run, is killed past this (a command's
    # own ``timeout`` wins when shorter); the build is then reported ``failed``, "timeout".
    build_timeout_s: float | None = DEFAULT_BUILD_TIMEOUT_S
    push_workers: int = 4
    heartbeat_s: float = 60.0  # heartbeats while a build runs
    sign_key: Path | SigningKey | None = None  # Ed25519 PREFIX.key: every push is signed
    allow: Allowlist = field(default_factory=Allowlist)  # the code this builder may run
    unconfined: bool = False  # sign even where builds cannot be kept from the key

    @property
    def confinement(self) -> Confinement:
        """What every process of a build is held to: reaped; an import path defined in its
        module; the signing key hidden where this host can (``prepare_options`` refused
        the rest unless ``unconfined``)."""
        hidden: tuple[Path, ...] = ()
        if self.sign_key is not None and landlock.unavailable_reason() is None:
            hidden = (Path(self.sign_key).absolute(),)
        return Confinement(hidden=hidden, defined_imports=True)


def prepare_options(options: AgentOptions, *, log: Log | None = None) -> AgentOptions:
    """Read the signing key into memory (before any build runs), and refuse to sign where
    a build could read it: BuildsUnconfined, unless ``options.unconfined`` (then a warning).

    Idempotent: a key already read is not read again.
    """
    key = options.sign_key
    if key is None:
        return options
    if not isinstance(key, SigningKey):
        key = SigningKey.load(Path(key).absolute())
    problem = landlock.unavailable_reason() or landlock.hidden_file_problem(key.path)
    if problem is not None and not options.allow.empty:
        message = (
            f"--sign-key {key.path}: builds run admitted code, and this builder cannot keep"
            f" the key from it: {problem}"
        )
        if not options.unconfined:
            raise BuildsUnconfined(
                message + "; sign elsewhere, run the agent where Landlock works (Linux >= 5.19),"
                " or pass --unconfined-builds to accept that the code you admit can read it"
            )
        if log is not None:
            log(f"warning: {message} (--unconfined-builds)")
    return replace(options, sign_key=key)


@dataclass
class AgentMemory:
    """What an agent process remembers between rounds: the harvests it judged (the warm
    snapshot's id and its deltas' ids), so that each set costs one build."""

    judged_harvests: set[tuple[str, frozenset[str]]] = field(default_factory=set)
