"""cachekeeper: never compile cold.

Prewarm torch.compile (Inductor) caches for the real training shapes, prove them
effective, fingerprint them against the toolchain, store them as content-addressed
snapshots, and restore the matching one on every training node before the job starts.

The Python API a training script calls (docs/python-api.md)::

    import os
    import cachekeeper

    report = cachekeeper.prejob(workload="drafter-gqa", server=os.environ["CACHEKEEPER_SERVER"])
    os.environ.update(report.exports)  # before the first torch.compile

and ``cachekeeper.mods`` for the mask_mods and score_mods a workload file names.

This package never imports torch at module level: only prewarm and verify do, inside the
child processes they start. ``prejob`` and ``PrejobReport`` load on first use (PEP 562), so
``import cachekeeper`` stays as light as the hook needs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from cachekeeper._lazy import lazy_getattr
from cachekeeper.errors import CachekeeperError

if TYPE_CHECKING:
    from cachekeeper.client.prejob import PrejobReport, prejob

__version__ = "0.1.0"


def _checkout_root(package_dir: str) -> list[str]:
    """The repository root when this package is imported from a source checkout, else [].

    A checkout keeps ``server/`` and ``client/`` beside this folder; installed (a wheel or
    the editable finder) they are ``cachekeeper.server`` and ``cachekeeper.client``
    (pyproject's package-dir). Python started in the repository root imports this folder
    rather than the installed package, whatever is installed, so the package also searches
    the root there: ``cachekeeper.server`` is then the checkout's ``server/``. (In a checkout,
    other root folders become importable under ``cachekeeper.`` too; nothing imports them.)
    """
    root = os.path.dirname(package_dir)
    if os.path.isdir(os.path.join(package_dir, "server")):
        return []  # installed: the subpackages are here
    beside = all(
        os.path.isfile(os.path.join(root, sub, "__init__.py")) for sub in ("server", "client")
    )
    return [root] if beside else []


__path__.extend(_checkout_root(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["CachekeeperError", "PrejobReport", "prejob", "__version__"]

__getattr__ = lazy_getattr(__name__, {"prejob": "client.prejob", "PrejobReport": "client.prejob"})


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
