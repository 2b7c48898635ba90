"""Workload files: parsing and every validation error (no compiles)."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from cachekeeper.builder.workload import load_workload, parse_workload
from cachekeeper.errors import WorkloadInvalid

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "workloads"

BASE = """\
name = "w"
[[attention]]
batch = 1
q_heads = 4
kv_heads = 2
head_dim = 16
seq_lens = [128]
dtype = "float32"
"""


def _with(extra: str = "", *, drop: str | None = None, replace: tuple[str, str] | None = None):
    text = BASE
    if drop:
        text = "\n".join(line for line in text.splitlines() if not line.startswith(drop)) + "\n"
    if replace:
        text = text.replace(*replace)
    return text + extra


def _error(text: str) -> str:
    with pytest.raises(WorkloadInvalid) as info:
        parse_workload(text, source="t.toml")
    assert info.value.exit_code == 2
    return str(info.value)


def test_examples_parse() -> None:
    gqa = load_workload(EXAMPLES / "gqa-doc-causal.toml")
    assert gqa.name == "gqa-doc-causal"
    (regime,) = gqa.specs("attention")
    assert (regime.batch, regime.q_heads, regime.kv_heads, regime.head_dim) == (1, 32, 8, 128)
    assert regime.seq_lens == (4096, 8192)
    assert regime.mask == "document_causal" and regime.mask_args == {"doc_len": 1024}
    assert regime.dtype == "bfloat16" and regime.backward and regime.enable_gqa
    assert regime.compile == {"dynamic": False}
    drafter = load_workload(EXAMPLES / "drafter.toml")
    masks = {r.mask for r in drafter.specs("attention")}
    assert {"sliding_window", "causal"} <= masks
    assert any(r.score_mod == "softcap" for r in drafter.specs("attention"))
    tiny = load_workload(EXAMPLES / "cpu-tiny.toml")
    assert (
        tiny.specs("attention")[0].dtype == "float32" and tiny.specs("attention")[0].head_dim == 16
    )


def test_digest_is_sha256_of_text_and_defaults() -> None:
    w = parse_workload(BASE, source="t.toml")
    assert w.digest == hashlib.sha256(BASE.encode()).hexdigest()
    assert w.text == BASE
    r = w.specs("attention")[0]
    assert (r.mask, r.score_mod, r.backward, r.compile, r.kernel_options) == (
        "none",
        "none",
        True,
        {},
        None,
    )
    no_kv = parse_workload(_with(drop="kv_heads"), source="t.toml").specs("attention")[0]
    assert no_kv.kv_heads == no_kv.q_heads and not no_kv.enable_gqa


def test_the_gqa_error_message_names_file_table_and_field() -> None:
    text = _with(replace=("q_heads = 4\nkv_heads = 2", "q_heads = 32\nkv_heads = 5"))
    assert (
        _error(text)
        == "t.toml: attention[0].kv_heads: q_heads (32) must be a multiple of kv_heads (5)"
    )


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name = [", "t.toml: not valid TOML"),
        (BASE.replace('name = "w"\n', ""), "t.toml: name: required field is missing"),
        (BASE.replace('name = "w"', "name = 3"), "t.toml: name: expected a string, got an integer"),
        (BASE.replace('name = "w"', 'name = "a/b"'), "t.toml: name: 'a/b' is not a valid"),
        ('name = "w"\n', "t.toml: a workload needs at least one"),
        (BASE + "colour = 1\n", "t.toml: attention[0].colour: unknown key"),
        ('name = "w"\nextra = 1\n', "t.toml: extra: unknown key"),
        ('name = "w"\nattention = 3\n', "t.toml: attention: must be an array of tables"),
        (_with(drop="batch"), "t.toml: attention[0].batch: required field is missing"),
        (
            _with(replace=("batch = 1", 'batch = "1"')),
            "attention[0].batch: expected an integer, got a string",
        ),
        (
            _with(replace=("batch = 1", "batch = true")),
            "attention[0].batch: expected an integer, got a boolean",
        ),
        (_with(replace=("batch = 1", "batch = 1.5")), "attention[0].batch: expected an integer"),
        (
            _with(replace=("batch = 1", "batch = 0")),
            "attention[0].batch: must be a positive integer, got 0",
        ),
        (
            _with(replace=("q_heads = 4", "q_heads = -4")),
            "attention[0].q_heads: must be a positive integer",
        ),
        (
            _with(replace=("kv_heads = 2", "kv_heads = 0")),
            "attention[0].kv_heads: must be a positive integer",
        ),
        (
            _with(replace=("head_dim = 16", "head_dim = 8")),
            "attention[0].head_dim: flex_attention needs head_dim >= 16, got 8",
        ),
        (
            _with(replace=("head_dim = 16", "head_dim = 0")),
            "attention[0].head_dim: must be a positive integer",
        ),
        (
            _with(replace=("seq_lens = [128]", "seq_lens = []")),
            "attention[0].seq_lens: must list at least one",
        ),
        (
            _with(replace=("seq_lens = [128]", "seq_lens = 128")),
            "attention[0].seq_lens: expected an array",
        ),
        (
            _with(replace=("seq_lens = [128]", "seq_lens = [128, 0]")),
            "attention[0].seq_lens[1]: must be a positive integer, got 0",
        ),
        (
            _with(replace=("seq_lens = [128]", 'seq_lens = ["x"]')),
            "attention[0].seq_lens[0]: expected an integer",
        ),
        (_with(drop="dtype"), "attention[0].dtype: required field is missing"),
        (
            _with(replace=('"float32"', '"float64"')),
            "attention[0].dtype: unknown dtype 'float64' (allowed: float32, float16, bfloat16)",
        ),
        (_with('mask = "diagonal"\n'), "attention[0].mask: unknown mask 'diagonal'"),
        (_with("mask = 1\n"), "attention[0].mask: expected a string"),
        (
            _with('mask = "sliding_window"\n'),
            "attention[0].mask_args.window: 'sliding_window' requires this argument",
        ),
        (
            _with('mask = "document_causal"\n'),
            "attention[0].mask_args.doc_len: 'document_causal' requires this argument",
        ),
        (
            _with('mask = "prefix_lm"\n'),
            "attention[0].mask_args.prefix_len: 'prefix_lm' requires this argument",
        ),
        (
            _with('mask = "causal"\nmask_args = { window = 3 }\n'),
            "attention[0].mask_args.window: unknown argument for 'causal'",
        ),
        (
            _with('mask = "sliding_window"\nmask_args = { window = 0 }\n'),
            "attention[0].mask_args.window: must be a positive integer",
        ),
        (
            _with('mask = "sliding_window"\nmask_args = { window = "8" }\n'),
            "attention[0].mask_args.window: expected an integer",
        ),
        (
            _with('mask = "document_causal"\nmask_args = { doc_len = -1 }\n'),
            "attention[0].mask_args.doc_len: must be a positive integer",
        ),
        (
            _with('mask = "prefix_lm"\nmask_args = { prefix_len = -1 }\n'),
            "attention[0].mask_args.prefix_len: must be >= 0",
        ),
        (_with('mask = "causal"\nmask_args = 3\n'), "attention[0].mask_args: expected a table"),
        (_with('score_mod = "relu"\n'), "attention[0].score_mod: unknown score_mod 'relu'"),
        (
            _with('score_mod = "softcap"\n'),
            "attention[0].score_args.cap: 'softcap' requires this argument",
        ),
        (
            _with('score_mod = "softcap"\nscore_args = { cap = 0 }\n'),
            "attention[0].score_args.cap: must be positive",
        ),
        (
            _with('score_mod = "softcap"\nscore_args = { cap = "30" }\n'),
            "attention[0].score_args.cap: expected a number",
        ),
        (
            _with('score_mod = "alibi"\nscore_args = { slope = 1 }\n'),
            "attention[0].score_args.slope: unknown argument for 'alibi'",
        ),
        (_with('mask = "my.mod:"\n'), "attention[0].mask: 'my.mod:' is not an import path"),
        (_with('score_mod = "1pkg:f"\n'), "attention[0].score_mod: '1pkg:f' is not an import path"),
        (_with("backward = 1\n"), "attention[0].backward: expected a boolean, got an integer"),
        (
            _with("compile = { dynamic = false, bogus = 1 }\n"),
            "attention[0].compile.bogus: not a torch.compile option",
        ),
        (
            _with('compile = { dynamic = "no" }\n'),
            "attention[0].compile.dynamic: expected a boolean",
        ),
        (_with("compile = 3\n"), "attention[0].compile: expected a table"),
        (_with("kernel_options = 3\n"), "attention[0].kernel_options: expected a table"),
        (
            _with("kernel_options = { BLOCK_M = [1] }\n"),
            "attention[0].kernel_options.BLOCK_M: expected a number",
        ),
        (
            'name = "w"\n[[entrypoint]]\nkwargs = {}\n',
            "t.toml: entrypoint[0].target: required field is missing",
        ),
        (
            'name = "w"\n[[entrypoint]]\ntarget = "warmup.step"\n',
            "entrypoint[0].target: 'warmup.step' is not an import path",
        ),
        (
            'name = "w"\n[[entrypoint]]\ntarget = "a.b:c"\nkwargs = 1\n',
            "entrypoint[0].kwargs: expected a table",
        ),
        (
            'name = "w"\n[[entrypoint]]\ntarget = "a.b:c"\nargs = []\n',
            "entrypoint[0].args: unknown key",
        ),
    ],
)
def test_validation_errors(text: str, expected: str) -> None:
    message = _error(text)
    assert expected in message, message
    assert "\n" not in message


def test_second_table_is_named_by_its_index() -> None:
    text = BASE + BASE.split("\n", 1)[1].replace('dtype = "float32"', 'dtype = "int8"')
    assert "t.toml: attention[1].dtype: unknown dtype 'int8'" in _error(text)


def test_valid_variants_parse() -> None:
    text = _with(
        'mask = "pkg.masks:make"\nmask_args = { anything = [1, 2] }\n'
        'score_mod = "alibi"\nbackward = false\n'
        'compile = { dynamic = true, fullgraph = true, mode = "max-autotune-no-cudagraphs" }\n'
        "kernel_options = { BLOCK_M = 64, FORCE_USE_FLEX_ATTENTION = true }\n"
        '[[entrypoint]]\ntarget = "my_trainer.warmup:Step.run"\nkwargs = { seq_len = 4096 }\n'
    )
    w = parse_workload(text, source="t.toml")
    r = w.specs("attention")[0]
    assert r.mask == "pkg.masks:make" and r.mask_args == {"anything": [1, 2]}
    assert r.kernel_options == {"BLOCK_M": 64, "FORCE_USE_FLEX_ATTENTION": True}
    assert w.specs("entrypoint")[0].target == "my_trainer.warmup:Step.run"
    assert w.specs("entrypoint")[0].kwargs == {"seq_len": 4096}
    # non-power-of-two head dims are padded by Inductor and accepted
    assert parse_workload(_with(replace=("head_dim = 16", "head_dim = 80")), source="t").specs(
        "attention"
    )


def test_load_workload_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(WorkloadInvalid, match="cannot read workload file"):
        load_workload(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"\xff\xfe")
    with pytest.raises(WorkloadInvalid, match="bad.toml: workload file is not valid UTF-8"):
        load_workload(bad)


def test_parser_and_mods_import_no_torch() -> None:
    code = (
        "import sys, cachekeeper.builder.workload, cachekeeper.mods, cachekeeper.builder.prewarm, "
        "cachekeeper.builder.verify, cachekeeper.builder.verdicts, cachekeeper.environment.devices, cachekeeper.builder.children, "
        "cachekeeper.cli.prewarm, cachekeeper.cli.verify\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


CMD = 'name = "w"\n[[command]]\n'


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (CMD + "cwd = '/x'\n", "t.toml: command[0].argv: required field is missing"),
        (CMD + "argv = []\n", "command[0].argv: must name at least the program to run"),
        (CMD + "argv = 'torchrun'\n", "command[0].argv: expected an array, got a string"),
        (CMD + "argv = ['torchrun', 3]\n", "command[0].argv[1]: expected a string"),
        (CMD + "argv = [' ']\n", "command[0].argv[0]: the program to run is empty"),
        (CMD + "argv = ['a']\nshell = true\n", "command[0].shell: unknown key"),
        (CMD + "argv = ['a']\nenv = ['A=1']\n", "command[0].env: expected a table"),
        (CMD + "argv = ['a']\nenv = { 'A-B' = '1' }\n", "command[0].env.A-B: not a valid"),
        (CMD + "argv = ['a']\nenv = { A = 1.5 }\n", "command[0].env.A: expected a string"),
        (
            CMD + "argv = ['a']\nenv = { TORCHINDUCTOR_CACHE_DIR = '/tmp/x' }\n",
            "command[0].env.TORCHINDUCTOR_CACHE_DIR: cannot be set by a workload: prewarm",
        ),
        (
            CMD + "argv = ['a']\nenv = { TRITON_CACHE_DIR = '/tmp/x' }\n",
            "command[0].env.TRITON_CACHE_DIR: cannot be set by a workload",
        ),
        (CMD + "argv = ['a']\ncwd = ''\n", "command[0].cwd: must be a directory path"),
        (CMD + "argv = ['a']\ntimeout = 'soon'\n", "command[0].timeout: 'soon' is not a duration"),
        (CMD + "argv = ['a']\ntimeout = -5\n", "command[0].timeout: -5 is not a positive"),
        (CMD + "argv = ['a']\n[[command]]\n", "t.toml: command[1].argv: required field"),
        ('name = "w"\n', "needs at least one [[attention]], [[entrypoint]] or [[command]]"),
    ],
)
def test_command_validation_errors(text: str, expected: str) -> None:
    message = _error(text)
    assert expected in message, message
    assert "\n" not in message


def test_commands_parse_alone_or_beside_other_tables() -> None:
    text = (
        CMD + 'argv = ["torchrun", "--nproc-per-node", "8", "-m", "titan.train"]\n'
        'env = { WANDB_MODE = "disabled", NCCL_DEBUG_LEVEL = 1 }\ncwd = "/srv/t"\n'
        'timeout = "30m"\n[[command]]\nargv = ["python", "eval.py"]\ntimeout = 90\n'
    )
    w = parse_workload(text, source="t.toml")
    first, second = w.specs("command")
    assert first.argv == ("torchrun", "--nproc-per-node", "8", "-m", "titan.train")
    assert first.env == {"WANDB_MODE": "disabled", "NCCL_DEBUG_LEVEL": "1"}  # ints as text
    assert (first.cwd, first.timeout_s) == ("/srv/t", 1800.0)
    assert (second.env, second.cwd, second.timeout_s) == ({}, None, 90.0)
    assert first.describe() == "torchrun --nproc-per-node 8 -m titan.train"
    assert w.specs("attention") == () and w.specs("entrypoint") == ()
    mixed = parse_workload(BASE + '[[command]]\nargv = ["a b", "c"]\n', source="t.toml")
    assert len(mixed.specs("attention")) == 1 and mixed.specs("command")[0].describe() == "'a b' c"


def test_code_lists_every_import_path_and_command() -> None:
    """What the server asks the admin scope for and the agent's allowlist must admit."""
    text = _with(
        'mask = "pkg.masks:make"\n[[entrypoint]]\ntarget = "trainer.warmup:step"\n'
        '[[command]]\nargv = ["torchrun", "-m", "trainer.train"]\n'
    )
    refs = parse_workload(text, source="t.toml").code
    assert [(r.form, r.value, r.where, r.argv0) for r in refs] == [
        ("import", "pkg.masks:make", "attention[0].mask", ""),
        ("import", "trainer.warmup:step", "entrypoint[0].target", ""),
        ("command", "torchrun -m trainer.train", "command[0].argv", "torchrun"),
    ]
    assert parse_workload(_with('mask = "causal"\n'), source="t.toml").code == ()  # built-in
