"""Which backend a blob store URL names: the one table of URL schemes, and the opener.

Both readers of a ``--blob-store`` URL read this table: the server's settings
(``server/settings.py`` refuses a URL no backend opens, before anything starts) and the
server's composition root (``server/app.py`` opens the snapshots' and the per-key tier's
backends through ``open_backend``). No URL, the default, is the local directory.

A backend's module is imported when a store of its scheme is opened, never before: the
``s3`` one brings boto3, which only the server's extra installs (the base install on
training nodes has none, and a node's local store never opens a URL).

Adding a backend: its module in this folder (``cachekeeper/backends/base.py`` says what it
implements) and its ``Scheme`` in ``SCHEMES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cachekeeper.errors import ConfigInvalid

from .base import BlobBackend
from .local import LocalBackend

__all__ = ["SCHEMES", "Scheme", "names_a_backend", "open_backend", "url_forms"]


@dataclass(frozen=True)
class Scheme:
    """A URL scheme and the backend that opens its URLs."""

    name: str  # what comes before "://"
    form: str  # how its URLs read, for errors: "s3://BUCKET/PREFIX"
    open: Callable[[str], BlobBackend]  # the URL -> the backend, checked reachable


def _open_s3(url: str) -> BlobBackend:
    from .s3 import S3Backend  # boto3 (the server's extra): only once an s3:// store opens

    backend = S3Backend.from_url(url)
    backend.check()  # an unreachable bucket fails at start-up, in one line
    return backend


SCHEMES: dict[str, Scheme] = {
    scheme.name: scheme for scheme in (Scheme("s3", "s3://BUCKET/PREFIX", _open_s3),)
}


def names_a_backend(url: str) -> bool:
    """Whether ``url`` starts with a registered scheme (``s3://...``): the settings' check."""
    return any(url.startswith(f"{name}://") for name in SCHEMES)


def url_forms() -> str:
    """How a blob store URL reads, for errors (``s3://BUCKET/PREFIX``)."""
    return " or ".join(scheme.form for scheme in SCHEMES.values())


def open_backend(url: str | None, *, local_root: Path) -> BlobBackend:
    """The blob backend ``url`` names (``s3://BUCKET/PREFIX``), or, with none, the local
    directory ``local_root`` (its abandoned uploads swept: nothing uploads before start).
    ConfigInvalid, in one line, for a scheme no backend opens or a store not reachable."""
    if url is None:
        local = LocalBackend(local_root)
        local.sweep_temp(older_than_s=0)
        return local
    name = url.partition("://")[0]
    if name not in SCHEMES:
        known = ", ".join(f"{n}://" for n in SCHEMES)
        raise ConfigInvalid(f"blob store {url!r}: no backend for {name}:// (one of: {known})")
    return SCHEMES[name].open(url)
