"""cachekeeper's evidence hook: what each Python process of a command did with the caches.

A command workload's prewarm and verify put this folder first on ``PYTHONPATH`` and name a
folder in ``CACHEKEEPER_EVIDENCE_DIR``. Python imports ``sitecustomize`` at start-up, so
every Python process the command starts (torchrun and each of its ranks, compile workers,
anything they spawn with the environment) loads this module, which:

1. puts a finder first on ``sys.meta_path`` that watches for ``torch._dynamo`` being
   imported (it finds nothing itself), registers an exit handler, wraps ``sys.exit``,
   ``sys.excepthook`` and ``os._exit`` to learn how the process ends;
2. loads the site's own ``sitecustomize``, if there is one further down ``sys.path`` (it
   then runs as it would without us; its errors are reported by ``site`` as usual);
3. imports nothing else: not torch (a process that never imports torch pays nothing), not
   cachekeeper (the command may run another Python than the builder's).

A process that imports ``torch._dynamo`` writes, at that moment, a start record
``<CACHEKEEPER_EVIDENCE_DIR>/start-<pid>.json`` (``{"pid", "ppid", "argv"}``), and at exit
(normal, ``sys.exit``, an exception, or ``os._exit``) its end record ``proc-<pid>.json``
(temp file + rename)::

    {"pid", "ppid", "argv", "rank", "local_rank", "world_size", "device",
     "threads", "torch", "counters": {"fxgraph_cache_hit", ...},
     "exit": {"status": "ok" | "exit" | "exception" | "os_exit", "code", "error"}}

The judge (``cachekeeper.builder.commands.read_evidence``) requires an end record for every start
record: a process that imported torch and was killed, or ended below Python, left a start
without an end, and a verify with one is not verified. A forked child (a DataLoader or
compile worker) belongs to its parent's record: it is disarmed at fork and writes nothing,
unless it imports ``torch._dynamo`` itself. None of this is proof against a process that
sets out to lie (it can write what it likes here): the judge's ground truth is the cache
dir, seen from outside (docs/workloads.md).

``rank`` is torch.distributed's rank when it is still initialized, else ``$RANK``;
``device`` is ``cuda:<current device>`` when CUDA was initialized, else ``cpu``. Stdlib only,
and Python 3.8 syntax.
"""

import atexit
import json
import os
import sys

_DIR_VAR = "CACHEKEEPER_EVIDENCE_DIR"
_WATCHED = "torch._dynamo"
_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
_ending = {"status": "ok", "code": 0, "error": ""}
_state = {"armed_pid": None, "written": False}


def _int_env(name):
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def _write(name, record):
    folder = os.environ.get(_DIR_VAR)
    if not folder:
        return
    path = os.path.join(folder, name)
    temp = path + ".tmp"
    try:
        with open(temp, "w") as out:
            json.dump(record, out)
        os.replace(temp, path)
    except OSError:
        pass


def _arm():
    if _state["armed_pid"] == os.getpid():
        return
    _state["armed_pid"] = os.getpid()
    _state["written"] = False
    _write(
        f"start-{os.getpid()}.json",
        {
            "pid": os.getpid(),
            "ppid": os.getppid(),
            "argv": [str(a)[:200] for a in sys.argv[:12]],
        },
    )


class _DynamoWatch:
    """A meta path finder that finds nothing: it only notes that torch._dynamo is coming."""

    @staticmethod
    def find_spec(name, path=None, target=None):
        if name == _WATCHED and _WATCHED not in sys.modules:
            _arm()
        return None

    @staticmethod
    def invalidate_caches():
        pass


def _disarm_in_child():
    _state["armed_pid"] = None
    _state["written"] = False


def _wrap_exit():
    original_exit = sys.exit
    original_hook = sys.excepthook
    original_os_exit = os._exit

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

    def os_exit(code):
        try:
            _ending.update(status="os_exit", code=int(code), error="")
            _record()
        except Exception:
            pass
        original_os_exit(code)

    sys.exit = exit
    sys.excepthook = excepthook
    os._exit = os_exit


def _record():
    if _state["armed_pid"] != os.getpid() or _state["written"]:
        return
    _state["written"] = True
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    torch = sys.modules.get("torch")
    counters = {}
    try:
        raw = dynamo_utils.counters
        for group, keys in _COUNTERS.items():
            for key in keys:
                counters[key] = int(raw[group].get(key, 0))
    except Exception:  # no counters (dynamo failed to import), or a torch whose look otherwise
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
    _write(
        f"proc-{os.getpid()}.json",
        {
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
        },
    )


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
    sys.meta_path.insert(0, _DynamoWatch())
    atexit.register(_record)
    _wrap_exit()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_disarm_in_child)
    if _WATCHED in sys.modules:  # imported before us (a site's .pth): armed from the start
        _arm()
_chain_site_sitecustomize()
