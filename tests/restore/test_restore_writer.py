"""The restore writer's fallback paths, met for real: a kernel without ``renameat2``, and a
filesystem without hard links.

A file appears in the cache dir by ``renameat2(RENAME_NOREPLACE)``; where the kernel does
not have it (ENOSYS; glibc then answers EINVAL) or a container's seccomp profile refuses
it (EPERM, older Docker profiles), by ``link`` (fails if the name exists); where links are
refused too (EPERM, as on vfat), by ``lstat`` then ``os.replace``. Each way must publish
the same verified bytes and modes and never clobber a file that appeared meanwhile. Here
the restore runs in a child process under a seccomp filter (tests/helpers/seccomp.py)
that makes the kernel refuse those calls: nothing in cachekeeper is patched, and the
child first proves the refusal is in force.
"""

from __future__ import annotations

import errno
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import seccomp

pytestmark = pytest.mark.skipif(not seccomp.supported(), reason="seccomp filters: Linux only")

CHILD = r"""
import ctypes, errno, hashlib, io, json, os, sys, tempfile
from pathlib import Path
from cachekeeper.snapshot.manifest import FileEntry, Manifest
from cachekeeper.restore import restore

def probe():
    where = tempfile.mkdtemp()
    src, dst = os.path.join(where, "a"), os.path.join(where, "b")
    open(src, "w").close()
    libc = ctypes.CDLL(None, use_errno=True)
    renamed = libc.renameat2(-100, src.encode(), -100, dst.encode(), 1) == 0
    seen = {"renameat2": "ok" if renamed else errno.errorcode[ctypes.get_errno()]}
    try:
        os.link(dst if renamed else src, os.path.join(where, "c"))
        seen["link"] = "ok"
    except OSError as exc:
        seen["link"] = errno.errorcode[exc.errno]
    return seen

dst = Path(sys.argv[1])
files = {
    "fxgraph/ab/small": b"a small entry " * 100,  # pooled: hashed and written by threads
    "fxgraph/ab/copy": b"a small entry " * 100,  # the same blob, a second path
    "kernels/big.so": os.urandom(5 << 20),  # streamed: over the pooled size
    "race/theirs": b"the snapshot's bytes",
    "race/same": b"bytes both write",
}
modes = {"kernels/big.so": 0o775}  # group write is never restored: 0o755
digest = {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}
entries = [FileEntry(p, digest[p], len(d), modes.get(p, 0o644)) for p, d in files.items()]
manifest = Manifest(files=tuple(entries), fingerprint={"schema": 1}, devices=("cpu",))
by_digest = {digest[p]: d for p, d in files.items()}

class Racing:
    # Another process writes two of the snapshot's paths after the restore planned them
    # absent and before it publishes them: one with other bytes, one with the same.
    def open(self, wanted):
        (dst / "race").mkdir(parents=True, exist_ok=True)
        for path, data in (("race/theirs", b"someone else's bytes"), ("race/same", None)):
            if not (dst / path).exists():
                (dst / path).write_bytes(files[path] if data is None else data)
        return io.BytesIO(by_digest[wanted])

report = restore(manifest, Racing(), dst)
again = restore(manifest, Racing(), dst)
print(json.dumps({"probe": probe(), "first": report.to_dict(), "again": again.to_dict(),
                  "files": {p: hashlib.sha256(d).hexdigest() for p, d in files.items()}}))
"""

WAYS = {
    "renameat2": {},
    "link (no renameat2: an older kernel)": {"renameat2": errno.ENOSYS},
    "link (renameat2 refused: a container's seccomp profile)": {"renameat2": errno.EPERM},
    "replace (no renameat2, no hard links: vfat)": {
        "renameat2": errno.EPERM,
        "linkat": errno.EPERM,
    },
}
PROBES = {  # what the child's own calls meet under each filter
    "renameat2": {"renameat2": "ok", "link": "ok"},
    "link (no renameat2: an older kernel)": {"renameat2": "EINVAL", "link": "ok"},
    "link (renameat2 refused: a container's seccomp profile)": {"renameat2": "EPERM", "link": "ok"},
    "replace (no renameat2, no hard links: vfat)": {"renameat2": "EPERM", "link": "EPERM"},
}


def _restore_under(refusals: dict[str, int], dst: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(dst)],
        capture_output=True,
        text=True,
        timeout=120,
        preexec_fn=seccomp.refusing(refusals) if refusals else None,  # noqa: PLW1509
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("way", list(WAYS))
def test_every_way_of_publishing_writes_the_same_and_clobbers_nothing(
    way: str, tmp_path: Path
) -> None:
    dst = tmp_path / "cache"
    out = _restore_under(WAYS[way], dst)
    assert out["probe"] == PROBES[way]  # the refusal was in force in the restoring process
    first = out["first"]
    # five paths: three written, the racing identical one skipped, the other kept as theirs
    assert (first["written"], first["skipped"], first["conflicts"]) == (3, 1, ["race/theirs"])
    assert (dst / "race" / "theirs").read_bytes() == b"someone else's bytes"
    assert (out["again"]["written"], out["again"]["skipped"]) == (0, 4)
    for path, digest in out["files"].items():
        if path != "race/theirs":
            assert hashlib.sha256((dst / path).read_bytes()).hexdigest() == digest, path
    assert (dst / "kernels" / "big.so").stat().st_mode & 0o777 == 0o755
    assert (dst / "fxgraph" / "ab" / "small").stat().st_mode & 0o777 == 0o644
    staging = dst / ".cachekeeper" / "staging"
    assert not staging.exists() or [p for p in staging.rglob("*") if p.is_file()] == []
