"""What every CLI command shares: error translation, path and server options, --json output.

Errors: a ``CachekeeperError`` is one line with its code; an ``OSError`` (a path that
cannot be read or written) is one line naming the path and the cause. Set
``CACHEKEEPER_DEBUG=1`` for the traceback instead.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import click

from cachekeeper import config
from cachekeeper.errors import CachekeeperError

__all__ = [
    "PathParam",
    "handle_errors",
    "describe_os_error",
    "emit_json",
    "echo_err",
    "json_option",
    "device_option",
    "server_option",
    "ca_bundle_option",
    "allow_plaintext_option",
    "timeout_option",
    "token_option",
    "mb",
    "open_client",
    "printable",
]

if TYPE_CHECKING:
    from cachekeeper.client.api import CacheClient

F = TypeVar("F", bound=Callable[..., Any])

json_option = click.option(
    "--json", "as_json", is_flag=True, help="Print a JSON report for scripts."
)


class PathParam(click.Path):
    """``click.Path`` that refuses an empty value.

    An empty path would mean the current directory (``Path("")`` is ``.``), so an unset
    variable in ``--cache-dir "$TORCHINDUCTOR_CACHE_DIR"`` would fill the cwd with cache
    folders. Every path option and argument of the CLI uses this type.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, str) and not value.strip():
            self.fail("an empty path is not allowed (is a variable in it unset?)", param, ctx)
        return super().convert(value, param, ctx)


def _server_url(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """The server URL without a trailing ``/`` or ``/v1`` (every route path adds ``/v1``)."""
    if value is None:
        return None
    if not value.strip():
        return None  # an empty CACHEKEEPER_SERVER is no server, as if unset
    # local import: the client package is not needed by commands without --server
    from cachekeeper.client.calls import server_root

    return server_root(value)


def _ca_bundle(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Trust the CAs of ``--ca-bundle`` for every https request of this process: the
    variable is what ``cachekeeper.client.calls.tls_context`` reads (the hook's stdlib
    requests, the HTTP client and the object-store downloads alike)."""
    if value:
        os.environ[config.CA_BUNDLE] = value


_server_url_option = click.option(
    "--server",
    envvar=config.SERVER,
    metavar="URL",
    callback=_server_url,
    help="Cache server URL, e.g. http://cache:8750 or https://cache.example (default:"
    " $CACHEKEEPER_SERVER).",
)
ca_bundle_option = click.option(
    "--ca-bundle",
    envvar=config.CA_BUNDLE,
    # not checked here: a hook must never fail on it (a CA file that cannot be read is a
    # cold start saying so, an operator command's one-line error: client/calls.tls_context)
    type=click.Path(dir_okay=False),
    expose_value=False,
    is_eager=True,
    callback=_ca_bundle,
    metavar="PEM",
    help="Also trust the CAs in this PEM file for an https:// server (a site's own CA;"
    " default: $CACHEKEEPER_CA_BUNDLE; SSL_CERT_FILE replaces the default CAs).",
)


def _allow_plaintext(ctx: click.Context, param: click.Parameter, value: bool) -> None:
    """Allow the token over plain http for every request of this process: the variable is
    what ``cachekeeper.client.calls.plaintext_allowed`` reads (every client path)."""
    if value:
        os.environ[config.ALLOW_PLAINTEXT] = "1"


allow_plaintext_option = click.option(
    "--allow-plaintext",
    is_flag=True,
    expose_value=False,
    is_eager=True,
    callback=_allow_plaintext,
    help="Send the token over plain http:// to a server that is not on loopback (anyone on"
    " the path can read it; default: refused, use https://; also"
    f" ${config.ALLOW_PLAINTEXT}=1).",
)


def server_option(fn: F) -> F:
    """``--server URL`` (``/v1`` and a trailing ``/`` dropped), ``--ca-bundle PEM`` and
    ``--allow-plaintext``."""
    return _server_url_option(ca_bundle_option(allow_plaintext_option(fn)))


OPERATOR_TIMEOUT_S = 10.0
_TIMEOUT_KEY = "cachekeeper.timeout_s"


def _timeout(ctx: click.Context, param: click.Parameter, value: float) -> None:
    ctx.meta[_TIMEOUT_KEY] = value


timeout_option = click.option(
    "--timeout",
    type=click.FloatRange(min=0.1),
    default=OPERATOR_TIMEOUT_S,
    show_default=True,
    expose_value=False,
    callback=_timeout,
    metavar="SECONDS",
    help="Give up on a server that has not answered within this many seconds in all"
    " (retries included).",
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


def open_client(server: str | None, token: str | None) -> CacheClient:
    """A ``CacheClient`` for --server/--token; a usage error when no server is configured.

    Under a command with ``timeout_option``, every call of the client together (retries
    included) ends by ``--timeout`` seconds after it opened.
    """
    if not server:
        raise click.UsageError("no server: pass --server URL or set CACHEKEEPER_SERVER")
    # local import: httpx only for the commands that talk to a server
    from cachekeeper.client.api import CacheClient

    ctx = click.get_current_context(silent=True)
    timeout_s = ctx.find_root().meta.get(_TIMEOUT_KEY) if ctx is not None else None
    if timeout_s is None:
        return CacheClient(base_url=server, token=token)
    return CacheClient(base_url=server, token=token, timeout_s=timeout_s, deadline_s=timeout_s)


def mb(n: int) -> str:
    """A byte count for people: ``12.3 MB``."""
    return f"{n / 1e6:.1f} MB"


_BIDI = frozenset("\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def printable(value: object) -> str:
    """``value`` as text safe for a terminal: control characters (C0, DEL, C1: the escape
    sequences that move the cursor or retitle the window) and bidi overrides shown as
    ``\\xNN`` / ``\\uNNNN``. Every string a manifest or the server supplies goes through
    this before the CLI prints it in a table."""
    text = str(value)
    if text.isprintable() and not _BIDI.intersection(text):
        return text
    out = []
    for c in text:
        code = ord(c)
        if code < 0x20 or 0x7F <= code < 0xA0:
            out.append(f"\\x{code:02x}")
        elif c in _BIDI:
            out.append(f"\\u{code:04x}")
        else:
            out.append(c)
    return "".join(out)


def echo_err(message: str) -> None:
    click.echo(message, err=True)


def emit_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True, default=str))


def describe_os_error(exc: OSError) -> str:
    """``PATH: cause`` for an OSError (both paths for a rename), else its text."""
    cause = exc.strerror or str(exc) or type(exc).__name__
    paths = [os.fsdecode(p) for p in (exc.filename, exc.filename2) if p is not None]
    if not paths:
        return cause
    return f"{' -> '.join(paths)}: {cause}"


def _os_error_code(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0)
    return name.lower() if name else "os_error"


def handle_errors(fn: F) -> F:
    """Turn a known CachekeeperError or an OSError into one line on stderr and exit 1.

    A CachekeeperError exits with its own exit code; an OSError names the path and the
    cause (``error: /srv/x: Permission denied [eacces]``).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CachekeeperError as exc:
            if config.debug(os.environ):
                raise
            echo_err(f"error: {exc.detail} [{exc.code}]")
            sys.exit(exc.exit_code)
        except OSError as exc:
            if config.debug(os.environ):
                raise
            echo_err(f"error: {describe_os_error(exc)} [{_os_error_code(exc)}]")
            sys.exit(1)
        except KeyboardInterrupt:
            echo_err("interrupted")
            sys.exit(130)

    return wrapper  # type: ignore[return-value]
