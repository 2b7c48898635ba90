"""Hide files from a build's processes: Landlock (Linux >= 5.19), through ctypes, unprivileged.

A builder that signs runs admitted code (a ``[[command]]``, an entrypoint) next to its
signing key. The agent reads the key into memory before it runs anything; this module makes
the key's file unreachable for every process of a build, whatever user they run as:

- ``prepare(hidden)`` builds a Landlock ruleset that handles every filesystem right the
  kernel knows but listing a folder, and grants all of them beneath every path of the
  filesystem *except* the hidden files: for each folder on the way from ``/`` to a hidden
  file, every other entry of that folder gets a rule (a folder: all rights beneath it; a
  file: the file rights). So a hidden file can be neither read, written, truncated,
  executed, renamed, linked elsewhere nor replaced; the folders on its way can be listed
  (names are not secrets) but nothing can be created or removed directly in them. Block
  devices (``/dev``) are hidden too: root could read the key from the raw disk.
- ``enter(ruleset)``, in the child between fork and exec (``preexec_fn``), sets
  ``no_new_privs``, drops from the bounding set the capabilities that reach around a
  path-based sandbox (``open_by_handle_at`` needs ``CAP_DAC_READ_SEARCH``; raw I/O, ptrace,
  modules, ``mknod``, BPF, ``CAP_SYS_ADMIN``), and restricts itself. The sandbox is
  inherited by everything it starts and cannot be lifted.

Landlock also keeps a sandboxed process from ptracing, or reading ``/proc/<pid>/mem`` or
``environ`` of, processes outside its domain (the agent that holds the key in memory), and
from ABI 6 on (Linux 6.12) from signalling them (``scoped``). ABI 1 (5.13-5.18) is refused:
it cannot rename across folders, which Triton's cache does. What it does not cover is in
docs/security.md ("What the sandbox does not cover").

Paths are judged by the kernel on the file a path leads to, so ``..``, links and
``/proc/self/root`` all end at the hidden file and are refused; another hard link or a bind
mount of the file is not, which is why the agent refuses a key with more than one link.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Ruleset", "abi_version", "unavailable_reason", "prepare", "enter", "MIN_ABI"]

MIN_ABI = 2
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446  # x86_64 and arm64
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAPBSET_DROP = 24
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
# Capabilities that reach around a path-based sandbox (linux/capability.h).
_DROPPED_CAPS = {
    "CAP_DAC_READ_SEARCH": 2,  # open_by_handle_at: open a file by inode, no path
    "CAP_SYS_MODULE": 16,
    "CAP_SYS_RAWIO": 17,  # /dev/mem, /proc/kcore
    "CAP_SYS_PTRACE": 19,
    "CAP_SYS_ADMIN": 21,
    "CAP_MKNOD": 27,
    "CAP_SYSLOG": 34,
    "CAP_PERFMON": 38,
    "CAP_BPF": 39,
}

# Filesystem rights (linux/landlock.h), by the ABI that introduced them.
_EXECUTE = 1 << 0
_WRITE_FILE = 1 << 1
_READ_FILE = 1 << 2
_READ_DIR = 1 << 3
_ABI1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
_REFER = 1 << 13  # ABI 2
_TRUNCATE = 1 << 14  # ABI 3
_IOCTL_DEV = 1 << 15  # ABI 5
_SCOPE_SIGNAL = 1 << 1  # ABI 6: no signals to processes outside the domain


def _rights(abi: int) -> int:
    rights = _ABI1
    if abi >= 2:
        rights |= _REFER
    if abi >= 3:
        rights |= _TRUNCATE
    if abi >= 5:
        rights |= _IOCTL_DEV
    return rights & ~_READ_DIR  # folders stay listable: names are not what is hidden


def _file_rights(abi: int) -> int:
    return _rights(abi) & (_EXECUTE | _WRITE_FILE | _READ_FILE | _TRUNCATE | _IOCTL_DEV)


class _RulesetAttr(ctypes.Structure):
    _fields_ = [
        ("handled_access_fs", ctypes.c_uint64),
        ("handled_access_net", ctypes.c_uint64),
        ("scoped", ctypes.c_uint64),
    ]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def abi_version() -> int:
    """The kernel's Landlock ABI version; 0 when Landlock is missing or disabled."""
    try:
        libc = _libc()
        version = libc.syscall(_SYS_CREATE_RULESET, None, 0, _CREATE_RULESET_VERSION)
    except (OSError, AttributeError):
        return 0
    return max(0, int(version))


def unavailable_reason() -> str | None:
    """Why files cannot be hidden on this host (None: they can)."""
    if not os.path.exists("/proc/self/status"):
        return "not Linux"
    abi = abi_version()
    if abi == 0:
        return (
            "Landlock is not available (Linux >= 5.19 with landlock in its LSM list; a"
            " container's seccomp profile may also block it)"
        )
    if abi < MIN_ABI:
        return f"Landlock ABI {abi} cannot rename across folders (Triton's cache does)"
    return None


@dataclass(frozen=True)
class Ruleset:
    """A prepared ruleset: its descriptor (inherited by the child), what it hides."""

    fd: int
    abi: int
    hidden: tuple[str, ...]
    rules: int

    def describe(self) -> str:
        return f"Landlock ABI {self.abi}, {len(self.hidden)} path(s) hidden, {self.rules} rules"


def _block_devices(root: str = "/dev") -> list[str]:
    found: list[str] = []
    for folder, dirs, files in os.walk(root):
        for name in files + dirs:
            path = os.path.join(folder, name)
            try:
                if stat.S_ISBLK(os.lstat(path).st_mode):
                    found.append(path)
            except OSError:
                continue
    return found


def _ancestors(path: str) -> list[str]:
    out = []
    current = os.path.dirname(path)
    while True:
        out.append(current)
        if current == os.sep:
            return out
        current = os.path.dirname(current)


def prepare(
    hidden: Iterable[str | os.PathLike[str]], *, hide_block_devices: bool = True
) -> Ruleset:
    """A ruleset that grants everything but ``hidden`` (module docstring). OSError when
    the kernel refuses (its errno says why); ValueError when Landlock is unavailable."""
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(reason)
    abi = abi_version()
    targets = {os.path.realpath(os.fspath(p)) for p in hidden}
    if hide_block_devices:
        targets.update(os.path.realpath(p) for p in _block_devices())
    targets.discard(os.sep)
    if not targets:
        raise ValueError("nothing to hide")
    on_the_way: set[str] = set()
    for target in targets:
        on_the_way.update(_ancestors(target))
    libc = _libc()
    attr = _RulesetAttr(_rights(abi), 0, _SCOPE_SIGNAL if abi >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if abi >= 6 else 8
    fd = int(libc.syscall(_SYS_CREATE_RULESET, ctypes.byref(attr), size, 0))
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_create_ruleset: {os.strerror(err)}")
    rules = 0
    try:
        for folder in sorted(on_the_way):
            try:
                entries = os.listdir(folder)
            except OSError:
                continue  # cannot list it: nothing beneath it is granted
            for name in entries:
                path = os.path.join(folder, name)
                if path in targets or path in on_the_way:
                    continue
                rules += _grant(libc, fd, path, abi)
    except BaseException:
        os.close(fd)
        raise
    return Ruleset(fd=fd, abi=abi, hidden=tuple(sorted(targets)), rules=rules)


def _grant(libc: ctypes.CDLL, ruleset_fd: int, path: str, abi: int) -> int:
    """Grant every handled right beneath ``path`` (file rights on a file); 1 if a rule was
    added. A link is skipped: what it points to is judged where it lives."""
    try:
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISLNK(mode):
            return 0
        rights = _rights(abi) if stat.S_ISDIR(mode) else _file_rights(abi)
        rule = _PathBeneathAttr(rights, fd)
        if libc.syscall(_SYS_ADD_RULE, ruleset_fd, _RULE_PATH_BENEATH, ctypes.byref(rule), 0):
            err = ctypes.get_errno()
            raise OSError(err, f"landlock_add_rule {path}: {os.strerror(err)}")
        return 1
    finally:
        os.close(fd)


def enter(ruleset: Ruleset) -> None:
    """Sandbox the calling process (and everything it will start). Call it in the child,
    between fork and exec; raises OSError when the kernel refuses."""
    libc = _libc()
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0):
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(NO_NEW_PRIVS): {os.strerror(err)}")
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    for cap in _DROPPED_CAPS.values():
        # EPERM: no CAP_SETPCAP, so not root: the capability is not ours to use anyway;
        # EINVAL: a kernel that does not know it.
        if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) and ctypes.get_errno() not in (
            errno.EPERM,
            errno.EINVAL,
        ):
            err = ctypes.get_errno()
            raise OSError(err, f"prctl(CAPBSET_DROP {cap}): {os.strerror(err)}")
    if libc.syscall(_SYS_RESTRICT_SELF, ruleset.fd, 0):
        err = ctypes.get_errno()
        raise OSError(err, f"landlock_restrict_self: {os.strerror(err)}")


def hidden_file_problem(path: Path) -> str | None:
    """Why hiding ``path`` would not keep its bytes from a build (None: it would): another
    hard link to it is another path the ruleset does not know."""
    try:
        st = os.stat(path)
    except OSError as exc:
        return f"cannot stat it: {exc.strerror}"
    if st.st_nlink > 1:
        return f"it has {st.st_nlink} hard links; Landlock hides a path, so give it one"
    return None
