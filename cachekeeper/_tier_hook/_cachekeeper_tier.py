"""cachekeeper's remote-cache backend for torch, in the job's own processes (stdlib only).

Loaded by this folder's ``sitecustomize`` when torch imports ``torch._inductor.remote_cache``.
``install`` checks that the module is one this backend was written against (read in torch
2.11 to 2.15): ``RemoteCache.backend_override_cls`` exists, ``RedisRemoteCache.__init__``
reads it (so no redis-py is needed), the FX graph and AOTAutograd caches derive from
``RedisRemoteCache`` (whose keys, ``pt2:<cache id>::<key>:c1``, are the RESP port's too),
and ``RemoteCacheBackend`` has ``_get``/``_put``. Then it sets
``RedisRemoteCache.backend_override_cls`` (never ``RemoteCache``'s: torch 2.13's local
autotune cache derives from it) to ``TierBackend``. Anything else leaves torch as it was
and says why in the process's stats; ``prejob`` already chose by the torch version.

The backend speaks the server's HTTP API (``/v1/tier/...``, docs/api.md) with the token in
the ``Authorization`` header, TLS when the URL is https (the default CAs, ``SSL_CERT_FILE``
/ ``SSL_CERT_DIR``, and ``CACHEKEEPER_CA_BUNDLE``), and follows a GET's 307 to the object
store without the token, checking size and sha256 itself. Its rules, so that a tier can
never break a job:

- every call has one deadline (``CACHEKEEPER_TIER_TIMEOUT_S``, 0.8 s by default, plus the
  time a value's size needs at ``MIN_BYTES_PER_S`` once the size is known), enforced
  between every receive: a server that stalls, trickles or freezes costs that, no more;
  the name is resolved once, in a thread it stops waiting for;
- any failure (refused, reset, timeout, a 5xx, a 401/403, an answer that is not what was
  promised, bytes that are not their digest) is a miss or a dropped put, never an
  exception into torch, and opens the circuit breaker: the process asks nothing more,
  so a dead tier costs a job one deadline, not one per graph;
- a put asks first (``POST /v1/tier/puts``): the bytes go once, to the server or the
  object store, or not at all (a read token's puts are dropped by the server's answer,
  and the process stops putting);
- it counts what it did and writes them at exit, with torch's own cache counters, to
  ``CACHEKEEPER_TIER_STATS_DIR/tier-<pid>.json`` (temp file + rename), which ``postjob``
  reads: ``{"pid", "mode", "installed", "reason", "torch", "breaker", "gets": {"hit",
  "miss", "failed"}, "puts": {"stored", "dropped", "failed"}, "bytes_in", "bytes_out",
  "call_s" (wall seconds spent in the tier's calls),
  "tier_hits": {cache id: n}, "counters": {"fxgraph_cache_hit", ...}, "remote": {...}}``.

``mode="redis"`` (the stock path) installs nothing and records the same stats from torch's
own counters, plus whether ``redis`` could be imported: a job whose Python has no redis-py
gets no tier from torch, and postjob then says so.

The token is read from ``CACHEKEEPER_TIER_TOKEN_FILE`` (a 0600 file prejob wrote): it is
never in a URL or an exported variable's value.
"""

import atexit
import hashlib
import json
import os
import socket
import sys
import threading
import time
from urllib.parse import quote, urlsplit

_URL_VAR = "CACHEKEEPER_TIER_URL"
_TOKEN_FILE_VAR = "CACHEKEEPER_TIER_TOKEN_FILE"
_ENVIRONMENT_VAR = "CACHEKEEPER_TIER_ENVIRONMENT"
_WRITES_VAR = "CACHEKEEPER_TIER_WRITES"
_TIMEOUT_VAR = "CACHEKEEPER_TIER_TIMEOUT_S"
_STATS_VAR = "CACHEKEEPER_TIER_STATS_DIR"
_CA_BUNDLE_VAR = "CACHEKEEPER_CA_BUNDLE"

DEFAULT_TIMEOUT_S = 0.8
MIN_BYTES_PER_S = 50e6  # a value's body may take its size at this rate on top of the deadline
MAX_VALUE_BYTES = 256 << 20
MAX_HEADER_BYTES = 64 << 10
_RECV_BYTES = 1 << 20
_COUNTERS = {
    "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
    "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass"),
}
_CACHES = (  # the remote caches torch makes from RedisRemoteCache (FX and AOTAutograd needed)
    "RemoteFxGraphCache",
    "RemoteAOTAutogradCache",
    "RemoteAutotuneCache",
    "RemoteBundledAutotuneCache",
    "RemoteDynamoPGOCache",
)


class TierError(Exception):
    """One call failed (the breaker opens; torch sees a miss or a dropped put)."""


# -- what this process did ------------------------------------------------------------------


class Stats:
    """Counts of one process; written at exit."""

    def __init__(self, mode):
        self.mode = mode
        self.installed = False
        self.reason = None
        self.breaker = None
        self.gets = {"hit": 0, "miss": 0, "failed": 0}
        self.puts = {"stored": 0, "dropped": 0, "failed": 0}
        self.dropped = {}
        self.bytes_in = 0
        self.bytes_out = 0
        self.call_s = 0.0  # wall seconds this process spent in the tier's calls
        self.tier_hits = {}
        self.pid = os.getpid()
        self.lock = threading.Lock()

    def to_dict(self):
        torch = sys.modules.get("torch")
        return {
            "pid": os.getpid(),
            "mode": self.mode,
            "installed": self.installed,
            "reason": self.reason,
            "torch": getattr(torch, "__version__", None) and str(torch.__version__),
            "breaker": self.breaker,
            "gets": dict(self.gets),
            "puts": dict(self.puts),
            "dropped": dict(self.dropped),
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "call_s": round(self.call_s, 4),
            "tier_hits": dict(self.tier_hits),
            "counters": _torch_counters(),
            "remote": _torch_remote_stats(),
            "redis_importable": _redis_importable() if self.mode == "redis" else None,
        }


def _torch_counters():
    counters = {}
    utils = sys.modules.get("torch._dynamo.utils")
    try:
        raw = utils.counters
        for group, keys in _COUNTERS.items():
            for key in keys:
                counters[key] = int(raw[group].get(key, 0))
    except Exception:
        pass
    return counters


def _torch_remote_stats():
    module = sys.modules.get("torch._inductor.remote_cache")
    try:
        return {k: dict(vars(v)) for k, v in module.cache_stats._stats.items()}
    except Exception:
        return {}


def _redis_importable():
    try:
        import redis  # noqa: F401

        return True
    except Exception:
        return False


_STATS = None


def _write_stats():
    stats = _STATS
    folder = os.environ.get(_STATS_VAR)
    if stats is None or not folder or stats.pid != os.getpid():
        return
    path = os.path.join(folder, f"tier-{os.getpid()}.json")
    temp = path + ".tmp"
    try:
        os.makedirs(folder, exist_ok=True)
        with open(temp, "w") as out:
            json.dump(stats.to_dict(), out)
        os.replace(temp, path)
    except (OSError, TypeError, ValueError):
        pass


# -- HTTP under one deadline ----------------------------------------------------------------


class Deadline:
    def __init__(self, seconds):
        self.at = time.monotonic() + seconds

    def left(self):
        left = self.at - time.monotonic()
        if left <= 0:
            raise TierError("deadline passed")
        return left

    def extend(self, seconds):
        self.at += seconds


_ADDRESSES = {}  # type: dict  # (host, port) -> the first address, resolved once a process
_ADDRESSES_LOCK = threading.Lock()


def _address(host, port, deadline):
    key = (host, port)
    with _ADDRESSES_LOCK:
        if key in _ADDRESSES:
            return _ADDRESSES[key]
    found = []

    def resolve():
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0])
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=resolve, name="cachekeeper-tier-dns", daemon=True)
    thread.start()
    thread.join(deadline.left())
    if not found:
        raise TierError(f"name resolution of {host} timed out")
    if isinstance(found[0], Exception):
        raise TierError(f"cannot resolve {host}: {found[0]}")
    with _ADDRESSES_LOCK:
        _ADDRESSES[key] = found[0]
    return found[0]


_TLS = []  # type: list  # the TLS context, made once


def _tls_context():
    if _TLS:
        return _TLS[0]
    import ssl

    if os.environ.get("SSL_CERT_FILE") or os.environ.get("SSL_CERT_DIR"):
        context = ssl.create_default_context()
    else:
        try:
            import certifi

            context = ssl.create_default_context(cafile=certifi.where())
        except ImportError:
            context = ssl.create_default_context()
    bundle = os.environ.get(_CA_BUNDLE_VAR)
    if bundle:
        context.load_verify_locations(cafile=bundle)
    _TLS.append(context)
    return context


class Connection:
    """One HTTP/1.1 connection; every receive bounded by the caller's deadline."""

    def __init__(self, scheme, host, port, deadline):
        family, kind, proto, _name, address = _address(host, port, deadline)
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left())
            sock.connect(address)
            if scheme == "https":
                sock = _tls_context().wrap_socket(
                    sock, server_hostname=host, do_handshake_on_connect=False
                )
                sock.settimeout(deadline.left())
                sock.do_handshake()
        except Exception:
            sock.close()
            raise
        self.sock = sock
        self.buffer = b""

    def close(self):
        try:
            self.sock.close()
        except OSError:
            pass

    def _recv(self, deadline):
        self.sock.settimeout(deadline.left())
        chunk = self.sock.recv(_RECV_BYTES)
        if not chunk:
            raise TierError("the connection closed mid-answer")
        return chunk

    def request(self, method, target, headers, body, deadline):
        """(status, headers with lower-case names, body, reusable)."""
        lines = [f"{method} {target} HTTP/1.1"]
        lines += ["{}: {}".format(*item) for item in headers.items()]
        lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        self.sock.settimeout(deadline.left())
        self.sock.sendall(head + body if body and len(body) < 65536 else head)
        if body and len(body) >= 65536:
            view = memoryview(body)
            for start in range(0, len(body), _RECV_BYTES):
                self.sock.settimeout(deadline.left())
                self.sock.sendall(view[start : start + _RECV_BYTES])
        while b"\r\n\r\n" not in self.buffer:
            if len(self.buffer) > MAX_HEADER_BYTES:
                raise TierError("an answer's headers are too long")
            self.buffer += self._recv(deadline)
        raw, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        status_line, *header_lines = raw.decode("latin-1").split("\r\n")
        parts = status_line.split(" ", 2)
        if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
            raise TierError(f"not an HTTP answer: {status_line[:40]!r}")
        status = int(parts[1])
        found = {}
        for line in header_lines:
            name, sep, value = line.partition(":")
            if not sep:
                raise TierError("a malformed header line")
            found[name.strip().lower()] = value.strip()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            return status, found, b"", True
        if "chunked" in found.get("transfer-encoding", "").lower():
            return status, found, self._chunked(deadline), False
        length = found.get("content-length")
        if length is None:
            raise TierError("an answer without a length")
        if not length.isdigit() or int(length) > MAX_VALUE_BYTES:
            raise TierError(f"an answer of {length[:20]!r} bytes")
        size = int(length)
        deadline.extend(size / MIN_BYTES_PER_S)
        data = bytearray(self.buffer[:size])
        self.buffer = self.buffer[size:]
        while len(data) < size:
            data += self._recv(deadline)
        if len(data) > size:
            self.buffer = bytes(data[size:])
            del data[size:]
        reusable = found.get("connection", "").lower() != "close"
        return status, found, bytes(data), reusable

    def _chunked(self, deadline):
        data = bytearray()
        while True:
            while b"\r\n" not in self.buffer:
                self.buffer += self._recv(deadline)
            line, _, self.buffer = self.buffer.partition(b"\r\n")
            try:
                size = int(line.split(b";")[0].strip(), 16)
            except ValueError:
                raise TierError("a malformed chunk") from None
            if size == 0:
                return bytes(data)
            if len(data) + size > MAX_VALUE_BYTES:
                raise TierError(f"an answer over {MAX_VALUE_BYTES} bytes")
            while len(self.buffer) < size + 2:
                self.buffer += self._recv(deadline)
            data += self.buffer[:size]
            self.buffer = self.buffer[size + 2 :]


class Client:
    """The tier's server (and its object store) as this process sees them; thread-safe."""

    def __init__(self, *, url, token, environment, writes, timeout_s, stats):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TierError("CACHEKEEPER_TIER_URL is not an http(s) URL")
        self.scheme = parts.scheme
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.prefix = parts.path.rstrip("/")
        self.token = token
        self.environment = environment
        self.writes = writes
        self.timeout_s = timeout_s
        self.stats = stats
        self._idle = {}  # (scheme, host, port) -> [Connection]
        self._lock = threading.Lock()

    # -- plumbing ---------------------------------------------------------------------------
    def _send(self, scheme, host, port, method, target, headers, body, deadline):
        where = (scheme, host, port)
        with self._lock:
            pool = self._idle.setdefault(where, [])
            conn = pool.pop() if pool else None
        reused = conn is not None
        if conn is None:
            conn = Connection(scheme, host, port, deadline)
        try:
            head = {"Host": host if port in (80, 443) else f"{host}:{port}"}
            head.update(headers)
            status, found, data, reusable = conn.request(method, target, head, body, deadline)
        except (OSError, TierError):
            conn.close()
            if not reused:
                raise
            # an idle connection the other end closed: once more, on a new one
            conn = Connection(scheme, host, port, deadline)
            try:
                status, found, data, reusable = conn.request(method, target, head, body, deadline)
            except Exception:
                conn.close()
                raise
        if reusable:
            with self._lock:
                self._idle.setdefault(where, []).append(conn)
        else:
            conn.close()
        return status, found, data

    def _api(self, method, path, deadline, *, body=None, headers=None):
        head = {"User-Agent": "cachekeeper-tier", "Accept": "*/*"}
        if self.token:
            head["Authorization"] = "Bearer " + self.token
        if self.environment:
            head["X-Cachekeeper-Environment"] = self.environment
        head.update(headers or {})
        return self._send(
            self.scheme, self.host, self.port, method, self.prefix + path, head, body, deadline
        )

    def _json(self, path, payload, deadline):
        status, _found, data = self._api(
            "POST",
            path,
            deadline,
            body=json.dumps(payload).encode(),
            headers={"Content-Type": "application/json"},
        )
        _refuse(status, (200, 201))
        try:
            return json.loads(data)
        except ValueError:
            raise TierError("an answer that is not JSON") from None

    def _direct(self, method, url, deadline, *, body=None, headers=None):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise TierError("a redirect that is not an http(s) URL")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        target = (parts.path or "/") + ("?" + parts.query if parts.query else "")
        head = {"User-Agent": "cachekeeper-tier"}
        head.update(headers or {})
        return self._send(parts.scheme, parts.hostname, port, method, target, head, body, deadline)

    # -- the two calls torch makes ----------------------------------------------------------
    def get(self, key):
        deadline = Deadline(self.timeout_s)
        status, found, data = self._api("GET", "/v1/tier/values/" + quote(key, safe=""), deadline)
        if status == 404:
            return None
        if status == 307:
            location = found.get("location", "")
            digest, size = found.get("x-cachekeeper-digest"), found.get("x-cachekeeper-size")
            status, _found, data = self._direct("GET", location, deadline)
            _refuse(status, (200,))
        else:
            _refuse(status, (200,))
            digest, size = found.get("x-cachekeeper-digest"), found.get("x-cachekeeper-size")
        if size is None or not size.isdigit() or len(data) != int(size):
            raise TierError("a value whose size is not the one announced")
        if digest is None or hashlib.sha256(data).hexdigest() != digest:
            raise TierError("a value whose sha256 is not the one announced")
        return data

    def put(self, key, value):
        """ "stored", "dropped:<reason>" (the server's), or raises TierError."""
        deadline = Deadline(self.timeout_s + len(value) / MIN_BYTES_PER_S)
        digest = hashlib.sha256(value).hexdigest()
        # The ask and the commit name the same value.
        claim = {
            "key": key,
            "digest": digest,
            "size_bytes": len(value),
            "environment": self.environment,
        }
        plan = self._json("/v1/tier/puts", claim, deadline)
        action = plan.get("action")
        if action == "send":
            status, _found, data = self._api(
                "PUT",
                "/v1/tier/values/" + quote(key, safe=""),
                deadline,
                body=value,
                headers={
                    "Content-Type": "application/octet-stream",
                    "X-Cachekeeper-Digest": digest,
                },
            )
            _refuse(status, (200, 201))
            try:
                plan = json.loads(data)
            except ValueError:
                raise TierError("an answer that is not JSON") from None
            action = plan.get("action")
        elif action == "upload":
            url = plan.get("url")
            headers = dict(plan.get("headers") or {})
            if not isinstance(url, str):
                raise TierError("an upload without a URL")
            status, _found, _data = self._direct("PUT", url, deadline, body=value, headers=headers)
            _refuse(status, (200, 201, 204))
            plan = self._json("/v1/tier/commits", claim, deadline)
            action = plan.get("action")
        if action == "stored":
            return "stored"
        if action == "dropped":
            return "dropped:{}".format(plan.get("reason"))
        raise TierError(f"an answer to a put that says {action!r}")


def _refuse(status, wanted):
    if status not in wanted:
        raise TierError(f"HTTP {status}")


# -- the backend torch calls ------------------------------------------------------------------

_CLIENT = []  # type: list  # [Client] once configured (one per process)
_CLIENT_LOCK = threading.Lock()


def _client():
    with _CLIENT_LOCK:
        if _CLIENT and _CLIENT[0].stats.pid == os.getpid():
            return _CLIENT[0]
        stats = _STATS
        if stats is not None and stats.pid != os.getpid():  # a forked child: its own counts
            stats = _fresh_stats(stats.mode, installed=stats.installed)
        client = Client(
            url=os.environ.get(_URL_VAR, ""),
            token=_token(),
            environment=os.environ.get(_ENVIRONMENT_VAR, ""),
            writes=os.environ.get(_WRITES_VAR) == "1",
            timeout_s=_timeout_s(),
            stats=stats,
        )
        _CLIENT[:] = [client]
        return client


def _token():
    path = os.environ.get(_TOKEN_FILE_VAR)
    if not path:
        return None
    try:
        with open(path) as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _timeout_s():
    try:
        value = float(os.environ.get(_TIMEOUT_VAR, DEFAULT_TIMEOUT_S))
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return value if 0 < value <= 60 else DEFAULT_TIMEOUT_S


def _cache_id(key):
    return key[4:].split("::", 1)[0] if key.startswith("pt2:") else "?"


def _open_breaker(stats, why):
    with stats.lock:
        if stats.breaker is None:
            stats.breaker = why[:300]


def backend_get(key):
    """The value of ``key`` or None; never raises."""
    started = time.monotonic()
    try:
        return _get(key)
    finally:
        _spent(started)


def backend_put(key, data):
    """Put ``data`` under ``key`` when this process writes; never raises."""
    started = time.monotonic()
    try:
        _put(key, data)
    finally:
        _spent(started)


def _spent(started):
    stats = _STATS
    if stats is not None:
        with stats.lock:
            stats.call_s += time.monotonic() - started


def _get(key):
    stats = _STATS
    if stats is None or stats.breaker is not None:
        if stats is not None:
            with stats.lock:
                stats.gets["miss"] += 1
        return None
    try:
        client = _client()
        stats = client.stats
        if stats.breaker is not None:
            with stats.lock:
                stats.gets["miss"] += 1
            return None
        value = client.get(key)
    except Exception as exc:  # any failure: a miss, and nothing more asked of the tier
        with stats.lock:
            stats.gets["failed"] += 1
        _open_breaker(stats, f"GET: {type(exc).__name__}: {exc}")
        return None
    with stats.lock:
        if value is None:
            stats.gets["miss"] += 1
        else:
            stats.gets["hit"] += 1
            stats.bytes_in += len(value)
            cache = _cache_id(key)
            stats.tier_hits[cache] = stats.tier_hits.get(cache, 0) + 1
    return value


def _put(key, data):
    stats = _STATS
    if stats is None or stats.breaker is not None:
        return
    try:
        client = _client()
        stats = client.stats
        if not client.writes or stats.breaker is not None or not isinstance(data, bytes):
            return
        done = client.put(key, data)
    except Exception as exc:
        with stats.lock:
            stats.puts["failed"] += 1
        _open_breaker(stats, f"PUT: {type(exc).__name__}: {exc}")
        return
    with stats.lock:
        if done == "stored":
            stats.puts["stored"] += 1
            stats.bytes_out += len(data)
        else:
            reason = done.partition(":")[2]
            stats.puts["dropped"] += 1
            stats.dropped[reason] = stats.dropped.get(reason, 0) + 1
            if reason in ("read_only_token", "signatures_required"):
                client.writes = False  # the server will drop every put of this process


def _backend_class(base):
    """``TierBackend``: a subclass of torch's ``RemoteCacheBackend`` (its ``get``/``put``
    keep torch's own counts) whose ``_get``/``_put`` are ours."""

    class TierBackend(base):
        def __init__(self):
            base.__init__(self)

        def _get(self, key):
            return backend_get(key)

        def _put(self, key, data):
            backend_put(key, data)

    TierBackend.__qualname__ = TierBackend.__name__ = "CachekeeperTierBackend"
    return TierBackend


# -- installing ---------------------------------------------------------------------------------


def check(module):
    """Why ``module`` (torch._inductor.remote_cache) is not the one this backend was written
    for, or None."""
    remote = getattr(module, "RemoteCache", None)
    redis_cache = getattr(module, "RedisRemoteCache", None)
    base = getattr(module, "RemoteCacheBackend", None)
    if not isinstance(remote, type) or "backend_override_cls" not in vars(remote):
        return "RemoteCache.backend_override_cls is missing"
    if not isinstance(redis_cache, type) or not issubclass(redis_cache, remote):
        return "RedisRemoteCache is missing or not a RemoteCache"
    init = getattr(redis_cache.__init__, "__code__", None)
    if init is None or "backend_override_cls" not in init.co_names:
        return "RedisRemoteCache.__init__ does not read backend_override_cls"
    if not hasattr(redis_cache, "_get_key"):
        return "RedisRemoteCache._get_key is missing"
    for name in _CACHES[:2]:
        cls = getattr(module, name, None)
        if not isinstance(cls, type) or not issubclass(cls, redis_cache):
            return f"{name} is missing or not a RedisRemoteCache"
    if not isinstance(base, type) or not all(hasattr(base, m) for m in ("get", "put", "_get")):
        return "RemoteCacheBackend is missing or changed"
    return None


def _fresh_stats(mode, *, installed=False):
    global _STATS
    stats = Stats(mode)
    stats.installed = installed
    _STATS = stats
    return stats


def install(module, *, mode):
    """Called once, right after torch imported ``module``."""
    stats = _fresh_stats(mode)
    atexit.register(_write_stats)
    if mode != "cachekeeper":
        stats.reason = "stock redis-py path (watched only)"
        return
    why = check(module)
    if why is not None:
        stats.reason = f"torch's remote cache module differs: {why}; the tier is off"
        return
    try:
        _client()  # a URL that does not parse stops here, before torch relies on us
    except Exception as exc:
        stats.reason = f"not configured: {exc}"
        return
    module.RedisRemoteCache.backend_override_cls = _backend_class(module.RemoteCacheBackend)
    stats.installed = True
