"""Make ``data-before-versions.tar.gz``: the data dir (its catalog, ``meta.sqlite``, and the
blobs it names) a server from before schema versions (main at d398f4e) leaves, for
tests/server/test_schema_versions.py.

Run with that commit's tree first on the path, so its server writes the file:

    git archive d398f4e | tar -x -C /tmp/old
    cd /tmp/old && PYTHONPATH=. python /path/to/tests/server/data/make_old_catalog.py OUT.tar.gz

What is in it: the status page's data (``tests/helpers/ui_data.seed``, sent over HTTP to a
real server: seven workloads, three snapshots, an agent and its events, job reports) and
one per-key tier key; the WAL checkpointed into the catalog, then the dir tarred and gzipped.
"""

from __future__ import annotations

import sqlite3
import sys
import tarfile
import tempfile
from pathlib import Path

from cachekeeper.server.settings import Settings
from tests.helpers.live_server import start_server
from tests.helpers.ui_data import TOKENS, seed


def main(out: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        with start_server(Settings(data_dir=data, tokens=TOKENS, resp_port=0)) as live:
            seed(live.url)
            live.app.state.tier.put(b"fx-graph-key", b"value" * 100, writer={"token": "t"})
        db = sqlite3.connect(data / "meta.sqlite")
        assert db.execute("PRAGMA user_version").fetchone() == (0,)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        db.close()
        assert (data / "meta.sqlite-wal").stat().st_size == 0  # all of it in meta.sqlite
        with tarfile.open(out, "w:gz") as tar:  # as a stopped server leaves it: no -wal, -shm
            tar.add(data, arcname="data", filter=_without_wal)


def _without_wal(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if member.name.endswith(("-wal", "-shm")) else member


if __name__ == "__main__":
    main(Path(sys.argv[1]))
