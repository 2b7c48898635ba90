"""What every CLI command shares: error translation and --json output."""

from __future__ import annotations

import functools
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import click

from cachekeeper import config
from cachekeeper.errors import CachekeeperError

__all__ = [
    "handle_errors",
    "emit_json",
    "echo_err",
    "json_option",
    "device_option",
    "server_option",
    "token_option",
    "mb",
]

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON report for scripts."
)

server_option = click.option(
    "--server",
    envvar=config.SERVER,
    metavar="URL",
    help="Cache server URL (default: $CACHEKEEPER_SERVER).",
)
token_option = click.option(
    "--token",
    envvar=config.TOKEN,
    metavar="TOKEN",
    help="Bearer token (default: $CACHEKEEPER_TOKEN).",
)

device_option = click.option(
    "--device",
    "device",
    default=None,
    help="cpu, cuda (every visible GPU), cuda:0,1,... or cuda:0-7 "
    "[default: cuda when a GPU is visible, else cpu]",
)


def mb(n: int) -> str:
    """A byte count for people: ``12.3 MB``."""
    return f"{n / 1e6:.1f} MB"


def echo_err(message: str) -> None:
    click.echo(message, err=True)


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


def handle_errors(fn: F) -> F:
    """Turn a known CachekeeperError into one line on stderr and its exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CachekeeperError as exc:
            if config.debug(os.environ):
                raise
            echo_err(f"error: {exc.detail} [{exc.code}]")
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            echo_err("interrupted")
            sys.exit(130)

    return wrapper  # type: ignore[return-value]
