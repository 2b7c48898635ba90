"""A cache dir's own state folder, and the marker a complete restore leaves in it.

    cache_dir/.cachekeeper/          # STATE_DIR: ours; snapshots never include dot-names
      lock                           # the restore's flock target (cachekeeper.restore)
      staging/<host>-<pid>-<rand>/   # a restore's verified temp files (restore/writer.py)
      restored/<snapshot id>         # JSON: the id, each path with its size and mtime, the
                                     # signer's key
      conflicts/<snapshot id>        # JSON: the paths a restore kept because they differ
                                     # from the manifest (their digest in the manifest)
      postjob.json                   # what postjob counted (cachekeeper.client.postjob)
      prewarm/<workload>.json        # what a prewarm proved (cachekeeper.snapshot.provenance)

**No link is ever followed in it** (``StateDir``). Another local user who can write in the
cache dir could plant links there (``lock``, ``staging`` or ``restored`` pointing at
``/etc``) and make a root pre-job hook create files outside the cache dir. So the folder and
every folder and file in it are opened relative to a descriptor, one component at a time,
with ``O_NOFOLLOW``: a link (or a file where a folder goes) at any level is refused
(``CacheDirUnusable``, the hook's cold start) or, for a reader, is no marker at all. Files
are written as a temp file made with ``O_EXCL`` in the folder's descriptor, then renamed
there, which replaces a link rather than following it. What is ours is made with modes
``0o755`` / ``0o644`` (the umask can only take bits away: never group or other write).

``write_marker`` is the restore's last step (``cachekeeper.restore``), after every file of
the snapshot is in place and verified. A marker of ``merge_tree`` (prewarm merging its own
staging dirs, verify copying a dir, under the restore rules) says ``"merged": true``, so
that signing can tell bytes compiled here from bytes a restore brought
(``cachekeeper.snapshot.make``). ``is_restored`` is the fast already-restored check
that the pre-job hook runs before every job: it reads the marker and ``lstat``-s each path,
checking that it is still a regular file with the size and the modification time the
marker recorded (existence and mtime only for Triton group files, which a restore
rewrites); no hashing. That costs what a check of sizes alone cost (one ``lstat`` per
file, a few milliseconds for thousands of files; the marker holds one more number per
file) and notices a file rewritten in place or replaced, which a size check missed: a file
another user rewrote is no longer "already restored", the restore then hashes it and keeps
it as a conflict. A marker without mtimes (written by an older version) is not trusted:
the next restore hashes what is there once and writes a new one.

``held_by_restores`` names, of some paths, those another complete restore into the dir
wrote and nobody changed since (its marker lists the path, and the file still has the size
and mtime it recorded): two snapshots that hold one cache path with other bytes (a C++
kernel's ``.so`` compiled twice is not the same bytes; an autotune result timed twice) are
two builds of the same cache entry, and what the first restore wrote serves the second.
Such a path is no conflict: the second restore keeps it, and its marker records it as it
is (``write_marker``'s ``held``).

``record_conflicts`` is the restore's record of what it kept (a file that differs from the
manifest: someone's own version, or a corrupt entry), which ``verify`` names when the dir
misses and ``restore --repair`` replaces; a restore without conflicts removes it.
``read_markers`` reads every marker (postjob's baseline), ``held_snapshot`` names the newest
snapshot whose files are all still there (what a job uses when no restore could run).

Stdlib only and light on purpose: the hook imports this module, not the restore stack.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import uuid
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from cachekeeper.errors import CacheDirUnusable
from cachekeeper.integrity import is_digest
from cachekeeper.snapshot.manifest import STATE_DIR, Manifest

__all__ = [
    "STATE_DIR",
    "FOLDER_MODE",
    "FILE_MODE",
    "StateDir",
    "state_dir",
    "unusable_reason",
    "write_marker",
    "is_restored",
    "read_markers",
    "held_snapshot",
    "held_by_restores",
    "record_conflicts",
    "recorded_conflicts",
]

FOLDER_MODE = 0o755  # what cachekeeper makes: never writable by group or others
FILE_MODE = 0o644
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PROC_FD = Path("/proc/self/fd")


class StateDir:
    """``cache_dir/.cachekeeper`` opened without following a link, and what is in it.

    ``create``: make the folder (and the sub-folders asked for) when missing; without it a
    missing folder raises FileNotFoundError. A link, or a file where a folder goes, raises
    ``CacheDirUnusable`` naming it. Close it (or use it as a context manager).
    """

    def __init__(self, cache_dir: Path, *, create: bool) -> None:
        self.cache_dir = Path(cache_dir)
        self.create = create
        self._folders: dict[str, int] = {}
        root = os.open(self.cache_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self.fd = self._open_folder(root, STATE_DIR, shown=STATE_DIR)
        finally:
            os.close(root)

    def _open_folder(self, parent_fd: int, name: str, *, shown: str) -> int:
        for _ in range(2):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
            except FileNotFoundError:
                if not self.create:
                    raise
                try:  # mkdirat follows nothing; the umask can only take bits away
                    os.mkdir(name, FOLDER_MODE, dir_fd=parent_fd)
                except FileExistsError:
                    pass  # made meanwhile: the open decides what it is
                except OSError as exc:
                    raise self._named(exc, shown) from exc
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise self._refused(shown) from exc
                raise self._named(exc, shown) from exc
        raise self._refused(shown)

    def _named(self, exc: OSError, shown: str) -> OSError:
        """``exc`` naming the full path (a name relative to a descriptor says nothing: the
        CLI's line would read ``.cachekeeper: Operation not permitted``)."""
        return OSError(exc.errno, exc.strerror, str(self.cache_dir / shown))

    def _refused(self, shown: str, *, what: str = "a link or not a folder") -> CacheDirUnusable:
        where = self.cache_dir / shown
        return CacheDirUnusable(
            f"{where} is {what}; cachekeeper keeps its lock, staging and restore markers in"
            f" {STATE_DIR} and never follows a link there: move it away"
        )

    def folder(self, name: str) -> int:
        """A descriptor of the sub-folder ``name`` (one level; kept open until ``close``)."""
        fd = self._folders.get(name)
        if fd is None:
            fd = self._open_folder(self.fd, name, shown=f"{STATE_DIR}/{name}")
            self._folders[name] = fd
        return fd

    def folders(self, rel: str) -> int:
        """A descriptor of the nested folder ``rel`` (``a/b/c``), each level opened (and,
        with ``create``, made) without following a link; kept open until ``close``."""
        fd = self.fd
        shown = STATE_DIR
        for part in rel.split("/"):
            shown = f"{shown}/{part}"
            key = shown[len(STATE_DIR) + 1 :]
            if key not in self._folders:
                self._folders[key] = self._open_folder(fd, part, shown=shown)
            fd = self._folders[key]
        return fd

    def _split(self, rel: str) -> tuple[int, str]:
        folder, _, name = rel.rpartition("/")
        return (self.folder(folder) if folder else self.fd), name

    def open_file(self, rel: str, flags: int) -> int:
        """``os.open`` of ``rel`` (``name`` or ``folder/name``) without following a link."""
        dir_fd, name = self._split(rel)
        try:
            return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise self._refused(f"{STATE_DIR}/{rel}", what="a link") from exc
            raise self._named(exc, f"{STATE_DIR}/{rel}") from exc

    def read_file(self, rel: str) -> bytes | None:
        """The bytes of ``rel``, or None when it is missing, a link or not a file."""
        try:
            fd = self.open_file(rel, os.O_RDONLY)
        except (OSError, CacheDirUnusable):
            return None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return None
            with os.fdopen(fd, "rb", closefd=False) as fh:
                return fh.read()
        finally:
            os.close(fd)

    def write_file(self, rel: str, data: bytes) -> None:
        """Replace ``rel`` with ``data`` atomically and durably (a link there is replaced,
        never followed): a temp file made with O_EXCL in the same folder, fsync, rename."""
        dir_fd, name = self._split(rel)
        tmp = f".{name}.{uuid.uuid4().hex}.tmp"
        try:
            fd = os.open(
                tmp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                FILE_MODE,
                dir_fd=dir_fd,
            )
        except OSError as exc:
            raise self._named(exc, f"{STATE_DIR}/{rel}") from exc
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            if isinstance(exc, OSError):
                raise self._named(exc, f"{STATE_DIR}/{rel}") from exc
            raise
        try:
            os.fsync(dir_fd)
        except OSError:
            pass  # some filesystems refuse fsync on a folder; the rename is still atomic

    def remove_file(self, rel: str) -> bool:
        """Remove ``rel`` (a link there is removed, never followed); False when missing."""
        dir_fd, name = self._split(rel)
        try:
            os.unlink(name, dir_fd=dir_fd)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise self._named(exc, f"{STATE_DIR}/{rel}") from exc
        return True

    def names(self, folder: str) -> list[str]:
        """The names in the sub-folder ``folder`` (none when it is missing or refused)."""
        try:
            return os.listdir(self.folder(folder))
        except (OSError, CacheDirUnusable):
            return []

    def path_of(self, fd: int, *, fallback: Path) -> Path:
        """A path that reaches what ``fd`` is open on through the descriptor itself (Linux's
        ``/proc/self/fd``), so a folder swapped for a link later cannot redirect it;
        ``fallback`` (checked when opened, not after) where /proc is not mounted."""
        return _PROC_FD / str(fd) if _PROC_FD.is_dir() else fallback

    def close(self) -> None:
        for fd in self._folders.values():
            os.close(fd)
        self._folders.clear()
        os.close(self.fd)

    def __enter__(self) -> StateDir:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


@contextmanager
def state_dir(cache_dir: Path, *, create: bool) -> Iterator[StateDir]:
    """``StateDir`` as a context manager."""
    state = StateDir(cache_dir, create=create)
    try:
        yield state
    finally:
        state.close()


def unusable_reason(cache_dir: Path) -> str | None:
    """Why ``cache_dir`` cannot be filled, naming the full path; None when it can.

    Proved by doing what a prewarm's merge and record do, once each, with probes removed at
    once: make the dir (when missing), create, write and rename a file in it, and the same
    in its ``.cachekeeper/`` (opened as ``StateDir`` does). Permission bits alone would say
    yes to root on an immutable folder or a read-only mount. Leaves nothing behind: the
    folders it made (the dir, its ``.cachekeeper/``) are removed again, and only those. A
    few system calls: a prewarm runs it before it compiles for minutes.
    """
    root = Path(cache_dir)
    made = [p for p in (root, *root.parents) if not os.path.lexists(p)]  # deepest first
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        _remove_made(made)
        return f"cannot create {os.fsdecode(exc.filename or root)}: {exc.strerror or exc}"
    state_made = not os.path.lexists(root / STATE_DIR)
    try:
        return _probe(root)
    finally:
        if state_made:
            _remove_made([root / STATE_DIR])
        _remove_made(made)


def _probe(root: Path) -> str | None:
    probe = f".cachekeeper-probe.{uuid.uuid4().hex}"
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        return f"cannot open {root}: {exc.strerror or exc}"
    try:
        step = "create a file in"
        made = os.open(
            f"{probe}.tmp",
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
            dir_fd=fd,
        )
        try:
            step = "write a file in"
            os.write(made, b"probe")
        finally:
            os.close(made)
        step = "rename a file in"
        try:
            os.rename(f"{probe}.tmp", f"{probe}.done", src_dir_fd=fd, dst_dir_fd=fd)
        finally:
            for name in (f"{probe}.tmp", f"{probe}.done"):
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=fd)
    except OSError as exc:
        return f"cannot {step} {root}: {exc.strerror or exc}"
    finally:
        os.close(fd)
    try:
        with state_dir(root, create=True) as state:
            state.write_file(f"{probe}.tmp", b"probe")  # a temp file, written, renamed
            state.remove_file(f"{probe}.tmp")
    except CacheDirUnusable as exc:
        return exc.detail
    except OSError as exc:  # the folder, not the probe's own name
        return f"cannot write in {root / STATE_DIR}: {exc.strerror or exc}"
    return None


def _remove_made(folders: list[Path]) -> None:
    """``rmdir`` each folder (deepest first) that the probe made; one that is not empty
    (someone else's files arrived meanwhile) stays, and so do the folders above it."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except FileNotFoundError:
            continue
        except OSError:
            return


def write_marker(
    manifest: Manifest,
    cache_dir: Path,
    *,
    key_id: str | None,
    held: Collection[str] = (),
    merged: bool = False,
) -> None:
    """Record that ``cache_dir`` holds all of ``manifest`` (signed by ``key_id``, if given),
    with each file's size and modification time as it is now. ``held``: paths another
    restore wrote with other bytes (``held_by_restores``), recorded with their own size.
    ``merged``: a local dir ``merge_tree`` merged, not a snapshot."""
    # Imported here: only a restore writes a marker, and the hook's no-op path, which
    # imports this module, then loads nothing of the restore package but this module.
    from cachekeeper.restore.triton_groups import is_group_path

    root = os.fspath(cache_dir)
    files = []
    for entry in manifest.files:
        st = os.lstat(f"{root}/{entry.path}")
        size = -1 if is_group_path(entry.path) else entry.size_bytes
        if entry.path in held:
            size = st.st_size
        files.append([entry.path, size, st.st_mtime_ns])
    body: dict[str, object] = {"id": manifest.id, "files": files, "key_id": key_id}
    if merged:
        body["merged"] = True
    with state_dir(cache_dir, create=True) as state:
        state.write_file(f"restored/{manifest.id}", json.dumps(body).encode())


def read_markers(cache_dir: Path) -> list[tuple[float, dict[str, object]]]:
    """(mtime, body) of every readable restore marker in ``cache_dir`` (links never followed)."""
    out: list[tuple[float, dict[str, object]]] = []
    try:
        state = StateDir(cache_dir, create=False)
    except (OSError, CacheDirUnusable):
        return out
    with state:
        for name in state.names("restored"):
            if not is_digest(name):
                continue  # a temp file being written, or not ours
            raw = state.read_file(f"restored/{name}")
            try:
                body = json.loads(raw or b"")
                mtime = os.stat(name, dir_fd=state.folder("restored"), follow_symlinks=False)
            except (OSError, ValueError):
                continue
            if isinstance(body, dict):
                out.append((mtime.st_mtime, body))
    return sorted(out, key=lambda m: m[0])


def is_restored(
    manifest_id: str, cache_dir: Path, *, trusted_key_ids: Collection[str] | None = None
) -> bool:
    """The already-restored check: the marker present and every file it lists still a
    regular file with the recorded size and modification time (see the module docstring).

    With ``trusted_key_ids`` (non-empty), the marker must also say that a restore which
    verified the signature of one of those keys wrote it.
    """
    if not is_digest(manifest_id):
        return False
    root = os.fspath(cache_dir)
    try:
        with state_dir(cache_dir, create=False) as state:
            raw = state.read_file(f"restored/{manifest_id}")
        if raw is None:
            return False
        marker = json.loads(raw)
        if trusted_key_ids and marker.get("key_id") not in trusted_key_ids:
            return False
        lstat = os.lstat
        for path, size, mtime_ns in marker["files"]:
            st = lstat(f"{root}/{path}")
            if not stat.S_ISREG(st.st_mode) or st.st_mtime_ns != mtime_ns:
                return False
            if size >= 0 and st.st_size != size:
                return False
    except (OSError, ValueError, KeyError, TypeError, CacheDirUnusable):
        return False
    return True


def held_snapshot(cache_dir: Path) -> str | None:
    """The newest snapshot a complete restore left in ``cache_dir`` whose files are all
    still there (``is_restored``), or None: the cache a job uses when no restore ran."""
    for _mtime, body in reversed(read_markers(cache_dir)):
        snapshot_id = body.get("id")
        if isinstance(snapshot_id, str) and is_restored(snapshot_id, cache_dir):
            return snapshot_id
    return None


def held_by_restores(
    cache_dir: Path,
    paths: Collection[str],
    *,
    other_than: str,
    trusted_key_ids: Collection[str] | None = None,
) -> dict[str, str]:
    """{path: snapshot id} for each of ``paths`` that a complete restore of another snapshot
    (not ``other_than``) wrote into ``cache_dir`` and nobody changed since: its marker lists
    the path, and the file is a regular file with the size and mtime it recorded. With
    ``trusted_key_ids``, only a restore that verified one of those keys counts."""
    wanted = set(paths)
    found: dict[str, str] = {}
    if not wanted:
        return found
    root = os.fspath(cache_dir)
    for _mtime, body in reversed(read_markers(cache_dir)):  # the newest restore first
        snapshot_id, files = body.get("id"), body.get("files")
        if snapshot_id == other_than or not isinstance(files, list):
            continue
        if trusted_key_ids and body.get("key_id") not in trusted_key_ids:
            continue
        for item in files:
            try:
                path, size, mtime_ns = item
                if path not in wanted or path in found:
                    continue
                st = os.lstat(f"{root}/{path}")
            except (OSError, ValueError, TypeError):
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_mtime_ns != mtime_ns:
                continue
            if isinstance(size, int) and size >= 0 and st.st_size != size:
                continue
            found[str(path)] = str(snapshot_id)
    return found


def record_conflicts(manifest: Manifest, cache_dir: Path, conflicts: Collection[str]) -> None:
    """Record (or, with none, clear) the paths a restore of ``manifest`` kept as conflicts."""
    rel = f"conflicts/{manifest.id}"
    try:
        with state_dir(cache_dir, create=bool(conflicts)) as state:
            if not conflicts:
                state.remove_file(rel)
                return
            digests = {e.path: e.digest for e in manifest.files}
            body = {"id": manifest.id, "files": {p: digests.get(p) for p in sorted(conflicts)}}
            state.write_file(rel, json.dumps(body).encode())
    except (FileNotFoundError, CacheDirUnusable):
        if conflicts:
            raise
        # nothing recorded (the common case: no state folder, no conflicts folder)


def recorded_conflicts(cache_dir: Path) -> dict[str, dict[str, str | None]]:
    """{snapshot id: {path: the manifest's digest}} of every recorded conflict."""
    out: dict[str, dict[str, str | None]] = {}
    try:
        state = StateDir(cache_dir, create=False)
    except (OSError, CacheDirUnusable):
        return out
    with state:
        for name in sorted(state.names("conflicts")):
            if not is_digest(name):
                continue
            try:
                body = json.loads(state.read_file(f"conflicts/{name}") or b"")
                out[str(body["id"])] = dict(body["files"])
            except (ValueError, KeyError, TypeError):
                continue
    return out
