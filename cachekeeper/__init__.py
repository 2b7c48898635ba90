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
import sys
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from typing import TYPE_CHECKING

from cachekeeper._lazy import lazy_getattr
from cachekeeper.errors import CachekeeperError

if TYPE_CHECKING:
    from cachekeeper.client.prejob import PrejobReport, prejob

__version__ = "0.1.0"

_BESIDE = ("server", "client")  # the root folders that are subpackages of this one


def _checkout_root(package_dir: str) -> str | None:
    """The repository root when this package is imported from a source checkout, else None.

    A checkout keeps ``server/`` and ``client/`` beside this folder; installed (a wheel or
    the editable finder) they are ``cachekeeper.server`` and ``cachekeeper.client``
    (pyproject's package-dir). Python started in the repository root imports this folder
    rather than the installed package, whatever is installed, so in a checkout
    ``_CheckoutFinder`` finds those two there.
    """
    root = os.path.dirname(package_dir)
    if os.path.isdir(os.path.join(package_dir, "server")):
        return None  # installed: the subpackages are here
    beside = all(os.path.isfile(os.path.join(root, sub, "__init__.py")) for sub in _BESIDE)
    return root if beside else None


class _CheckoutFinder:
    """Finds ``cachekeeper.server`` and ``cachekeeper.client`` in a checkout's root, and
    nothing else: the root's other folders (``tests``, ``bench``, ``docs``) never import as
    ``cachekeeper.tests``, as they did while the whole root was on this package's path.
    Their submodules load the usual way, from the ``__path__`` their spec gives them.
    """

    def __init__(self, root: str) -> None:
        self.checkout_root = root

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> ModuleSpec | None:
        package, _, sub = fullname.rpartition(".")
        if package != __name__ or sub not in _BESIDE:
            return None
        folder = os.path.join(self.checkout_root, sub)
        init = os.path.join(folder, "__init__.py")
        return spec_from_file_location(fullname, init, submodule_search_locations=[folder])


def _find_beside(root: str | None) -> None:
    """Put a ``_CheckoutFinder`` first on ``sys.meta_path`` (once per root): it answers before
    an editable install's finder, which may map another checkout."""
    if root is not None and not any(
        getattr(f, "checkout_root", None) == root for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _CheckoutFinder(root))


_find_beside(_checkout_root(os.path.dirname(os.path.abspath(__file__))))

__all__ = ["CachekeeperError", "PrejobReport", "prejob", "__version__"]

__getattr__ = lazy_getattr(__name__, {"prejob": "client.prejob", "PrejobReport": "client.prejob"})


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
