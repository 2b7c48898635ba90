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
    ("BuildsUnconfined", "builds_unconfined", 500, 2),  # issue 32
]


def test_codes_statuses_and_exit_codes_are_as_they_were() -> None:
    for name, code, status, exit_code in TABLE:
        cls = getattr(errors, name)
        assert (cls.code, cls.http_status, cls.exit_code) == (code, status, exit_code), name
        assert errors.error_for_code(code) is cls, code


def _drawn_tree() -> dict[str, tuple[str | None, bool]]:
    """The tree drawn at the top of errors.py: {class: (parent, marked retryable)}."""
    drawn: dict[str, tuple[str | None, bool]] = {}
    parents: list[str] = []
    for line in (errors.__doc__ or "").splitlines():
        stripped = line.lstrip()
        if stripped[:2] not in ("* ", "x ", "+ ", "- "):
            continue
        depth = (len(line) - len(stripped)) // 2
        name = stripped[2:].split()[0]
        del parents[depth:]
        drawn[name] = (parents[-1] if parents else None, "(retryable)" in stripped)
        parents.append(name)
    return drawn


def test_the_tree_drawn_at_the_top_is_the_real_one() -> None:
    real = {
        cls.__name__: (
            None if cls is errors.CachekeeperError else cls.__bases__[0].__name__,
            cls.retryable,
        )
        for cls in errors.ERRORS.values()
    }
    assert _drawn_tree() == real


def test_every_error_but_the_outcomes_is_in_one_category() -> None:
    categories = (
        errors.TransientError,
        errors.IntegrityError,
        errors.RequestRejected,
        errors.LocalEnvironmentError,
    )
    outcomes = {errors.NoMatchingSnapshot, errors.PrewarmFailed, errors.ColdCompileBroken}
    for cls in errors.ERRORS.values():
        if cls is errors.CachekeeperError or cls in categories or cls in outcomes:
            continue
        assert sum(issubclass(cls, c) for c in categories) == 1, cls.__name__


def test_retryable_is_what_a_second_download_may_cure() -> None:
    """Before the categories, client.pull kept its own list of these (issue 26)."""
    retryable = {cls for cls in errors.ERRORS.values() if cls.retryable}
    assert retryable == {
        errors.TransientError,
        errors.ServerUnavailable,
        errors.ServerError,
        errors.DigestMismatch,
        errors.BlobTooLarge,
        errors.BlobMissing,
    }
    assert errors.ServerUnavailable("x").retryable
    assert not errors.Unauthorized("x").retryable
