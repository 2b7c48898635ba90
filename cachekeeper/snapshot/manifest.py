"""The snapshot manifest: what a snapshot holds, and the one place its validity is decided.

A manifest is JSON::

    {
      "format": 1,
      "workload": "drafter-gqa" | null,
      "workload_digest": "<sha256 of the workload TOML>" | null,
      "fingerprint": {...},                  # a Fingerprint (cachekeeper.environment.fingerprint)
      "fingerprint_digest": "<sha256>",      # of the fingerprint's whole JSON (a checksum)
      "devices": ["cuda:0", "cuda:1"] | ["cpu"],
      "files": [{"path": "fxgraph/ab/..", "digest": "<sha256>", "size_bytes": 123, "mode": 420}],
      "stats": {...} | null,                 # prewarm / verify statistics (verified when
                                             # stats["verify"]["effective"] is true)
      "signature": {"key_id": "...", "signature": "<base64>"} | null,
      "source": "harvest",                   # only on a harvested delta (absent otherwise)
      "parent": "<snapshot id>"              # only on a harvested delta: the snapshot it
    }                                        # was compiled on top of

``source`` and ``parent`` appear only when set, so manifests without them (every snapshot
before harvesting existed) keep their ids and stay valid. A harvested delta
(``cachekeeper postjob --push``) holds only what one job compiled on top of ``parent``; it
is never verified (``verified`` is False whatever its stats say) and resolve never picks it
as a node's snapshot: a server with ``--serve-harvested`` offers it after its parent.

A snapshot's id is the sha256 of the canonical JSON of the manifest *without* its
signature, so signing a manifest does not change its id, and the signature covers the id.
Files are sorted by path; blobs are content-addressed by ``digest``.

The ``fingerprint_digest`` key is ``fingerprint.json_digest``: the sha256 of the
fingerprint's whole JSON, as every manifest since format 1 has it and every reader checks
it. ``Manifest.fingerprint_digest`` is the environment's identity (``fingerprint.digest_of``,
without provenance such as ``cpu.threads_from``), which the server files the snapshot
under. The two differ for a fingerprint with provenance; keeping the key's meaning keeps
every snapshot id, and lets an older cachekeeper read a newer manifest (docs/snapshots.md).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field, replace
from pathlib import PurePosixPath
from typing import Any

from cachekeeper import wire
from cachekeeper.environment.fingerprint import (
    Fingerprint,
    canonical_json,
    digest_of,
    json_digest,
    parse,
)
from cachekeeper.errors import InvalidManifest, UnsafePath, UnsupportedFormat
from cachekeeper.integrity import is_digest

__all__ = [
    "FORMAT",
    "MAX_FILES",
    "MAX_NAME_BYTES",
    "STATE_DIR",
    "FileEntry",
    "Manifest",
    "built_by",
    "check_relpath",
    "claims_verified",
]

FORMAT = 1
SOURCES = ("harvest",)  # the values ``source`` may take (absent: a built snapshot)
MAX_FILES = 200_000
MAX_NAME_BYTES = 255  # NAME_MAX of ext4, xfs, btrfs, tmpfs, ...
# cachekeeper's own folder in a cache dir (cachekeeper.restore.marker draws it): no snapshot path
# may be inside it, or a restore would write our lock, staging or markers.
STATE_DIR = ".cachekeeper"


def built_by(stats: Any) -> str | None:
    """``"command"`` when a prewarm ran a ``[[command]]`` (its launcher set its processes'
    thread count), ``"workload"`` when it ran only prewarm's own children (the workload's
    ``[process] omp_num_threads``), None when nothing says (a dir pushed without a prewarm)."""
    prewarm = stats.get("prewarm") if isinstance(stats, dict) else None
    if not isinstance(prewarm, dict):
        return None
    return "command" if prewarm.get("commands") else "workload"


def check_relpath(path: object) -> str:
    """Return ``path`` if it is a safe relative POSIX path, else raise ``UnsafePath``.

    Refused: non-strings, empty, absolute, backslashes, ``.``/``..`` components, empty
    components (``a//b``), NUL or control characters, names that are not valid UTF-8,
    and components over ``MAX_NAME_BYTES`` (255) bytes in UTF-8. (A manifest also refuses
    paths inside ``STATE_DIR``: ``Manifest`` checks its whole tree.)
    """
    if not isinstance(path, str) or not path:
        raise UnsafePath(f"manifest path {path!r} is not a non-empty string")
    if "\\" in path or any(ord(c) < 32 for c in path):
        raise UnsafePath(f"manifest path {path!r} contains a backslash or control character")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise UnsafePath(f"manifest path {path!r} is not valid UTF-8") from exc
    if path.startswith("/"):
        raise UnsafePath(f"manifest path {path!r} is absolute")
    parts = path.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafePath(f"manifest path {path!r} contains '..', '.' or an empty component")
    if any(len(p) > MAX_NAME_BYTES // 4 and len(p.encode()) > MAX_NAME_BYTES for p in parts):
        raise UnsafePath(
            f"manifest path {path!r} has a component longer than {MAX_NAME_BYTES} bytes, "
            "which no common filesystem can hold"
        )
    return str(PurePosixPath(path))


@dataclass(frozen=True)
class FileEntry:
    """One regular file of a snapshot."""

    path: str
    digest: str
    size_bytes: int
    mode: int = 0o644

    def to_dict(self) -> dict[str, Any]:
        return wire.to_dict(self)

    @classmethod
    def from_dict(cls, raw: Any, *, index: int) -> FileEntry:
        if not isinstance(raw, dict):
            raise InvalidManifest(f"files[{index}] is not an object")
        path = check_relpath(raw.get("path"))
        digest = raw.get("digest")
        if not is_digest(digest):
            raise InvalidManifest(f"files[{index}] ({path}): digest {digest!r} is not sha256 hex")
        size = raw.get("size_bytes")
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise InvalidManifest(f"files[{index}] ({path}): size_bytes {size!r} is invalid")
        mode = raw.get("mode", 0o644)
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
            raise InvalidManifest(f"files[{index}] ({path}): mode {mode!r} is not 0..0o777")
        return cls(path=path, digest=str(digest), size_bytes=size, mode=mode)


@dataclass(frozen=True)
class Manifest:
    """A validated snapshot manifest (see the module docstring for the JSON form)."""

    files: tuple[FileEntry, ...]
    fingerprint: Fingerprint
    devices: tuple[str, ...] = ()
    workload: str | None = None
    workload_digest: str | None = None
    stats: dict[str, Any] | None = None
    signature: dict[str, Any] | None = None
    format: int = FORMAT
    source: str | None = None  # "harvest" for a harvested delta
    parent: str | None = None  # a harvested delta's parent snapshot id
    # The environment's identity (fingerprint.digest_of), never the JSON key's checksum.
    fingerprint_digest: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "fingerprint_digest", digest_of(self.fingerprint))
        files = tuple(sorted(self.files, key=lambda f: f.path))
        object.__setattr__(self, "files", files)
        _check_tree(files)

    # -- identity -----------------------------------------------------------------------
    def unsigned_dict(self) -> dict[str, Any]:
        body = {
            "format": self.format,
            "workload": self.workload,
            "workload_digest": self.workload_digest,
            "fingerprint": self.fingerprint,
            "fingerprint_digest": json_digest(self.fingerprint),  # the key's meaning since format 1
            "devices": list(self.devices),
            "files": [f.to_dict() for f in self.files],
            "stats": self.stats,
        }
        if self.source is not None:  # absent unless set: older manifests keep their ids
            body["source"] = self.source
        if self.parent is not None:
            body["parent"] = self.parent
        return body

    def to_dict(self) -> dict[str, Any]:
        body = self.unsigned_dict()
        body["signature"] = self.signature
        return body

    def signing_bytes(self) -> bytes:
        """The bytes a signature covers: the canonical JSON without the signature."""
        return canonical_json(self.unsigned_dict()).encode()

    @property
    def id(self) -> str:
        return hashlib.sha256(self.signing_bytes()).hexdigest()

    def to_json(self) -> str:
        return canonical_json(self.to_dict())

    # -- derived ------------------------------------------------------------------------
    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    @property
    def digests(self) -> set[str]:
        return {f.digest for f in self.files}

    @property
    def built_by(self) -> str | None:
        """How the snapshot's processes got their CPU thread count: ``built_by(stats)``."""
        return built_by(self.stats)

    @property
    def verified(self) -> bool:
        return claims_verified(source=self.source, stats=self.stats)

    def with_signature(self, signature: dict[str, Any] | None) -> Manifest:
        return replace(self, signature=signature)

    # -- parsing ------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: Any, *, max_files: int = MAX_FILES) -> Manifest:
        """Validate and build; raises ``InvalidManifest`` (or a subclass) naming the problem."""
        if not isinstance(raw, dict):
            raise InvalidManifest("manifest is not a JSON object")
        fmt = raw.get("format")
        if fmt != FORMAT:
            raise UnsupportedFormat(f"manifest format {fmt!r} is not supported (expected {FORMAT})")
        files_raw = raw.get("files")
        if not isinstance(files_raw, list):
            raise InvalidManifest("manifest 'files' is not a list")
        if len(files_raw) > max_files:
            raise InvalidManifest(
                f"manifest lists {len(files_raw)} files, over the limit of {max_files}"
            )
        fingerprint = parse(raw.get("fingerprint"), where="manifest 'fingerprint'")
        devices = raw.get("devices", [])
        if not isinstance(devices, list) or not all(isinstance(d, str) for d in devices):
            raise InvalidManifest("manifest 'devices' is not a list of strings")
        workload = raw.get("workload")
        if workload is not None and not isinstance(workload, str):
            raise InvalidManifest("manifest 'workload' is not a string")
        for name, text in [("workload", workload or ""), *(("devices", d) for d in devices)]:
            if not text.isprintable():  # an escape sequence would reach operators' terminals
                raise InvalidManifest(f"manifest {name!r} {text!r} holds a control character")
        workload_digest = raw.get("workload_digest")
        if workload_digest is not None and not is_digest(workload_digest):
            raise InvalidManifest("manifest 'workload_digest' is not sha256 hex")
        stats = raw.get("stats")
        if stats is not None and not isinstance(stats, dict):
            raise InvalidManifest("manifest 'stats' is not an object")
        signature = raw.get("signature")
        if signature is not None and not isinstance(signature, dict):
            raise InvalidManifest("manifest 'signature' is not an object")
        source = raw.get("source")
        if source is not None and source not in SOURCES:
            raise InvalidManifest(f"manifest 'source' {source!r} is not one of {SOURCES}")
        parent = raw.get("parent")
        if parent is not None and not is_digest(parent):
            raise InvalidManifest("manifest 'parent' is not a snapshot id (sha256 hex)")
        written = raw.get("fingerprint_digest")
        if written and written != json_digest(fingerprint):
            raise InvalidManifest("manifest 'fingerprint_digest' does not match its fingerprint")
        files = tuple(FileEntry.from_dict(f, index=i) for i, f in enumerate(files_raw))
        return cls(
            files=files,
            fingerprint=fingerprint,
            devices=tuple(devices),
            workload=workload,
            workload_digest=workload_digest,
            stats=stats,
            signature=signature,
            source=source,
            parent=parent,
        )

    @classmethod
    def from_json(cls, text: str | bytes, *, max_files: int = MAX_FILES) -> Manifest:
        try:
            raw = json.loads(text)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InvalidManifest(f"manifest is not valid JSON: {exc}") from exc
        return cls.from_dict(raw, max_files=max_files)


def claims_verified(*, source: Any, stats: Any) -> bool:
    """What "verified" is, from a manifest's ``source`` and ``stats`` (both inside the signed
    bytes, so a signature covers the claim): a verify run found the cache effective, and
    it is not a harvest (what a job compiled: nothing proved it effective)."""
    if source == "harvest":
        return False
    verify = (stats.get("verify") if isinstance(stats, dict) else None) or {}
    return isinstance(verify, dict) and bool(verify.get("effective"))


def _check_tree(files: tuple[FileEntry, ...]) -> None:
    """Refuse paths inside ``STATE_DIR``, duplicate paths, and a path that is also a
    directory of another path."""
    seen: set[str] = set()
    dirs: set[str] = set()
    for entry in files:
        if entry.path.split("/", 1)[0] == STATE_DIR:
            raise UnsafePath(f"manifest path {entry.path!r} is inside cachekeeper's own folder")
        if entry.path in seen:
            raise InvalidManifest(f"manifest lists {entry.path!r} twice")
        seen.add(entry.path)
        parts = entry.path.split("/")
        for i in range(1, len(parts)):
            dirs.add("/".join(parts[:i]))
    clash = seen & dirs
    if clash:
        raise InvalidManifest(f"manifest path {sorted(clash)[0]!r} is both a file and a folder")
