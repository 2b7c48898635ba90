"""The error table (cachekeeper/errors.py): what every code means on the wire and at the CLI.

Codes, HTTP statuses and exit codes are contracts (servers and scripts of other versions
read them): ``TABLE`` pins each one as it was before issue 26 gave the table categories.
"""

from __future__ import annotations

from cachekeeper import errors

# (class, code, HTTP status, CLI exit code) of every error as of main at 7a8883a.
TABLE = [
    ("CachekeeperError", "error", 500, 1),
    ("InvalidManifest", "invalid_manifest", 422, 1),
    ("UnsafePath", "unsafe_path", 422, 1),
    ("UnsupportedFormat", "unsupported_format", 422, 1),
    ("DigestMismatch", "digest_mismatch", 422, 1),
    ("BlobTooLarge", "blob_too_large", 422, 1),
    ("BlobMissing", "blob_missing", 409, 1),
    ("SnapshotNotFound", "snapshot_not_found", 404, 1),
    ("WorkloadInvalid", "invalid_workload", 422, 2),
    ("WorkloadNotFound", "workload_not_found", 404, 1),
    ("NoMatchingSnapshot", "no_match", 404, 1),
    ("LinkInCacheDir", "link_in_cache_dir", 422, 1),
    ("RestoreConflict", "restore_conflict", 409, 1),
    ("CacheDirUnusable", "cache_dir_unusable", 500, 1),
    ("Unauthorized", "unauthorized", 401, 1),
    ("Forbidden", "forbidden", 403, 1),
    ("PayloadTooLarge", "payload_too_large", 413, 1),
    ("InsufficientStorage", "insufficient_storage", 507, 1),
    ("SignatureInvalid", "signature_invalid", 422, 1),
    ("ServerUnavailable", "server_unavailable", 503, 1),
    ("ServerError", "server_error", 500, 1),
    ("PrewarmFailed", "prewarm_failed", 500, 2),
    ("ColdCompileBroken", "cold_compile_broken", 422, 3),
    ("InvalidRequest", "invalid_request", 422, 1),
    ("BadRequest", "bad_request", 400, 1),
    ("NotFound", "not_found", 404, 1),
    ("AgentNotFound", "agent_not_found", 404, 1),
    ("MethodNotAllowed", "method_not_allowed", 405, 1),
    ("UnsupportedEncoding", "unsupported_encoding", 415, 1),
    ("UnsupportedMediaType", "unsupported_media_type", 415, 1),
    ("RangeNotSatisfiable", "range_not_satisfiable", 416, 1),
    ("RequestTimeout", "request_timeout", 408, 1),
    ("ConfigInvalid", "invalid_config", 500, 2),
    ("FingerprintUnavailable", "fingerprint_unavailable", 500, 1),
]


def test_codes_statuses_and_exit_codes_are_as_they_were() -> None:
    for name, code, status, exit_code in TABLE:
        cls = getattr(errors, name)
        assert (cls.code, cls.http_status, cls.exit_code) == (code, status, exit_code), name
        assert errors.error_for_code(code) is cls, code
