"""cachekeeper's tier hook: load cachekeeper's own remote-cache backend into a job's Python.

``prejob`` puts this folder first on ``PYTHONPATH`` (and names the tier in
``CACHEKEEPER_TIER_*`` variables) when a job uses the per-key tier. Python imports
``sitecustomize`` at start-up, so every Python process of the job (torchrun and each rank,
compile workers, anything they start with the environment) loads this module, which:

1. loads the site's own ``sitecustomize``, if there is one further down ``sys.path`` (it
   then runs as it would without us);
2. adds one finder to ``sys.meta_path`` that waits for ``torch._inductor.remote_cache``
   (the module of torch's remote caches); it imports nothing else, neither torch nor
   cachekeeper, so a process that never compiles pays a few microseconds;
3. when torch imports that module, and only then, loads ``_cachekeeper_tier.py`` (beside
   this file, stdlib only, by its path: this folder leaves ``sys.path`` at start-up), which checks the module is the one it was written for and
   sets ``RedisRemoteCache.backend_override_cls`` to its backend (or, for the stock
   redis-py path, only watches). See ``_cachekeeper_tier.py``.

Stdlib only and Python 3.8 syntax: the job may run another Python than cachekeeper's.
"""

import os
import sys

_MODE_VAR = "CACHEKEEPER_TIER_MODE"  # "cachekeeper" (our backend) or "redis" (watch only)
_TARGET = "torch._inductor.remote_cache"
_HERE = os.path.dirname(os.path.abspath(__file__))


class _Loader:
    """The real loader of torch's module, then ``_cachekeeper_tier.install`` on it."""

    def __init__(self, loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        try:
            _backend_module().install(module, mode=os.environ.get(_MODE_VAR, ""))
        except Exception:  # the hook must never break torch's import
            pass

    def __getattr__(self, name):
        return getattr(self._loader, name)


def _backend_module():
    """``_cachekeeper_tier`` from beside this file (loaded now, by path: sys.path unchanged)."""
    import importlib.util

    name = "_cachekeeper_tier"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, os.path.join(_HERE, name + ".py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class _Finder:
    """Finds nothing itself: wraps the loader of torch's remote-cache module, once."""

    def find_spec(self, name, path=None, target=None):
        if name != _TARGET:
            return None
        try:
            sys.meta_path.remove(self)
        except ValueError:
            pass
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def _chain_site_sitecustomize():
    """Import the ``sitecustomize`` that Python would have found without this folder."""
    ours = sys.modules.get("sitecustomize")
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  # the site's own, found further down sys.path
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


if os.environ.get(_MODE_VAR) and _TARGET not in sys.modules:
    sys.meta_path.insert(0, _Finder())
_chain_site_sitecustomize()
