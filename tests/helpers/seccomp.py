"""Make the kernel refuse chosen system calls in a child process (a seccomp filter).

    subprocess.run(argv, preexec_fn=refusing({"renameat2": errno.ENOSYS}))

The child and everything it execs get ``-1`` with that errno from those calls, exactly
as an older kernel (no ``renameat2``: ENOSYS), a container runtime's seccomp profile
(older Docker profiles answered ``renameat2`` with EPERM) or a filesystem without hard
links (``linkat``: EPERM, as on vfat) answer them, or a kernel without Landlock
(``landlock_create_ruleset``: ENOSYS; EOPNOTSUPP where it is built but disabled).
Nothing in the child is patched: the code under test makes its real calls and meets a
real refusal.

Linux on x86_64 and aarch64 only (``supported()``); the filter allows every call of any
other architecture's ABI through unchanged, so it can never refuse more than asked.
"""

from __future__ import annotations

import ctypes
import platform
import struct
import sys
from collections.abc import Callable, Mapping

__all__ = ["refusing", "supported"]

# The numbers of the calls tests refuse, per architecture; refusing ``linkat`` refuses
# ``link`` too where the architecture still has it.
_SYSCALLS: dict[str, dict[str, tuple[int, ...]]] = {
    "x86_64": {"renameat2": (316,), "linkat": (265, 86), "landlock_create_ruleset": (444,)},
    "aarch64": {"renameat2": (276,), "linkat": (37,), "landlock_create_ruleset": (444,)},
}
_AUDIT_ARCH: dict[str, int] = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}

_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_ALLOW, _RET_ERRNO = 0x7FFF0000, 0x00050000
_PR_SET_NO_NEW_PRIVS, _PR_SET_SECCOMP, _SECCOMP_MODE_FILTER = 38, 22, 2


def supported() -> bool:
    return sys.platform == "linux" and platform.machine() in _SYSCALLS


def _program(refusals: Mapping[str, int]) -> bytes:
    machine = platform.machine()
    numbers = _SYSCALLS[machine]
    # struct seccomp_data: int nr (offset 0); u32 arch (offset 4)
    ops = [(_LD_W_ABS, 0, 0, 4), (_JEQ_K, 1, 0, _AUDIT_ARCH[machine]), (_RET_K, 0, 0, _RET_ALLOW)]
    ops.append((_LD_W_ABS, 0, 0, 0))
    for name, errno in refusals.items():
        for number in numbers[name]:
            ops += [(_JEQ_K, 0, 1, number), (_RET_K, 0, 0, _RET_ERRNO | (errno & 0xFFFF))]
    ops.append((_RET_K, 0, 0, _RET_ALLOW))
    return b"".join(struct.pack("HBBI", *op) for op in ops)


def refusing(refusals: Mapping[str, int]) -> Callable[[], None]:
    """A ``preexec_fn`` that installs a filter answering each named call with its errno."""
    if not supported():
        raise RuntimeError(f"no seccomp filter for {platform.machine()} here")
    unknown = set(refusals) - set(_SYSCALLS[platform.machine()])
    if unknown:
        raise ValueError(f"no syscall number known for {sorted(unknown)}")
    program = _program(refusals)  # built before the fork: the child only calls prctl

    def install() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        filters = ctypes.create_string_buffer(program, len(program))

        class Prog(ctypes.Structure):
            _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

        prog = Prog(len(program) // 8, ctypes.addressof(filters))
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP)")

    return install
