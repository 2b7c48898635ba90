"""The agent's allowlist (cachekeeper/builder/allowlist.py): what a builder agrees to run.

Programs here are real files in tmp_path (the allowlist resolves them); nothing runs. The
walk-arounds of issue 32 (an argument-spanning ``*``, ``..`` in argv[0], loader variables,
an import path to an object the module only imports) are in
tests/hardening/test_allowlist_walkarounds.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cachekeeper.builder.allowlist import Allowlist, check_defined, is_loader_variable
from cachekeeper.builder.programs import program_path
from cachekeeper.builder.workload import parse_workload
from cachekeeper.errors import WorkloadInvalid


def _bin(tmp_path: Path, *names: str) -> Path:
    folder = tmp_path / "venv" / "bin"
    folder.mkdir(parents=True, exist_ok=True)
    for name in names:
        path = folder / name
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return folder


def _workload(*tables: str) -> str:
    return 'name = "w"\n' + "\n".join(tables)


def _command(argv: list[str], extra: str = "") -> str:
    quoted = ", ".join(f'"{a}"' for a in argv)
    return f"[[command]]\nargv = [{quoted}]\n{extra}"


def _why(allow: Allowlist, text: str) -> list[str]:
    return [r.why for r in allow.refused(parse_workload(text, source="t.toml"))]


def test_nothing_is_admitted_without_an_entry(tmp_path: Path) -> None:
    bin_ = _bin(tmp_path, "torchrun")
    text = _workload(
        '[[entrypoint]]\ntarget = "mytrainer.warmup:step"\n', _command([f"{bin_}/torchrun"])
    )
    refused = Allowlist().refused(parse_workload(text, source="t.toml"))
    assert [r.ref.where for r in refused] == ["entrypoint[0].target", "command[0].argv"]


def test_arguments_are_matched_one_by_one(tmp_path: Path) -> None:
    torchrun = _bin(tmp_path, "torchrun") / "torchrun"
    allow = Allowlist.load([f"{torchrun} --nproc-per-node [1-8] -m mytrainer.train ..."])
    ok = _command([str(torchrun), "--nproc-per-node", "2", "-m", "mytrainer.train", "--steps"])
    assert _why(allow, _workload(ok)) == []
    wrong = _command([str(torchrun), "--nproc-per-node", "16", "-m", "mytrainer.train"])
    assert _why(allow, _workload(wrong)) == ["argument 2 '16' does not match '[1-8]'"]
    exact = Allowlist.load([f"{torchrun} -m mytrainer.train"])  # no '...': nothing further
    more = _command([str(torchrun), "-m", "mytrainer.train", "--x"])
    assert _why(exact, _workload(more)) == [
        f"it has 3 argument(s); --allow '{torchrun} -m mytrainer.train' takes exactly 2"
    ]


def test_the_program_is_its_real_folder_and_its_own_name(tmp_path: Path) -> None:
    bin_ = _bin(tmp_path, "torchrun")
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "linked").symlink_to(real)  # a folder link
    (real / "python").symlink_to("/bin/sh")  # a venv's python is a link: its own name counts
    assert program_path("python", cwd="/", path=str(tmp_path / "linked")) == str(real / "python")
    assert program_path("./x", cwd=str(tmp_path / "linked"), path=None) == str(real / "x")
    allow = Allowlist.load([f"{tmp_path / 'linked'}/* ..."])
    assert _why(allow, _workload(_command([str(tmp_path / "linked" / "python"), "-c", "1"]))) == []
    # a bare name in an entry is looked up on the agent's PATH when the allowlist loads
    os.environ["PATH"], saved = f"{bin_}{os.pathsep}{os.environ['PATH']}", os.environ["PATH"]
    try:
        assert Allowlist.load(["torchrun ..."]).commands[0].program == str(bin_ / "torchrun")
        with pytest.raises(ValueError, match="'no-such-launcher' is not on this builder's PATH"):
            Allowlist.load(["no-such-launcher"])
    finally:
        os.environ["PATH"] = saved


def test_env_and_cwd_are_part_of_an_entry(tmp_path: Path) -> None:
    torchrun = _bin(tmp_path, "torchrun") / "torchrun"
    srv = tmp_path / "srv"
    srv.mkdir()
    entry = tmp_path / "allow.toml"
    entry.write_text(
        f'[[command]]\nprogram = "{torchrun}"\nargs = ["train.py"]\n'
        f'env = {{ WANDB_MODE = "disabled", "NCCL_*" = "*", PYTHONPATH = "{srv}" }}\n'
        f'cwd = "{srv}"\n'
    )
    allow = Allowlist.load([], [entry])
    base = [str(torchrun), "train.py"]
    good = 'env = { WANDB_MODE = "disabled", NCCL_DEBUG = "INFO" }\n' + f'cwd = "{srv}"\n'
    assert _why(allow, _workload(_command(base, good))) == []
    assert _why(allow, _workload(_command(base, f'env = {{ PYTHONPATH = "{srv}" }}\n'))) == []
    assert _why(allow, _workload(_command(base, 'env = { WANDB_MODE = "online" }\n'))) == [
        "env WANDB_MODE='online' does not match 'disabled'"
    ]
    # a loader variable is admitted only by its exact name, never by a glob like NCCL_*
    assert _why(allow, _workload(_command(base, 'env = { NCCL_NET_PLUGIN = "x" }\n'))) == [
        "env NCCL_NET_PLUGIN is not admitted (a loader variable: only an entry that names it"
        " exactly admits it)"
    ]
    assert _why(allow, _workload(_command(base, 'cwd = "/tmp"\n'))) == [
        f"cwd {os.path.realpath('/tmp')} is not admitted ({srv})"
    ]
    # a short --allow line admits no env and no cwd
    short = Allowlist.load([f"{torchrun} train.py"])
    assert _why(short, _workload(_command(base, 'env = { WANDB_MODE = "disabled" }\n'))) == [
        "env WANDB_MODE is not admitted"
    ]


def test_loader_variables() -> None:
    for name in ("LD_PRELOAD", "PYTHONWARNINGS", "BROWSER", "PATH", "PYTHONPATH", "GCONV_PATH"):
        assert is_loader_variable(name), name
    for name in ("WANDB_MODE", "NCCL_DEBUG", "OMP_NUM_THREADS"):
        assert not is_loader_variable(name), name


def test_short_lines_files_and_bad_entries(tmp_path: Path) -> None:
    torchrun = _bin(tmp_path, "torchrun") / "torchrun"
    listed = tmp_path / "allow"
    listed.write_text(f"# the team's launchers\nmytrainer.*  # our code\n\n{torchrun} ...\n")
    allow = Allowlist.load(["other.mod:make"], [listed])
    assert [(r.module, r.attribute) for r in allow.imports] == [
        ("other.mod", "make"),
        ("mytrainer.*", "*"),
    ]
    assert allow.commands[0].rest == "*" and allow.commands[0].source == f"{listed}:4"
    workload = parse_workload(
        _workload('[[entrypoint]]\ntarget = "elsewhere.warmup:step"\n'), source="t.toml"
    )
    line = allow.explain(allow.refused(workload))
    assert line == (
        "refused: entrypoint[0].target import path 'elsewhere.warmup:step' is not on this"
        " builder's allowlist (3 entries): no import entry matches it; its operator can admit"
        " it with agent --allow 'elsewhere.warmup:step'"
    )
    with pytest.raises(ValueError, match="cannot read it"):
        Allowlist.load([], [tmp_path / "missing"])
    with pytest.raises(ValueError, match="empty entry"):
        Allowlist.load([" "])
    with pytest.raises(ValueError, match="'\\*' no longer admits everything"):
        Allowlist.load(["*"])
    with pytest.raises(ValueError, match="'...' \\(any further arguments\\) may only come last"):
        Allowlist.load([f"{torchrun} ... -m x"])
    bad = tmp_path / "bad.toml"
    for text, message in (
        ("[[command]]\nargs = []\n", "command\\[0\\].program: required"),
        (f'[[command]]\nprogram = "{torchrun}"\nargz = []\n', "command\\[0\\].argz: unknown key"),
        (f'[[command]]\nprogram = "{torchrun}"\ncwd = "rel"\n', "'rel' is not an absolute path"),
        ('imports = ["a b"]\n', "imports\\[0\\]: 'a b' is not an import pattern"),
        ("allow = 1\n", "unknown key 'allow'"),
        ("[[command]\n", "not valid TOML"),
    ):
        bad.write_text(text)
        with pytest.raises(ValueError, match=message):
            Allowlist.load([], [bad])


def test_a_workload_without_code_needs_no_entry() -> None:
    plain = parse_workload(
        'name = "p"\n[[attention]]\nbatch = 1\nq_heads = 2\nhead_dim = 16\n'
        'seq_lens = [64]\ndtype = "float32"\nmask = "causal"\n',
        source="p.toml",
    )
    assert Allowlist().refused(plain) == ()


def test_check_defined_reads_the_source_without_importing_it(tmp_path: Path) -> None:
    pkg = tmp_path / "trainerpkg"
    pkg.mkdir()
    marker = tmp_path / "imported"
    (pkg / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    (pkg / "warmup.py").write_text(
        "import os\nfrom os import system\nalias = os.system\n"
        "def step():\n    pass\nclass Masks:\n    def causal(self):\n        pass\n"
    )
    search = [str(tmp_path)]
    check_defined("trainerpkg.warmup:step", field="f", search_path=search)
    check_defined("trainerpkg.warmup:Masks.causal", field="f", search_path=search)
    for target in ("os.system", "system", "alias", "Masks.missing"):
        with pytest.raises(WorkloadInvalid, match="is not defined in trainerpkg.warmup"):
            check_defined(f"trainerpkg.warmup:{target}", field="f", search_path=search)
    with pytest.raises(WorkloadInvalid, match="module 'trainerpkg.nothere' is not found"):
        check_defined("trainerpkg.nothere:step", field="f", search_path=search)
    assert not marker.exists()  # the package's __init__ never ran
