"""cachekeeper/backends/registry.py: one table of URL schemes, read by the server's settings
and by its composition root; a backend's module (boto3 for ``s3``) loads only when opened.

Before issue 33 the ``s3`` scheme was registered twice (``server/app.py``'s openers and
``server/settings.py``'s ``startswith("s3://")``), so a new backend had to be added in both
or the settings refused its URL before the app could open it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cachekeeper.backends import registry
from cachekeeper.backends.base import BlobBackend
from cachekeeper.backends.registry import Scheme, open_backend
from cachekeeper.errors import ConfigInvalid
from cachekeeper.integrity import digest_of
from cachekeeper.server.settings import Settings
from tests.core.backends.test_base import MemoryBlobs
from tests.helpers.in_process import in_process

REPO = Path(__file__).resolve().parents[3]


def test_a_scheme_registered_once_is_accepted_by_the_settings_and_served(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A third backend is its class and one ``Scheme``: the settings take its URL and a
    server stores and serves blobs in it, with nothing else told about it."""
    with pytest.raises(ValueError, match=r"'mem://fleet' is not s3://BUCKET/PREFIX"):
        Settings(data_dir=tmp_path / "data", blob_store="mem://fleet")  # not registered yet
    opened: list[tuple[str, MemoryBlobs]] = []

    def open_memory(url: str) -> BlobBackend:
        opened.append((url, MemoryBlobs()))
        return opened[-1][1]

    monkeypatch.setitem(registry.SCHEMES, "mem", Scheme("mem", "mem://NAME", open_memory))
    settings = Settings(data_dir=tmp_path / "data", blob_store="mem://fleet")
    data = b"a kernel's bytes " * 100
    digest = digest_of(data)
    with in_process(settings) as server:
        assert server.client.put(f"/v1/blobs/{digest}", content=data).status_code == 201
        assert server.client.get(f"/v1/blobs/{digest}").content == data
    assert [url for url, _ in opened] == ["mem://fleet"]
    assert opened[0][1].blobs[digest][0] == data  # the bytes went to the registered backend
    with pytest.raises(ValueError, match=r"is not s3://BUCKET/PREFIX or mem://NAME"):
        Settings(data_dir=tmp_path / "data", blob_store="gs://bucket/p")


def test_an_unknown_scheme_is_one_line_naming_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(ConfigInvalid, match=r"'gs://b/p': no backend for gs:// \(one of: s3://\)"):
        open_backend("gs://b/p", local_root=tmp_path / "blobs")


def test_the_local_backend_opens_without_boto3(tmp_path: Path) -> None:
    """The base install (training nodes) has no boto3: the registry, the local backend and
    the local store load and work without it; only the object store's module needs it."""
    code = (
        "import importlib.abc, sys\n"
        "class Blocker(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in ('boto3', 'botocore'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r} (blocked)', name=name)\n"
        "sys.meta_path.insert(0, Blocker())\n"
        "from pathlib import Path\n"
        "from cachekeeper.backends.registry import open_backend\n"
        "from cachekeeper.store import LocalStore\n"
        f"local = open_backend(None, local_root=Path({str(tmp_path / 'blobs')!r}))\n"
        "local.put([b'x'], digest='2d711642b726b04401627ca9fbac32f5c8530fb1903cc4db02258717921a4881')\n"
        f"LocalStore(home=Path({str(tmp_path / 'home')!r})).list()\n"
        "try:\n"
        "    import cachekeeper.backends.s3\n"
        "except ModuleNotFoundError as exc:\n"
        "    print('s3 needs', exc.name)\n"
        "print(sorted(m for m in sys.modules if m.partition('.')[0] in ('boto3', 'botocore')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.splitlines() == ["s3 needs boto3", "[]"], out.stderr
