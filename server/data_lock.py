"""One server per data dir: ``lock_data_dir`` takes ``<data>/server.lock`` at start-up.

Two ``cachekeeper serve`` processes on one ``--data`` would each run GC against a catalog
the other writes (each GC plan is re-validated only under its own process's write lock),
and listed snapshots lose blob files. So ``serve`` takes an exclusive ``flock`` on
``<data>/server.lock`` before it opens the catalog, holds it for the life of the process
(the kernel releases it when the process ends, however it ends), and a second server on the
same dir stops at start-up with one line naming the holder (pid, host, since when), which
the lock file records. Where ``flock`` is not supported (some NFS and Lustre mounts), the
lock cannot be taken and the server starts with a warning: keep one server per data dir by
hand there.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

from cachekeeper.errors import ConfigInvalid
from cachekeeper.wire import utc_now

__all__ = ["LOCK_NAME", "lock_data_dir"]

LOCK_NAME = "server.lock"


def lock_data_dir(data_dir: Path) -> tuple[int, str | None]:
    """(the lock's descriptor, a warning or None); keep the descriptor open while serving.

    Raises ConfigInvalid when another process holds the lock.
    """
    path = Path(data_dir) / LOCK_NAME
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "another process"
        os.close(fd)
        raise ConfigInvalid(
            f"data dir {data_dir} is in use by another cachekeeper server ({holder}); one"
            " server per data dir (their GCs would delete each other's blobs): stop it, or"
            " pick another --data"
        ) from None
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            os.close(fd)
            raise
        return fd, (
            f"data dir {data_dir}: its filesystem does not support flock, so nothing stops a"
            " second server on it; run only one"
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since {utc_now()}\n".encode(), 0)
    return fd, None
