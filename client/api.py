"""``CacheClient``: the httpx client for the cache server's HTTP API (docs/api.md).

Every call goes through the one client transport (``client/transport.py``, under the
rules of ``client/calls.py``): a timeout that is the smaller of the client's ``timeout_s``
and what is left of an optional ``Deadline``, so the pre-job hook can promise an overall
bound; connection errors, timeouts and 5xx answers retried by the one ``Backoff`` rule,
never past the deadline; answers read against the deadline and a size cap. The server's
``{"error": code, "detail": ...}`` answers come back as the same exception class
(``cachekeeper.errors.error_for_code``, mapped here and only here); transport failures
become ``ServerUnavailable``; an answer that is not the JSON the contract promises is a
``ServerError``. Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast
from urllib.parse import urlencode

import zstandard

from cachekeeper.errors import (
    CachekeeperError,
    Forbidden,
    NotFound,
    ServerError,
    ServerUnavailable,
    Unauthorized,
    error_for_code,
)
from cachekeeper.snapshot.archive import open_archive_stream
from cachekeeper.snapshot.manifest import Manifest
from cachekeeper.wire import (
    AgentEvent,
    AgentInfo,
    AgentList,
    AgentRegistration,
    EventOut,
    GcAnswer,
    GcRequest,
    Health,
    MissingAnswer,
    NearMiss,
    PublishAnswer,
    PutAnswer,
    RegisterAnswer,
    RemoteCacheOffer,
    ResolveAnswer,
    ResolveRequest,
    SnapshotList,
    StatusAnswer,
    StatusRow,
    Summary,
    WireError,
    WorkloadInfo,
    WorkloadList,
    from_dict,
    to_dict,
)

from .calls import (  # Deadline and server_root: public here since 0.1
    ANSWER_MAX_BYTES,
    MANIFEST_MAX_BYTES,
    RESOLVE_MAX_BYTES,
    Backoff,
    Deadline,
    endpoint,
    redact_url,
    server_root,
)
from .transport import StreamReader, http_client, read_answer, send

if TYPE_CHECKING:
    import httpx

    from cachekeeper.environment.fingerprint import Fingerprint
    from cachekeeper.snapshot.signing import TrustedKey

__all__ = ["CacheClient", "Deadline", "NearMiss", "Resolution", "server_root"]

Resolution = ResolveAnswer  # the client's name for the resolve answer (public since 0.1)
_Shape = TypeVar("_Shape")

# The archive download reads the response in zstandard's recommended input size, as it
# always has (local archive files are read 1 MiB at a time).
_RESPONSE_READ_BYTES = zstandard.DECOMPRESSION_RECOMMENDED_INPUT_SIZE


class CacheClient:
    """A synchronous client for one cache server. Use as a context manager, or ``close()``.

    ``transport`` replaces httpx's network transport (tests pass ``httpx.MockTransport``).
    ``deadline_s`` bounds every call of the client together, retries included.
    A ``token`` for an ``http://`` server that is not loopback raises ``PlaintextRefused``
    unless ``allow_plaintext`` (None: ``--allow-plaintext`` / its setting).
    """

    def __init__(
        self,
        *,
        base_url: str,
        token: str | None = None,
        timeout_s: float = 30.0,
        retries: int = 3,
        backoff_s: float = 0.2,
        transport: httpx.BaseTransport | None = None,
        deadline_s: float | None = None,
        allow_plaintext: bool | None = None,
    ) -> None:
        # One deadline for every call of this client (an operator command's --timeout);
        # a call's own ``deadline`` replaces it.
        self._deadline = Deadline(deadline_s) if deadline_s is not None else None
        if not base_url:
            raise ServerUnavailable("no server configured (use --server or CACHEKEEPER_SERVER)")
        root = server_root(base_url)
        self._root = root
        self.base_url = redact_url(root)  # what messages show: never a password in the URL
        self._has_token = bool(token)
        self.timeout_s = timeout_s
        self.backoff = Backoff(retries=retries, base_s=backoff_s)
        # A token for a plain-http server that is not loopback is PlaintextRefused here
        # (calls.refuse_plaintext; allow_plaintext None: --allow-plaintext's setting).
        self._http = http_client(
            base_url=root,
            token=token,
            timeout_s=timeout_s,
            transport=transport,
            allow_plaintext=allow_plaintext,
        )

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the routes ---------------------------------------------------------------------
    def health(self, *, deadline: Deadline | None = None) -> Health:
        return _answer(self._send("GET", "/healthz", deadline=deadline), Health, "health")

    def metrics(self, *, deadline: Deadline | None = None) -> str:
        return str(self._send("GET", "/metrics", deadline=deadline).text)

    def resolve(
        self,
        fingerprint: Fingerprint,
        *,
        workload: str,
        driver_policy: str = "newer",
        devices: list[str] | None = None,
        deadline: Deadline | None = None,
        trusted_keys: Sequence[TrustedKey] | None = None,
    ) -> Resolution:
        """The best snapshot of ``workload`` for ``fingerprint`` (a miss is a value).

        With ``trusted_keys`` (non-empty), the server ranks only snapshots whose signature
        it checked against one of them (an old server ignores them: whoever restores checks
        the signature again in any case)."""
        body = ResolveRequest(
            fingerprint=dict(fingerprint),
            workload=workload,
            driver_policy=cast(Any, driver_policy),  # the server refuses an unknown policy
            devices=None if devices is None else list(devices),
            trusted_keys=[k.wire for k in trusted_keys] if trusted_keys else None,
        )
        response = self._send(
            "POST",
            "/v1/resolve",
            json_body=to_dict(body),
            deadline=deadline,
            max_answer_bytes=RESOLVE_MAX_BYTES,
        )
        return _answer(response, ResolveAnswer, "resolve")

    def missing_blobs(
        self, digests: list[str] | set[str], *, deadline: Deadline | None = None
    ) -> set[str]:
        """Which of ``digests`` the server does not hold."""
        return set(self.missing(digests, deadline=deadline).missing)

    def missing(
        self, digests: list[str] | set[str], *, deadline: Deadline | None = None
    ) -> MissingAnswer:
        """``blobs/missing`` whole: the missing digests, and presigned PUTs when it has them."""
        body = {"digests": sorted(digests)}
        response = self._send("POST", "/v1/blobs/missing", json_body=body, deadline=deadline)
        return _answer(response, MissingAnswer, "blobs/missing")

    def put_blob_zstd(
        self,
        digest: str,
        open_frame: Callable[[], BinaryIO],
        *,
        deadline: Deadline | None = None,
    ) -> PutAnswer:
        """Upload one blob as its stored zstd frame (``open_frame`` reopens it per attempt)."""
        response = self._send(
            "PUT",
            f"/v1/blobs/{digest}",
            open_body=open_frame,
            headers={"Content-Encoding": "zstd", "Content-Type": "application/octet-stream"},
            deadline=deadline,
        )
        return _answer(response, PutAnswer, "blob upload")

    def publish(
        self,
        manifest: Manifest,
        *,
        deadline: Deadline | None = None,
        timeout_s: float | None = None,
    ) -> PublishAnswer:
        """Publish a manifest whose blobs are all uploaded; answers its summary + ``created``.

        ``timeout_s`` replaces the client's per-request timeout for this call: a server
        whose blobs are in an object store reads every blob back and packs the archive
        before it answers (``cachekeeper.client.push.publish_timeout_s`` scales it).
        """
        response = self._send(
            "POST",
            "/v1/snapshots",
            json_body=manifest.to_dict(),
            deadline=deadline,
            timeout_s=timeout_s,
        )
        return _answer(response, PublishAnswer, "publish")

    def get_manifest(self, snapshot_id: str, *, deadline: Deadline | None = None) -> Manifest:
        """The manifest of ``snapshot_id``, validated, and checked to have that id."""
        response = self._send(
            "GET",
            f"/v1/snapshots/{snapshot_id}",
            deadline=deadline,
            max_answer_bytes=MANIFEST_MAX_BYTES,
        )
        answer = _json_object(response, "manifest")
        manifest = Manifest.from_dict(answer)
        if manifest.id != snapshot_id:
            raise ServerError(f"server sent a manifest with id {manifest.id} for {snapshot_id}")
        return manifest

    @contextlib.contextmanager
    def open_archive(
        self,
        snapshot_id: str,
        digests: set[str] | list[str],
        *,
        deadline: Deadline | None = None,
    ) -> Iterator[BinaryIO]:
        """The snapshot's archive holding only ``digests``, as an uncompressed tar stream.

        The stream is read as it arrives (nothing is buffered whole). A connection that
        breaks or stalls mid-stream raises ``ServerUnavailable`` from ``read``.
        """
        response = self._send(
            "POST",
            f"/v1/snapshots/{snapshot_id}/archive",
            json_body={"digests": sorted(digests)},
            stream=True,
            deadline=deadline,
        )
        ahead: BinaryIO | None = None
        try:
            raw = cast(BinaryIO, StreamReader(response, deadline))
            # Download and decompress in a thread, ahead of the hashing and writing.
            ahead = open_archive_stream(raw, read_bytes=_RESPONSE_READ_BYTES)
            yield ahead
        finally:
            if ahead is not None:
                ahead.close()
            response.close()

    # -- operator routes (the CLI's workload / snapshots / gc --server commands) ----------
    def list_snapshots(
        self,
        *,
        workload: str | None = None,
        fingerprint_digest: str | None = None,
        verified: bool | None = None,
        deadline: Deadline | None = None,
    ) -> tuple[Summary, ...]:
        """Snapshots on the server, newest first, filtered by what is given."""
        query = {
            key: value
            for key, value in (
                ("workload", workload),
                ("fingerprint_digest", fingerprint_digest),
                ("verified", None if verified is None else str(verified).lower()),
            )
            if value is not None
        }
        path = f"/v1/snapshots?{urlencode(query)}" if query else "/v1/snapshots"
        response = self._send("GET", path, deadline=deadline)
        return _answer(response, SnapshotList, "snapshots").snapshots

    def set_pinned(
        self, snapshot_id: str, *, pinned: bool, deadline: Deadline | None = None
    ) -> Summary:
        """Pin (keep out of LRU eviction) or unpin a snapshot; answers its summary."""
        method = "POST" if pinned else "DELETE"
        response = self._send(method, f"/v1/snapshots/{snapshot_id}/pin", deadline=deadline)
        return _answer(response, Summary, "pin")

    def delete_snapshot(self, snapshot_id: str, *, deadline: Deadline | None = None) -> None:
        """Remove a snapshot from the server (admin scope); its blobs go at the next GC."""
        self._send("DELETE", f"/v1/snapshots/{snapshot_id}", deadline=deadline).close()

    def gc(self, *, dry_run: bool = False, deadline: Deadline | None = None) -> GcAnswer:
        """Server GC (admin scope): evict LRU unpinned snapshots to the cap, drop unused blobs."""
        body = to_dict(GcRequest(dry_run=dry_run))
        response = self._send("POST", "/v1/gc", json_body=body, deadline=deadline)
        return _answer(response, GcAnswer, "gc")

    def register_workload(
        self, name: str, toml_text: str, *, deadline: Deadline | None = None
    ) -> WorkloadInfo:
        """Register or replace workload ``name`` (write scope); the server validates it."""
        response = self._send(
            "PUT",
            f"/v1/workloads/{name}",
            open_body=lambda: io.BytesIO(toml_text.encode("utf-8")),
            headers={"Content-Type": "application/toml"},
            deadline=deadline,
        )
        return _answer(response, WorkloadInfo, "workload registration")

    def delete_workload(self, name: str, *, deadline: Deadline | None = None) -> None:
        """Unregister workload ``name`` (admin scope); its snapshots stay."""
        self._send("DELETE", f"/v1/workloads/{name}", deadline=deadline).close()

    # -- workloads and agents (the agent daemon's routes) -------------------------------
    def list_workloads(self, *, deadline: Deadline | None = None) -> tuple[WorkloadInfo, ...]:
        """Every registered workload (name, digest, updated_at)."""
        response = self._send("GET", "/v1/workloads", deadline=deadline)
        return _answer(response, WorkloadList, "workloads").workloads

    def remote_cache(self, *, deadline: Deadline | None = None) -> RemoteCacheOffer | None:
        """The per-key tier as the server offers it to this token; None when it serves
        none (older servers too)."""
        try:
            response = self._send("GET", "/v1/remote-cache", deadline=deadline)
        except NotFound:
            return None
        return _answer(response, RemoteCacheOffer, "remote-cache")

    def get_workload(self, name: str, *, deadline: Deadline | None = None) -> str:
        """The TOML text of workload ``name`` as registered."""
        return str(self._send("GET", f"/v1/workloads/{name}", deadline=deadline).text)

    def register_agent(
        self,
        *,
        name: str,
        fingerprint: Fingerprint,
        fingerprint_digest: str,
        devices: list[str],
        gpus: list[dict[str, Any]],
        version: str,
        deadline: Deadline | None = None,
    ) -> RegisterAnswer:
        """Register (or refresh) this agent for its environment; the answer has its ``id``."""
        body = AgentRegistration(
            name=name,
            fingerprint=dict(fingerprint),
            fingerprint_digest=fingerprint_digest,
            devices=list(devices),
            gpus=list(gpus),
            version=version,
        )
        response = self._send("POST", "/v1/agents", json_body=to_dict(body), deadline=deadline)
        return _answer(response, RegisterAnswer, "agent registration")

    def heartbeat(self, agent_id: str, *, deadline: Deadline | None = None) -> AgentInfo:
        """Tell the server agent ``agent_id`` is alive."""
        response = self._send("POST", f"/v1/agents/{agent_id}/heartbeat", deadline=deadline)
        return _answer(response, AgentInfo, "heartbeat")

    def report_event(
        self,
        agent_id: str,
        *,
        workload: str,
        fingerprint_digest: str,
        status: str,
        detail: str = "",
        traceback_tail: list[str] | tuple[str, ...] = (),
        snapshot_id: str | None = None,
        seconds: float | None = None,
        deadline: Deadline | None = None,
    ) -> EventOut:
        """Report one build outcome (``built``, ``skipped``, ``building``, ...) of an agent."""
        body = AgentEvent(
            workload=workload,
            fingerprint_digest=fingerprint_digest,
            status=cast(Any, status),  # the server refuses an unknown status
            detail=detail,
            traceback_tail=list(traceback_tail),
            snapshot_id=snapshot_id,
            seconds=seconds,
        )
        response = self._send(
            "POST", f"/v1/agents/{agent_id}/events", json_body=to_dict(body), deadline=deadline
        )
        return _answer(response, EventOut, "agent event")

    def list_agents(self, *, deadline: Deadline | None = None) -> tuple[AgentInfo, ...]:
        """Every registered agent with its last heartbeat (``last_seen_at``)."""
        response = self._send("GET", "/v1/agents", deadline=deadline)
        return _answer(response, AgentList, "agents").agents

    def fleet_status(
        self,
        *,
        workload: str | None = None,
        devices: list[str] | None = None,
        deadline: Deadline | None = None,
    ) -> tuple[StatusRow, ...]:
        """``GET /v1/status``: warm / building / broken / failed / missing per pair.

        ``devices`` (the training nodes' devices): rows then say which their snapshot lacks.
        """
        query = {"workload": workload, "devices": ",".join(devices) if devices else None}
        params = urlencode({k: v for k, v in query.items() if v is not None})
        path = f"/v1/status?{params}" if params else "/v1/status"
        response = self._send("GET", path, deadline=deadline)
        return _answer(response, StatusAnswer, "status").status

    # -- transport ----------------------------------------------------------------------
    def _send(
        self,
        method: str,
        path: str,
        *,
        json_body: Any = None,
        open_body: Callable[[], BinaryIO] | None = None,
        headers: dict[str, str] | None = None,
        stream: bool = False,
        deadline: Deadline | None = None,
        timeout_s: float | None = None,
        max_answer_bytes: int = ANSWER_MAX_BYTES,
    ) -> httpx.Response:
        """One request (``transport.send``); returns a 2xx response or raises a
        CachekeeperError.

        Each try waits ``timeout_s`` (default: the client's) at most, bounded by
        ``deadline``. Unless ``stream``, the answer is read here, checked against the
        deadline as it arrives (a server trickling a byte a second cannot hold a call past
        it) and refused past ``max_answer_bytes`` (a ServerError: memory stays bounded)."""
        deadline = deadline or self._deadline or Deadline(None)
        shown = endpoint(self.base_url, path)  # what messages show: no password
        what = f"{method} {shown}"

        def read(response: httpx.Response) -> httpx.Response:
            if stream and response.is_success:
                return response  # the caller streams it
            return read_answer(response, limit=max_answer_bytes, deadline=deadline, what=what)

        response = send(
            self._http,
            method,
            endpoint(self._root, path),  # the real URL (a password in it included)
            what=what,
            read=read,
            deadline=deadline,
            backoff=self.backoff,
            timeout_s=self.timeout_s if timeout_s is None else timeout_s,
            json_body=json_body,
            open_body=open_body,
            headers=headers,
        )
        if response.is_success:
            return response
        raise _error_from(response, method=method, url=shown, sent_token=self._has_token)


_TOKEN_SOURCE = "--token or CACHEKEEPER_TOKEN"


def _auth_detail(
    cls: type[CachekeeperError],
    extra: dict[str, Any],
    *,
    method: str,
    url: str,
    sent_token: bool,
) -> str:
    """A 401/403 said the client's way: the URL, the scope it needs, where a token comes from."""
    scope = extra.get("scope")
    needs = f"a token with the {scope!r} scope" if isinstance(scope, str) else "another token"
    if cls is Forbidden:
        granted = extra.get("granted")
        has = f" has the {granted!r} scope" if isinstance(granted, str) else " lacks that scope"
        return f"{method} {url} needs {needs}; the token given ({_TOKEN_SOURCE}){has}"
    if not sent_token:
        return f"{method} {url} needs {needs}, and none was given (pass {_TOKEN_SOURCE})"
    return (
        f"{method} {url} needs {needs}; the server does not know the token given ({_TOKEN_SOURCE})"
    )


def _error_from(
    response: httpx.Response, *, method: str, url: str, sent_token: bool = False
) -> CachekeeperError:
    """The exception for a non-2xx answer: the server's error class, or ServerError.

    The detail names the URL; a refused token also says which scope the route needs and
    where a token comes from.
    """
    status = response.status_code
    try:
        body = response.json()
    except (ValueError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), str):
        detail = body.get("detail")
        extra = {k: v for k, v in body.items() if k not in ("error", "detail")}
        cls = error_for_code(body["error"])
        if issubclass(cls, Forbidden) and detail and not detail.startswith("this route needs"):
            text = f"{method} {url}: {detail}"  # a refusal for a reason beyond the route's scope
        elif issubclass(cls, Unauthorized | Forbidden):
            text = _auth_detail(cls, extra, method=method, url=url, sent_token=sent_token)
        elif detail:
            text = f"{detail} ({method} {url})"
        else:
            text = f"{method} {url}: HTTP {status}"
        return cls(text, extra=extra)
    snippet = response.text[:120].strip().replace("\n", " ")
    return ServerError(f"{method} {url} answered HTTP {status}: {snippet!r}")


def _json_object(response: httpx.Response, what: str) -> dict[str, Any]:
    try:
        value = json.loads(response.content)
    except (ValueError, UnicodeDecodeError) as exc:
        snippet = response.content[:80]
        raise ServerError(f"server's {what} answer is not JSON: {snippet!r}") from exc
    if not isinstance(value, dict):
        raise ServerError(f"server's {what} answer is not a JSON object")
    return value


def _answer(response: httpx.Response, shape: type[_Shape], what: str) -> _Shape:
    """The answer as ``shape``; ServerError when it is not the JSON the contract promises."""
    try:
        return from_dict(shape, _json_object(response, what))
    except WireError as exc:
        raise ServerError(f"server's {what} answer is malformed: {exc}") from exc
