"""How cachekeeper installs: the base install works without the server's packages, and a
built wheel (not the editable finder) imports the server and the hook from anywhere,
the repository root included."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from cachekeeper.cli import COMMANDS

REPO = Path(__file__).resolve().parents[1]
SERVER_PACKAGES = [
    "fastapi",
    "starlette",
    "uvicorn",
    "pydantic",
    "pydantic_core",
    "pydantic_settings",
    "sqlite_utils",
    "prometheus_client",
    "boto3",  # the object store backend (cachekeeper/backends/s3.py)
    "botocore",
]

_BLOCKER = """
import importlib, importlib.abc, pkgutil, sys
BLOCKED = set(sys.argv[1].split(","))
class Blocker(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None
sys.meta_path.insert(0, Blocker())
"""


def test_base_install_needs_no_server_package() -> None:
    """Every module but the server's imports, and every command but serve runs its help,
    with fastapi, pydantic, uvicorn, sqlite-utils, prometheus_client and boto3 unimportable
    (the backends' registry and the local backend included: a node's local store); serve
    says what to install."""
    commands = sorted({entry[0].partition(":")[0] for entry in COMMANDS.values()})
    code = _BLOCKER + (
        "import cachekeeper, cachekeeper.builder, cachekeeper.client, cachekeeper.cli\n"
        "from cachekeeper.cli import main\n"
        "names = [f'cachekeeper.{m.name}' for m in pkgutil.iter_modules([cachekeeper.__path__[0]]) if m.name != '__main__']\n"
        "names += [m.name for m in pkgutil.walk_packages(cachekeeper.builder.__path__, 'cachekeeper.builder.')]\n"
        "names += [f'cachekeeper.client.{m.name}' for m in pkgutil.iter_modules(cachekeeper.client.__path__)]\n"
        "import cachekeeper.backends\n"  # every backend but the object store's (boto3)
        "names += [f'cachekeeper.backends.{m.name}' for m in pkgutil.iter_modules(cachekeeper.backends.__path__) if m.name != 's3']\n"
        f"names += {commands!r}\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print('imported', len(names))\n"
        "for command in ('prejob', 'pull', 'push', 'agent', 'serve'):\n"
        "    try:\n"
        "        main([command, '--help'])\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code == 0, (command, exc.code)\n"
        "main(['serve', '--port', '0'])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, ",".join(SERVER_PACKAGES)],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert "imported" in out.stdout, out.stderr
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert "cachekeeper serve" in last and "pip install 'cachekeeper[server]'" in last, last


def _copy_sources(dest: Path) -> Path:
    """What the wheel is built from, copied so the build leaves nothing in the checkout."""
    dest.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    for name in ("cachekeeper", "server", "client"):
        shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def _site_dirs() -> list[str]:
    """This interpreter's site folders, for the dependencies (their .pth files, the
    editable finder among them, are not run when they are listed in another .pth)."""
    return [
        p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)
    ]


@pytest.mark.slow
def test_wheel_imports_server_and_hook_from_the_repo_root_and_elsewhere(tmp_path: Path) -> None:
    src = _copy_sources(tmp_path / "src")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "-q",
            "-w",
            str(tmp_path / "dist"),
            ".",
        ],
        cwd=src,
        check=True,
        capture_output=True,
    )
    (wheel,) = (tmp_path / "dist").glob("cachekeeper-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    sources = {
        f"{prefix}{path.relative_to(src / folder).as_posix()}"
        for folder, prefix in [("cachekeeper", "cachekeeper/"), ("server", "cachekeeper/server/"),
                               ("client", "cachekeeper/client/")]
        for path in (src / folder).rglob("*.py")
    }  # fmt: skip
    assert "cachekeeper/server/app.py" in sources and "cachekeeper/client/prejob.py" in sources
    assert sorted(sources - set(names)) == []  # a new subpackage must be listed in pyproject
    assert not [n for n in names if n.startswith(("server/", "client/"))]
    # the status page's templates and script are package data (pyproject package-data)
    assets = {
        f"cachekeeper/server/{path.relative_to(src / 'server').as_posix()}"
        for pattern in ("templates/*.html", "static/*.js")
        for path in (src / "server").glob(pattern)
    }
    assert "cachekeeper/server/templates/index.html" in assets
    assert sorted(assets - set(names)) == []

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(site) / "deps.pth").write_text("\n".join(_site_dirs()) + "\n")

    code = (
        "import cachekeeper.server.app, cachekeeper.client.prejob, cachekeeper.cli\n"
        "from cachekeeper.cli import main\n"
        "print(cachekeeper.server.app.__file__)\n"
        "print(cachekeeper.client.prejob.__file__)\n"
        "try:\n    main(['prejob', '--help'])\nexcept SystemExit as exc:\n    assert exc.code == 0\n"
    )
    clean_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    for cwd, home in [(REPO, REPO), (tmp_path, Path(site))]:
        out = subprocess.run(
            [str(python), "-c", code], cwd=cwd, capture_output=True, text=True, env=clean_env
        )
        assert out.returncode == 0, f"from {cwd}: {out.stderr}"
        server_file, prejob_file = out.stdout.splitlines()[:2]
        # from the repo root Python imports the checkout (sys.path[0] is the cwd); elsewhere the wheel
        assert Path(server_file).is_relative_to(home), (cwd, server_file)
        assert Path(prejob_file).is_relative_to(home), (cwd, prejob_file)
        assert "Usage:" in out.stdout


def test_server_constraints_pin_every_dependency_within_pyproject() -> None:
    """deploy/constraints-server.txt (the server image's versions) pins each dependency of
    the base install and the server extra at a version pyproject.toml allows."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [Requirement(r) for r in project["dependencies"]]
    wanted += [Requirement(r) for r in project["optional-dependencies"]["server"]]
    pins: dict[str, str] = {}
    for line in (REPO / "deploy" / "constraints-server.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version.strip()
    assert "cachekeeper" not in pins
    for requirement in wanted:
        version = pins.get(canonicalize_name(requirement.name))
        assert version is not None, (
            f"{requirement.name} is not pinned: run deploy/constraints-server.sh"
        )
        assert requirement.specifier.contains(version), (
            f"{requirement.name}=={version} not in {requirement}"
        )
