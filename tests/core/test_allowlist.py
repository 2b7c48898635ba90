"""The agent's allowlist (cachekeeper/allowlist.py): what a builder agrees to run."""

from __future__ import annotations

from pathlib import Path

import pytest

from cachekeeper.allowlist import Allowlist
from cachekeeper.workload import parse_workload

CODE = """\
name = "w"
[[entrypoint]]
target = "mytrainer.warmup:step"
[[command]]
argv = ["torchrun", "--nproc-per-node", "2", "-m", "mytrainer.train"]
[[command]]
argv = ["/opt/venv/bin/python", "eval.py"]
"""


def _refused(*patterns: str) -> list[str]:
    workload = parse_workload(CODE, source="t.toml")
    return [ref.where for ref in Allowlist(patterns).refused(workload)]


def test_nothing_is_admitted_without_a_pattern() -> None:
    assert _refused() == ["entrypoint[0].target", "command[0].argv", "command[1].argv"]


def test_patterns_over_import_paths_argv0_and_whole_command_lines() -> None:
    assert _refused("mytrainer.*") == ["command[0].argv", "command[1].argv"]
    assert _refused("mytrainer.*", "torchrun", "/opt/venv/bin/*") == []
    # a whole command line pins the arguments too
    assert _refused("mytrainer.*", "torchrun * -m mytrainer.train", "/opt/venv/bin/*") == []
    assert _refused("mytrainer.*", "torchrun * -m other.train", "/opt/venv/bin/*") == [
        "command[0].argv"
    ]
    # argv[0] is matched as written: a bare name never admits another path to it
    assert _refused("*", "python") == []  # '*' admits everything, by choice
    assert "command[1].argv" in _refused("mytrainer.*", "torchrun", "python")
    assert _refused("mytrainer.warmup:step", "torchrun", "/opt/venv/bin/python") == []
    assert _refused("mytrainer", "torchrun", "/opt/venv/bin/python") == ["entrypoint[0].target"]


def test_a_workload_without_code_needs_no_pattern() -> None:
    plain = parse_workload(
        'name = "p"\n[[attention]]\nbatch = 1\nq_heads = 2\nhead_dim = 16\n'
        'seq_lens = [64]\ndtype = "float32"\nmask = "causal"\n',
        source="p.toml",
    )
    assert Allowlist().refused(plain) == ()


def test_files_explain_and_bad_input(tmp_path: Path) -> None:
    listed = tmp_path / "allow"
    listed.write_text("# the team's launchers\nmytrainer.*  # our code\n\ntorchrun\n")
    allow = Allowlist.load(["/opt/venv/bin/*"], [listed])
    assert allow.patterns == ("/opt/venv/bin/*", "mytrainer.*", "torchrun")
    workload = parse_workload(CODE, source="t.toml")
    assert allow.refused(workload) == ()
    line = Allowlist().explain(Allowlist().refused(workload))
    assert line.startswith("refused: entrypoint[0].target import path 'mytrainer.warmup:step'")
    assert "(and 2 more)" in line and "agent --allow 'mytrainer.warmup:step'" in line
    with pytest.raises(ValueError, match="cannot read it"):
        Allowlist.load([], [tmp_path / "missing"])
    with pytest.raises(ValueError, match="empty pattern"):
        Allowlist.load([" "])
