"""cachekeeper's evidence hook: what each Python process of a command did with the caches.

A command workload's prewarm and verify put this folder first on ``PYTHONPATH`` and name a
folder in ``CACHEKEEPER_EVIDENCE_DIR``. Python imports ``sitecustomize`` at start-up, so
every Python process the command starts (torchrun and each of its ranks, compile workers,
anything they spawn with the environment) loads this module, which:

1. registers, before anything else runs, an exit handler, and wraps ``sys.exit`` and
   ``sys.excepthook`` to learn how the process ends;
2. loads the site's own ``sitecustomize``, if there is one further down ``sys.path`` (it
   then runs as it would without us; its errors are reported by ``site`` as usual);
3. imports nothing else: not torch (a process that never imports torch pays nothing), not
   cachekeeper (the command may run another Python than the builder's).

At exit, a process that imported ``torch._dynamo`` writes one JSON file,
``<CACHEKEEPER_EVIDENCE_DIR>/proc-<pid>.json`` (temp file + rename)::

    {"pid", "ppid", "argv", "rank", "local_rank", "world_size", "device",
     "threads", "torch", "counters": {"fxgraph_cache_hit", ...},
     "exit": {"status": "ok" | "exit" | "exception", "code", "error"}}

``rank`` is torch.distributed's rank when it is still initialized, else ``$RANK``;
``device`` is ``cuda:<current device>`` when CUDA was initialized, else ``cpu``. A process
killed by a signal or ended by ``os._exit`` writes nothing: the command's exit status
(torchrun's names the failed rank) says it failed. Stdlib only, and Python 3.8 syntax.
"""

import atexit
import json
import os
import sys

_DIR_VAR = "CACHEKEEPER_EVIDENCE_DIR"
_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
_ending = {"status": "ok", "code": 0, "error": ""}


def _int_env(name):
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _wrap_exit():
    original_exit = sys.exit
    original_hook = sys.excepthook

    def exit(code=0):
        if code is None:
            status = 0
        elif isinstance(code, int):
            status = code
        else:
            status = 1
        _ending.update(status="exit", code=status, error="" if status == 0 else str(code))
        original_exit(code)

    def excepthook(kind, value, tb):
        message = str(value).strip().splitlines()
        _ending.update(
            status="exception",
            code=1,
            error=kind.__name__ + (": " + message[0][:500] if message else ""),
        )
        original_hook(kind, value, tb)

    sys.exit = exit
    sys.excepthook = excepthook


def _record():
    folder = os.environ.get(_DIR_VAR)
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    if not folder or dynamo_utils is None:
        return
    torch = sys.modules.get("torch")
    counters = {}
    try:
        raw = dynamo_utils.counters
        for group, keys in _COUNTERS.items():
            for key in keys:
                counters[key] = int(raw[group].get(key, 0))
    except Exception:  # a torch whose counters look otherwise: record what we have
        pass
    rank = _int_env("RANK")
    device = "cpu"
    threads = None
    version = None
    try:
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank = dist.get_rank()
    except Exception:
        pass
    try:
        if torch is not None:
            version = str(torch.__version__)
            threads = int(torch.get_num_threads())
            if torch.cuda.is_initialized():
                device = f"cuda:{torch.cuda.current_device()}"
    except Exception:
        pass
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "argv": [str(a)[:200] for a in sys.argv[:12]],
        "rank": rank,
        "local_rank": _int_env("LOCAL_RANK"),
        "world_size": _int_env("WORLD_SIZE"),
        "device": device,
        "threads": threads,
        "torch": version,
        "counters": counters,
        "exit": dict(_ending),
    }
    path = os.path.join(folder, f"proc-{os.getpid()}.json")
    temp = path + ".tmp"
    try:
        with open(temp, "w") as out:
            json.dump(record, out)
        os.replace(temp, path)
    except OSError:
        pass


def _chain_site_sitecustomize():
    """Import the ``sitecustomize`` that Python would have found without this folder."""
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.get("sitecustomize")
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    sys.modules.pop("sitecustomize", None)
    try:
        import sitecustomize  # noqa: F401  # the site's own, found further down sys.path
    except ImportError as exc:
        if exc.name != "sitecustomize":
            raise
        if ours is not None:
            sys.modules["sitecustomize"] = ours


if os.environ.get(_DIR_VAR):
    atexit.register(_record)
    _wrap_exit()
_chain_site_sitecustomize()
