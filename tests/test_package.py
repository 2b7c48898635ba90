"""Package-wide rules: no torch in the server/client/hook, help on every command, public API."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cachekeeper.cli import COMMANDS, cli


@pytest.mark.parametrize(
    "module",
    [
        "cachekeeper.server.app",
        "cachekeeper.client",
        "cachekeeper.cli.transfer",
        "cachekeeper.client.agent",
        "cachekeeper.cli.serve",
    ],
)
def test_server_and_client_never_import_torch(module: str) -> None:
    code = (
        f"import importlib, json, sys; importlib.import_module({module!r}); "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_prejob_help_does_not_import_torch() -> None:
    code = (
        "import sys\n"
        "from cachekeeper.cli import main\n"
        "try:\n    main(['prejob', '--help'])\nexcept SystemExit:\n    pass\n"
        "print('TORCH' if 'torch' in sys.modules else 'CLEAN')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("CLEAN")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_command_exists_and_has_help(name: str) -> None:
    result = CliRunner().invoke(cli, [name, "--help"])
    assert result.exit_code == 0, result.output
    assert "not available in this build" not in " ".join(result.output.split())
    usage_and_help = result.output.split("Options:")[0]
    assert len(usage_and_help.strip().splitlines()) >= 3, f"{name} has no help text"


def test_error_codes_are_unique_and_complete() -> None:
    from cachekeeper import errors

    classes = [getattr(errors, n) for n in errors.__all__ if isinstance(getattr(errors, n), type)]
    codes = [c.code for c in classes]
    assert len(codes) == len(set(codes))
    for cls in classes:
        assert errors.error_for_code(cls.code) is cls
        assert 400 <= cls.http_status < 600
    assert errors.error_for_code("no-such-code") is errors.ServerError
