"""One error table for the library, the CLI, the server and the client.

Each exception class carries a stable ``code`` (what the server answers as
``{"error": code, "detail": message}`` and what the client maps back to the class),
the HTTP status the server answers with, the exit code the CLI exits with, and whether
the same operation, tried again, may succeed (``retryable``). Callers catch a category,
as httpx's exception tree lets them catch a transport or a timeout error:

* CachekeeperError
  x TransientError (retryable)     the server or the way to it is briefly unwell
    + ServerUnavailable (retryable)
    + ServerError (retryable)
  x IntegrityError                 bytes or records that fail their checks
    + DigestMismatch (retryable)
      - BlobTooLarge (retryable)
    + BlobMissing (retryable)
    + InvalidManifest
      - UnsafePath
      - UnsupportedFormat
    + SignatureInvalid
  x RequestRejected                refused as asked: the same request gets the same answer
    + BadRequest
    + InvalidRequest
      - InvalidDigest
    + Unauthorized
    + Forbidden
    + NotFound
      - AgentNotFound
    + SnapshotNotFound
    + WorkloadNotFound
    + WorkloadInvalid
    + MethodNotAllowed
    + UnsupportedEncoding
    + UnsupportedMediaType
    + RangeNotSatisfiable
    + PayloadTooLarge
    + RequestTimeout
    + InsufficientStorage
    + RateLimited
  x LocalEnvironmentError          this machine: its dirs, settings, devices, drivers
    + CacheDirUnusable
    + LinkInCacheDir
    + CacheDirChanged
    + EmptyCacheDir
    + RestoreConflict
    + ConfigInvalid
    + PlaintextRefused
    + DeviceInvalid
    + FingerprintUnavailable
    + CatalogCorrupt
    + NotOwnBytes
    + BuildsUnconfined
    + CatalogTooNew
  x NoMatchingSnapshot             outcomes a caller acts on, in no category: a miss,
  x PrewarmFailed                  a build that failed, a workload whose cold compile
  x ColdCompileBroken              raises
(``cachekeeper.client.direct.DirectUnavailable``, the object store's refusal after which
the client falls back to the server, is a ``ServerUnavailable``.)

``retryable`` is what a caller that may run an operation again reads (``client.pull``
downloads a snapshot again on one): a transient failure, and bytes that arrived damaged
or incomplete, which a second download may bring whole. Which *requests* the client
sends again is the transport's one rule (``client.calls.Backoff``): a failure on the way
or a 5xx answer. A category's own code is in the table so that every class is; no one
raises a category itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

__all__ = [
    "CachekeeperError",
    "TransientError",
    "IntegrityError",
    "RequestRejected",
    "LocalEnvironmentError",
    "InvalidManifest",
    "UnsafePath",
    "UnsupportedFormat",
    "DigestMismatch",
    "BlobMissing",
    "BlobTooLarge",
    "SnapshotNotFound",
    "WorkloadInvalid",
    "WorkloadNotFound",
    "NoMatchingSnapshot",
    "LinkInCacheDir",
    "CacheDirChanged",
    "EmptyCacheDir",
    "RestoreConflict",
    "CacheDirUnusable",
    "DeviceInvalid",
    "Unauthorized",
    "Forbidden",
    "PayloadTooLarge",
    "InsufficientStorage",
    "SignatureInvalid",
    "ServerUnavailable",
    "ServerError",
    "PrewarmFailed",
    "ColdCompileBroken",
    "InvalidRequest",
    "InvalidDigest",
    "BadRequest",
    "NotFound",
    "AgentNotFound",
    "MethodNotAllowed",
    "UnsupportedEncoding",
    "UnsupportedMediaType",
    "RangeNotSatisfiable",
    "RequestTimeout",
    "ConfigInvalid",
    "PlaintextRefused",
    "FingerprintUnavailable",
    "RateLimited",
    "CatalogCorrupt",
    "NotOwnBytes",
    "BuildsUnconfined",
    "CatalogTooNew",
    "error_for_code",
    "did_you_mean",
    "ERRORS",
]


class CachekeeperError(Exception):
    """Base of every error cachekeeper raises on purpose."""

    code: ClassVar[str] = "error"
    http_status: ClassVar[int] = 500
    exit_code: ClassVar[int] = 1
    retryable: ClassVar[bool] = False  # the same operation, run again, may succeed

    def __init__(self, detail: str, *, extra: dict[str, Any] | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.extra: dict[str, Any] = dict(extra or {})

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"error": self.code, "detail": self.detail}
        body.update(self.extra)
        return body


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """The ``(did you mean 'x'?)`` of an error about an unknown name, or ``""``."""
    import difflib  # only when a name is unknown: the hook imports this module

    close = difflib.get_close_matches(name, sorted(set(choices)), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


class TransientError(CachekeeperError):
    """The server, or the way to it, is briefly unwell: the same call may succeed soon."""

    code = "transient"
    http_status = 503
    retryable = True


class IntegrityError(CachekeeperError):
    """Bytes or records that fail their checks: a digest, a size, a manifest, a signature."""

    code = "integrity"
    http_status = 422


class RequestRejected(CachekeeperError):
    """A request refused as asked (by the server, or by this library for the same reason):
    sent again unchanged, it gets the same answer."""

    code = "request_rejected"
    http_status = 400


class LocalEnvironmentError(CachekeeperError):
    """This machine is in the way: a cache dir, a setting, a device, a hung driver."""

    code = "local_environment"


class InvalidManifest(IntegrityError):
    """A manifest that is malformed: bad JSON, bad fields, bad digests, duplicate paths."""

    code = "invalid_manifest"
    http_status = 422


class UnsafePath(InvalidManifest):
    """A manifest or archive path that is absolute, contains '..', or is a link or device."""

    code = "unsafe_path"


class UnsupportedFormat(InvalidManifest):
    """A snapshot format version this build does not read."""

    code = "unsupported_format"


class DigestMismatch(IntegrityError):
    """Bytes whose sha256 is not the one they were declared with."""

    code = "digest_mismatch"
    http_status = 422
    retryable = True  # damaged on the way: a second download may bring the bytes whole


class BlobMissing(IntegrityError):
    """A blob a manifest references is not available."""

    code = "blob_missing"
    http_status = 409
    retryable = True  # a stream cut short, or a blob the store has again by the next try


class BlobTooLarge(DigestMismatch):
    """A blob longer than its declared size (a decompression bomb is one of these)."""

    code = "blob_too_large"


class SnapshotNotFound(RequestRejected):
    """No snapshot with that id."""

    code = "snapshot_not_found"
    http_status = 404


class WorkloadInvalid(RequestRejected):
    """A workload file that does not parse or validate."""

    code = "invalid_workload"
    http_status = 422
    exit_code = 2


class WorkloadNotFound(RequestRejected):
    """No workload registered under that name."""

    code = "workload_not_found"
    http_status = 404


class NoMatchingSnapshot(CachekeeperError):
    """No snapshot is compatible with this node's fingerprint for that workload."""

    code = "no_match"
    http_status = 404


class LinkInCacheDir(LocalEnvironmentError):
    """A symbolic link inside a cache dir being snapshotted."""

    code = "link_in_cache_dir"
    http_status = 422


class CacheDirChanged(LocalEnvironmentError):
    """A file of a cache dir that changed between the scan and the read (rewritten,
    replaced or gone): nothing of it is used."""

    code = "cache_dir_changed"
    http_status = 409


class EmptyCacheDir(LocalEnvironmentError):
    """A cache dir with no file a snapshot takes, given to push (``--allow-empty`` to
    publish it anyway): most often the wrong dir."""

    code = "empty_cache_dir"
    http_status = 422


class RestoreConflict(LocalEnvironmentError):
    """A different file already exists where a restore would write (it is kept)."""

    code = "restore_conflict"
    http_status = 409


class CacheDirUnusable(LocalEnvironmentError):
    """A cache dir a restore cannot write: its disk is full or read-only, a name is too
    long for its filesystem, or cachekeeper's ``.cachekeeper`` folder there is a file or
    a link."""

    code = "cache_dir_unusable"
    http_status = 500  # a node's own trouble; the server never answers it


class DeviceInvalid(LocalEnvironmentError):
    """A ``--device`` that does not parse, or names GPUs this machine does not see."""

    code = "invalid_device"
    exit_code = 2  # a usage error, as when it was a PrewarmFailed


class Unauthorized(RequestRejected):
    """No valid bearer token."""

    code = "unauthorized"
    http_status = 401


class Forbidden(RequestRejected):
    """The token lacks the scope this route needs."""

    code = "forbidden"
    http_status = 403


class PayloadTooLarge(RequestRejected):
    """A request over one of the server's limits (blob size, manifest size, file count)."""

    code = "payload_too_large"
    http_status = 413


class InsufficientStorage(RequestRejected):
    """The store is full (hard cap reached, or the disk itself)."""

    code = "insufficient_storage"
    http_status = 507


class SignatureInvalid(IntegrityError):
    """A snapshot that is unsigned, signed by an untrusted key, or tampered with."""

    code = "signature_invalid"
    http_status = 422


class ServerUnavailable(TransientError):
    """The cache server could not be reached in time."""

    code = "server_unavailable"
    http_status = 503


class ServerError(TransientError):
    """The server answered with an error the client does not know."""

    code = "server_error"
    http_status = 500


class PrewarmFailed(CachekeeperError):
    """A prewarm or verify child process failed for a reason other than the compile itself."""

    code = "prewarm_failed"
    http_status = 500
    exit_code = 2


class ColdCompileBroken(CachekeeperError):
    """A cold compile of the workload raised: exactly what a warm cache would have hidden."""

    code = "cold_compile_broken"
    http_status = 422
    exit_code = 3


class InvalidRequest(RequestRejected):
    """A request body or parameter that does not validate (the server's 422)."""

    code = "invalid_request"
    http_status = 422


class BadRequest(RequestRejected):
    """A request the server cannot read at all."""

    code = "bad_request"
    http_status = 400


class NotFound(RequestRejected):
    """No such route or resource."""

    code = "not_found"
    http_status = 404


class AgentNotFound(NotFound):
    """No agent registered under that id (register it first)."""

    code = "agent_not_found"


class MethodNotAllowed(RequestRejected):
    """The route exists but not for that HTTP method."""

    code = "method_not_allowed"
    http_status = 405


class UnsupportedEncoding(RequestRejected):
    """A Content-Encoding the server does not accept (identity or zstd only)."""

    code = "unsupported_encoding"
    http_status = 415


class UnsupportedMediaType(RequestRejected):
    """A Content-Type the route does not accept."""

    code = "unsupported_media_type"
    http_status = 415


class RangeNotSatisfiable(RequestRejected):
    """A Range header outside the blob."""

    code = "range_not_satisfiable"
    http_status = 416


class RequestTimeout(RequestRejected):
    """A request body that stopped arriving (no bytes for the server's body timeout)."""

    code = "request_timeout"
    http_status = 408


class ConfigInvalid(LocalEnvironmentError):
    """A server setting that is wrong or unsafe: named with its value and where it came from."""

    code = "invalid_config"
    exit_code = 2


class PlaintextRefused(LocalEnvironmentError):
    """A bearer token (or a URL's password) that would travel over plain ``http://`` to a
    host that is not loopback: use ``https://``, or ``--allow-plaintext`` to accept it."""

    code = "plaintext_refused"
    http_status = 400
    exit_code = 2  # a usage error: the command line (or its variables) must change


class FingerprintUnavailable(LocalEnvironmentError):
    """This machine's fingerprint could not be collected in time (a hung NVML or nvidia-smi)."""

    code = "fingerprint_unavailable"


class NotOwnBytes(LocalEnvironmentError):
    """A signature asked for bytes this machine did not compile: a cache dir holding what a
    restore put there (a signature vouches that the signer compiled what it signs)."""

    code = "not_own_bytes"


class BuildsUnconfined(LocalEnvironmentError):
    """A signing agent that cannot keep its key from the code its builds run (no Landlock on
    this host, or a key file with another hard link): refused at start unless told."""

    code = "builds_unconfined"
    exit_code = 2


class InvalidDigest(InvalidRequest):
    """A digest or snapshot id that is not 64 lowercase hex characters: a malformed name,
    not bytes that hash to another digest (that is ``DigestMismatch``)."""

    code = "invalid_digest"


class RateLimited(RequestRejected):
    """A caller past its budget for this window (a token's job reports): the same request
    is refused until the window moves on (``retry_after_s``)."""

    code = "rate_limited"
    http_status = 429


class CatalogCorrupt(LocalEnvironmentError):
    """The server's metadata database (``meta.sqlite``) failed SQLite's integrity check or
    a query met a malformed page: the server will not answer from it (restore a backup)."""

    code = "catalog_corrupt"
    http_status = 503


class CatalogTooNew(LocalEnvironmentError):
    """The server's catalog (``meta.sqlite``) is at a schema version a newer cachekeeper
    wrote: this one will not serve it (run that version, or restore a backup)."""

    code = "catalog_too_new"


def _all_subclasses(cls: type[CachekeeperError]) -> list[type[CachekeeperError]]:
    out: list[type[CachekeeperError]] = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_all_subclasses(sub))
    return out


_CLASSES: list[type[CachekeeperError]] = [CachekeeperError, *_all_subclasses(CachekeeperError)]
ERRORS: dict[str, type[CachekeeperError]] = {cls.code: cls for cls in _CLASSES}


def error_for_code(code: str) -> type[CachekeeperError]:
    """The exception class for a server's ``error`` code (``ServerError`` when unknown)."""
    return ERRORS.get(code, ServerError)
