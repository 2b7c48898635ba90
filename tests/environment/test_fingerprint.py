"""The fingerprint: collected without torch, canonical, compared field by field."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from cachekeeper.environment.fingerprint import (
    CpuState,
    Fingerprint,
    Gpu,
    collect,
    compare,
    describe_mismatch,
    digest_of,
    format_mismatches,
    is_compatible,
    parse,
    with_cpu,
)
from cachekeeper.errors import InvalidManifest

BASE = {
    "schema": 1,
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "cuda": "13.0",
    "cuda_wheels": {"nvidia-cublas": "13.0.1"},
    "driver": "580.159.04",
    "gpus": [{"index": 0, "name": "H200", "capability": "9.0"}],
    "python": "3.11",
    "arch": "x86_64",
    "env": {},
}


def test_collect_does_not_import_torch() -> None:
    code = (
        "import sys, json; from cachekeeper.environment.fingerprint import collect; fp = collect(); "
        "print(json.dumps({'torch_loaded': 'torch' in sys.modules, 'fp': fp}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    body = json.loads(out.stdout)
    assert body["torch_loaded"] is False
    assert body["fp"]["python"] == f"{sys.version_info.major}.{sys.version_info.minor}"
    assert body["fp"]["torch"]  # torch is installed here; its version comes from files


def test_digest_is_canonical() -> None:
    reordered = dict(reversed(list(BASE.items())))
    assert digest_of(BASE) == digest_of(reordered)
    assert digest_of(BASE) != digest_of({**BASE, "torch": "2.11.0+cu128"})


def test_env_overrides_and_compile_env() -> None:
    fp = collect(
        environ={
            "TORCHINDUCTOR_MAX_AUTOTUNE": "1",
            "TORCHINDUCTOR_CACHE_DIR": "/tmp/x",
            "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1",
            "OMP_NUM_THREADS": "1",
            "CACHEKEEPER_FINGERPRINT_OVERRIDES": json.dumps({"torch": "fake"}),
        }
    )
    assert fp["env"] == {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"}
    assert fp["cpu"]["threads"] == 1 and fp["cpu"]["threads_from"] == "OMP_NUM_THREADS=1"
    assert fp["torch"] == "fake"


def test_compare_is_exact_except_driver() -> None:
    assert compare(BASE, BASE) == []
    other = {**BASE, "torch": "2.11.0+cu128", "cuda": "12.8"}
    fields = [m.field for m in compare(other, BASE)]
    assert fields == ["torch", "cuda"]
    assert "torch 2.11.0+cu128 != 2.11.0+cu130" in format_mismatches(compare(other, BASE))


def test_driver_policies() -> None:
    newer = {**BASE, "driver": "590.1"}
    older = {**BASE, "driver": "570.1"}
    assert is_compatible(newer, BASE)
    assert [m.field for m in compare(older, BASE)] == ["driver"]
    assert not is_compatible(newer, BASE, driver_policy="exact")
    assert is_compatible(older, BASE, driver_policy="any")


def test_devices_must_be_covered() -> None:
    node = {**BASE, "gpus": [{"index": i, "name": "H200", "capability": "9.0"} for i in range(2)]}
    assert [m.field for m in compare(node, node, devices=["cuda:0"])] == ["devices"]
    assert compare(node, node, devices=["cuda:0"], node_devices=["cuda:0"]) == []
    cpu = {**BASE, "gpus": []}
    assert compare(cpu, cpu, devices=["cpu"]) == []


def test_a_node_with_more_gpus_than_the_builder_is_told_which_indices_and_what_to_do() -> None:
    # an 8-GPU node against a snapshot built on a 2-GPU builder (the node asks for every GPU)
    node = {**BASE, "gpus": [{"index": i, "name": "H200", "capability": "9.0"} for i in range(8)]}
    builder = {**BASE, "gpus": node["gpus"][:2]}
    (mismatch,) = compare(node, builder, devices=["cuda:0", "cuda:1"])
    assert mismatch.field == "devices"
    assert describe_mismatch(mismatch) == (
        "snapshot covers cuda:0,1; this node asks for cuda:0-7: cuda:2-7 never built (the"
        " device index is in Inductor's key): build cuda:2-7 on a builder with >= 8 GPUs"
        " (prewarm --device cuda:2-7), or run one visible GPU per rank (then only cuda:0 is"
        " needed)"
    )
    assert format_mismatches([mismatch]) == describe_mismatch(mismatch)
    # one visible GPU per rank: each rank asks for cuda:0 only, which the snapshot covers
    assert compare(node, builder, devices=["cuda:0", "cuda:1"], node_devices=["cuda:0"]) == []
    # a cache of index 0 alone, on a node that uses index 1
    (alone,) = compare(node, builder, devices=["cuda:0"], node_devices=["cuda:1"])
    advice = describe_mismatch(alone)
    assert "cuda:1 never built" in advice and ">= 2 GPUs" in advice


def test_the_tier_switches_in_torch_keys_are_recorded_and_its_url_and_other_switches_are_not() -> (
    None
):
    # The URL carries the node's token: it must never reach a manifest or a job report.
    fp = collect(
        environ={
            "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
            "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1",
            "TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE": "1",
            "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "0",
            "TORCHINDUCTOR_REDIS_URL": "redis://:secret-token@host:6379/0",
            "TORCHINDUCTOR_REDIS_HOST": "host",
            "TORCHINDUCTOR_REDIS_PORT": "6379",
        }
    )
    assert fp["env"] == {
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "0",
    }
    assert "secret-token" not in json.dumps(fp)


# -- the typed shape: parse ---------------------------------------------------------------

NEWER = {
    **BASE,
    "schema": 9,
    "gpus": [{"index": 0, "name": "H200", "capability": "9.0", "uuid": "GPU-1"}],
    "cpu": {"threads": 4, "threads_from": "x", "isa": None, "aten_cpu_capability": None, "n": 1},
    "compiler": {"cxx": "g++ 13"},
}


@pytest.mark.parametrize(
    "raw",
    [BASE, NEWER, {}, {"torch": "x"}, {"schema": 1}, {"x": {"y": [1, 2.5, None]}}],
    ids=["schema-1", "newer", "empty", "torch-only", "schema-only", "unknown-only"],
)
def test_parse_takes_old_partial_and_newer_fingerprints_as_they_are(raw: dict) -> None:
    sent = json.loads(json.dumps(raw))
    parsed = parse(sent)
    assert parsed is sent  # never copied or rebuilt: its digest is the one it came with
    assert digest_of(parsed) == digest_of(raw)


def test_this_machines_fingerprint_has_every_field_and_parses() -> None:
    fp = collect()
    assert set(fp) == set(Fingerprint.__annotations__)
    assert parse(json.loads(json.dumps(fp))) == fp


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        ([], "fingerprint is not an object"),
        ({"torch": 2.11}, "fingerprint field torch: expected a string or null, got float"),
        ({"schema": "2"}, "fingerprint field schema: expected an integer, got str"),
        ({"schema": True}, "fingerprint field schema: expected an integer, got bool"),
        ({"gpus": None}, "fingerprint field gpus: expected a list, got null"),
        ({"gpus": {"0": "H200"}}, "fingerprint field gpus: expected a list, got dict"),
        (
            {"gpus": [BASE["gpus"][0], {"index": "1", "name": "H200", "capability": "9.0"}]},
            "fingerprint field gpus[1].index: expected an integer, got str",
        ),
        ({"gpus": [{"index": 0, "capability": "9.0"}]}, "fingerprint field gpus[0].name: missing"),
        ({"gpus": ["H200"]}, "fingerprint field gpus[0]: expected an object, got str"),
        ({"env": {"TORCHINDUCTOR_MAX_AUTOTUNE": 1}}, "env.TORCHINDUCTOR_MAX_AUTOTUNE: expected a"),
        ({"cuda_wheels": ["nvidia-cublas"]}, "cuda_wheels: expected an object, got list"),
        ({"cpu": None}, "fingerprint field cpu: expected an object, got null"),
        ({"cpu": {**NEWER["cpu"], "threads": "4"}}, "cpu.threads: expected an integer, got str"),
        ({"cpu": {"threads": 4}}, "fingerprint field cpu.threads_from: missing"),
    ],
)
def test_parse_names_the_bad_field(raw: object, named: str) -> None:
    with pytest.raises(InvalidManifest, match=re.escape(named)):
        parse(raw)


def test_parse_checks_every_field_the_shape_declares() -> None:
    # a value no field may hold, in each declared field: refused, naming that field
    for field in Fingerprint.__annotations__:
        with pytest.raises(InvalidManifest, match=f"field {field}: expected"):
            parse({field: 1.5})
    for field in Gpu.__annotations__:
        gpu = {**BASE["gpus"][0], field: 1.5}
        with pytest.raises(InvalidManifest, match=re.escape(f"field gpus[0].{field}: expected")):
            parse({"gpus": [gpu]})
    for field in CpuState.__annotations__:
        state = {**NEWER["cpu"], field: 1.5}
        with pytest.raises(InvalidManifest, match=f"field cpu.{field}: expected"):
            parse({"cpu": state})


def test_with_cpu_is_a_new_fingerprint_with_that_state() -> None:
    state = {"threads": 1, "threads_from": "OMP_NUM_THREADS=1", "isa": None}
    state["aten_cpu_capability"] = None
    variant = with_cpu(BASE, state)
    assert variant == {**BASE, "cpu": state} and "cpu" not in BASE  # BASE itself unchanged
