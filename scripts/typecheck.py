"""The project's type check: mypy over cachekeeper/, server/ and client/ as ONE program.

    .venv/bin/python scripts/typecheck.py            # what scripts/test and test-fast run
    .venv/bin/python scripts/typecheck.py --no-incremental   # further arguments go to mypy

The wheel installs ``server/`` as ``cachekeeper.server`` and ``client/`` as
``cachekeeper.client`` (pyproject's ``[tool.setuptools] package-dir``). mypy names a file by
the folders above it (``server/app.py`` is ``server.app``) and has no setting that maps a
folder to another package name, so ``mypy cachekeeper server client`` checked three
programs: every ``cachekeeper.server.*`` or ``cachekeeper.client.*`` import found nothing and
was ``Any`` under ``ignore_missing_imports`` (a wrong call across that seam passed).

This runs mypy itself, its options read as ``mypy`` reads them (``[tool.mypy]``), on those
three folders, but gives each file the module name the wheel gives it, taken from
package-dir (the one source of that mapping): ``server/app.py`` is checked as
``cachekeeper.server.app``, so an import of that name is that file, and errors name the real
path (``server/app.py:12``). docs/architecture.md ("One program for the type checker") says
why neither mypy's search paths nor an installed copy was chosen.

It calls ``mypy.main.process_options`` and ``mypy.main.run_build`` (what ``mypy.main.main``
does, minus its options for other modes: install-types, parallel workers): mypy's command line has no way to name a file's module,
and ``mypy.api`` takes only that command line. pyproject bounds mypy to the releases whose
two functions were read; tests/test_typecheck.py runs this on a copy of the tree with a
wrong call across the seam.

Exit status as mypy's: 0 clean, 1 type errors, 2 a blocking error (a syntax error, say).
"""

from __future__ import annotations

import os
import sys
import time
import tomllib
from pathlib import Path

from mypy.defaults import RECURSION_LIMIT
from mypy.fscache import FileSystemCache
from mypy.main import process_options, run_build
from mypy.modulefinder import BuildSource
from mypy.util import FancyFormatter, count_stats

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path) -> dict[str, str]:
    """{folder: package} from pyproject's package-dir: ``{"server": "cachekeeper.server"}``."""
    with pyproject.open("rb") as f:
        mapping: dict[str, str] = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {os.path.normpath(folder): package for package, folder in mapping.items()}


def module_name(path: str, dirs: dict[str, str]) -> str | None:
    """The installed module name of ``path`` (relative to the root), or None outside ``dirs``.

    The deepest folder that holds it wins (a package-dir entry may map a subfolder).
    """
    parts = Path(os.path.normpath(path)).with_suffix("").parts
    for cut in range(len(parts) - 1, 0, -1):
        package = dirs.get(os.path.join(*parts[:cut]))
        if package is not None:
            rest = [p for p in parts[cut:] if p != "__init__"]
            return ".".join([package, *rest])
    return None


def main(argv: list[str]) -> int:
    os.chdir(ROOT)  # paths in errors are relative to the root: server/app.py:12
    sys.setrecursionlimit(RECURSION_LIMIT)  # as mypy's own main sets it
    dirs = package_dirs(ROOT / "pyproject.toml")
    fscache = FileSystemCache()
    sources, options = process_options(
        sorted(dirs) + argv, fscache=fscache, program="scripts/typecheck.py"
    )
    named = [
        BuildSource(s.path, module_name(s.path, dirs) or s.module, s.text, str(ROOT))
        if s.path is not None
        else s
        for s in sources
    ]
    _, messages, blockers = run_build(named, options, fscache, time.time(), sys.stdout, sys.stderr)
    formatter = FancyFormatter(sys.stdout, sys.stderr, options.hide_error_codes)
    n_errors, n_notes, n_files = count_stats(messages)
    color = options.color_output
    if n_errors:
        print(
            formatter.format_error(
                n_errors, n_files, len(named), blockers=blockers, use_color=color
            )
        )
    elif n_notes == len(messages):
        print(formatter.format_success(len(named), color))
    if messages and n_notes < len(messages):
        return 2 if blockers else 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
