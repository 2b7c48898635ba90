"""The ``cachekeeper`` command line: a thin adapter over the library.

Each command parses its options, makes one library call, and prints the result (a table
for people, ``--json`` for scripts). Commands live in modules of this package and are
imported only when invoked, so ``cachekeeper prejob`` does not pay for ``serve``'s FastAPI.
Known errors become one line on stderr and the error's exit code; set
``CACHEKEEPER_DEBUG=1`` for the traceback.

What a command acts on comes first, then the verb, as in ``hf cache ls``: ``local ls``,
``snapshots rm``, ``cache prune``, ``workload register`` (docs/cli.md says why). The
spellings before issue 33 (``ls``, ``rm``, ``gc``, ``gc --server``) are ``ALIASES`` for one
release: they run as before and name their new spelling in one line on stderr.
"""

from __future__ import annotations

import copy
import functools
import importlib
import sys
from typing import Any

import click

__all__ = ["main", "cli", "ALIASES", "COMMANDS"]

# command name -> "module:attribute" (a click.Command). Short help is kept here so that
# `cachekeeper --help` lists every command without importing any of them.
COMMANDS: dict[str, tuple[str, str]] = {
    "fingerprint": (
        "cachekeeper.cli.fingerprint:fingerprint_cmd",
        "Print this machine's environment fingerprint.",
    ),
    "explain": (
        "cachekeeper.cli.fingerprint:explain_cmd",
        "Explain field by field why this node can or cannot use a snapshot.",
    ),
    "snapshot": (
        "cachekeeper.cli.local_snapshot:snapshot_cmd",
        "Snapshot a cache dir into the local store and a one-file archive.",
    ),
    "restore": (
        "cachekeeper.cli.local_snapshot:restore_cmd",
        "Restore a snapshot (archive file or id) into a cache dir, safely.",
    ),
    "inspect": (
        "cachekeeper.cli.local_snapshot:inspect_cmd",
        "Show a snapshot archive's manifest summary.",
    ),
    "local": (
        "cachekeeper.cli.local:local_cmd",
        "List, remove and garbage-collect the local store's snapshots.",
    ),
    "ls": ("cachekeeper.cli.local:ls_cmd", "Old spelling of 'local ls' (until the next release)."),
    "rm": ("cachekeeper.cli.local:rm_cmd", "Old spelling of 'local rm' (until the next release)."),
    "gc": (
        "cachekeeper.cli.local:gc_cmd",
        "Old spelling of 'local gc' and 'snapshots gc' (until the next release).",
    ),
    "workload": (
        "cachekeeper.cli.workload:workload_cmd",
        "Register, list and remove the server's workloads.",
    ),
    "snapshots": (
        "cachekeeper.cli.server_snapshots:snapshots_cmd",
        "List, pin, unpin and remove the server's snapshots; run the server's GC.",
    ),
    "prewarm": (
        "cachekeeper.cli.prewarm:prewarm_cmd",
        "Cold-compile a workload per device in fresh processes, merge, verify.",
    ),
    "verify": (
        "cachekeeper.cli.verify:verify_cmd",
        "Prove a cache dir is effective for a workload (zero misses).",
    ),
    "serve": ("cachekeeper.cli.serve:serve_cmd", "Run the cache server (FastAPI under uvicorn)."),
    "push": (
        "cachekeeper.cli.transfer:push_cmd",
        "Snapshot a cache dir and upload it to the server.",
    ),
    "pull": (
        "cachekeeper.cli.transfer:pull_cmd",
        "Fetch and restore the snapshot matching this node.",
    ),
    "prejob": (
        "cachekeeper.cli.transfer:prejob_cmd",
        "Pre-job hook: restore the matching cache, print the env to export.",
    ),
    "postjob": (
        "cachekeeper.cli.postjob:postjob_cmd",
        "Post-job hook: count what the job compiled on top of the restore, report it.",
    ),
    "agent": (
        "cachekeeper.cli.agent:agent_cmd",
        "Builder daemon: keep every registered workload warm on this node.",
    ),
    "status": (
        "cachekeeper.cli.status:status_cmd",
        "Show which workloads are warm for which environments and devices.",
    ),
    "cache": (
        "cachekeeper.cli.cache:cache_cmd",
        "See and prune this node's per-environment cache dirs.",
    ),
    "keygen": (
        "cachekeeper.cli.keys:keygen_cmd",
        "Create an Ed25519 key pair for signing snapshots.",
    ),
}

# An old spelling -> its new one; "NAME --server" when that option picks another noun. Each
# runs the command it always ran (``COMMANDS``), with one line on stderr (never on stdout,
# where --json goes) naming the new spelling. They go in the release after the one that
# brought the nouns (issue 33; docs/cli.md).
ALIASES: dict[str, str] = {
    "ls": "local ls",
    "rm": "local rm",
    "gc": "local gc",
    "gc --server": "snapshots gc",
}


def _old_spelling(command: click.Command, name: str) -> click.Command:
    """``command`` run as the old spelling ``name``: the same options and output, and first
    one stderr line naming the new spelling."""
    callback = command.callback
    assert callback is not None

    @functools.wraps(callback)
    def run(*args: Any, **kwargs: Any) -> Any:
        used = f"{name} --server" if kwargs.get("server") is not None else name
        new = ALIASES.get(used, ALIASES[name])
        click.echo(
            f"cachekeeper: '{used}' is now 'cachekeeper {new}'; the old spelling goes in the"
            " next release",
            err=True,
        )
        return callback(*args, **kwargs)

    aliased = copy.copy(command)
    aliased.callback = run
    also = [
        f"with {k.split(' ', 1)[1]}: 'cachekeeper {v}'"
        for k, v in ALIASES.items()
        if k.startswith(f"{name} ")
    ]
    spelled = f"'cachekeeper {ALIASES[name]}'" + (f" ({'; '.join(also)})" if also else "")
    aliased.help = f"Old spelling of {spelled}, until the next release.\n\n{command.help or ''}"
    return aliased


class LazyGroup(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        entry = COMMANDS.get(cmd_name)
        if entry is None:
            return None
        module_name, _, attr = entry[0].partition(":")
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name == module_name:
                return _unavailable(cmd_name, entry[1])
            raise
        command = getattr(module, attr, None)
        if command is None:
            return _unavailable(cmd_name, entry[1])
        return _old_spelling(command, cmd_name) if cmd_name in ALIASES else command

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, COMMANDS[name][1]) for name in self.list_commands(ctx)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


def _unavailable(name: str, summary: str) -> click.Command:
    @click.command(name=name, help=f"{summary} (not available in this build)")
    def _cmd() -> None:
        raise click.ClickException(f"'{name}' is not available in this build")

    return _cmd


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="cachekeeper", prog_name="cachekeeper")
def cli() -> None:
    """cachekeeper: never compile cold.

    Prewarm torch.compile caches for real training shapes, prove them effective,
    fingerprint and store them, and restore the matching one on every node.
    Server and token: --server/--token or CACHEKEEPER_SERVER/CACHEKEEPER_TOKEN.
    """


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="cachekeeper", standalone_mode=True)


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
