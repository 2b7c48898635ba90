"""Fingerprint digests are pinned: literals, never recomputed by the code under test.

Two digests of a fingerprint, each naming things that must not move by accident:

- ``json_digest`` (``EXPECTED``): the sha256 of the whole canonical JSON, the manifest's
  ``fingerprint_digest`` key, so every snapshot id (``MANIFEST_IDS``). Computed on main at
  7a8883a (before ``cachekeeper.environment.fingerprint`` had a typed shape) and unchanged since.
- ``digest_of`` (``IDENTITY``): the environment's identity, which status rows, agent ids,
  job reports and the hook's default cache dir (``<home>/inductor/<digest[:16]>``) are
  named by. Issue 31 moved it, deliberately: it leaves out provenance (``cpu.threads_from``,
  where the thread count came from), since a node that exported ``OMP_NUM_THREADS=1`` by
  hand and the torchrun ranks that built its snapshot compile the same kernels, yet had two
  digests, and the status counted the node's restores in no row (docs/snapshots.md). The
  values were computed once at that change; a fingerprint without provenance (schema 1)
  keeps its digest. A change that moves one again is a contract change, not a test to update.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from cachekeeper import config, remote_tier
from cachekeeper.environment import cpu
from cachekeeper.environment.fingerprint import (
    canonical_json,
    collect,
    digest_of,
    json_digest,
    parse,
)
from cachekeeper.snapshot.manifest import FileEntry, Manifest

# This dev VM's ``collect(environ={})`` at 7a8883a (torch 2.13.0+cpu, no GPU, schema 2).
DEV_VM: dict[str, Any] = {
    "arch": "x86_64",
    "cpu": {
        "aten_cpu_capability": None,
        "isa": "avx512",
        "threads": 2,
        "threads_from": "2 cpus this process may use",
    },
    "cuda": None,
    "cuda_wheels": {},
    "driver": None,
    "env": {},
    "gpus": [],
    "python": "3.11",
    "schema": 2,
    "torch": "2.13.0+cpu",
    "triton": None,
}

# An 8-GPU builder: CUDA wheels, a driver, GPUs in CUDA_VISIBLE_DEVICES order, compile env.
GPU_BUILDER: dict[str, Any] = {
    "schema": 2,
    "torch": "2.11.0+cu130",
    "triton": "3.6.0",
    "cuda": "13.0",
    "cuda_wheels": {
        "nvidia-cublas": "13.0.2.14",
        "nvidia-cuda-nvrtc": "13.0.88",
        "nvidia-cudnn-cu13": "9.13.0.50",
        "nvidia-nvjitlink": "13.0.88",
    },
    "driver": "580.159.04",
    "gpus": [{"index": i, "name": "NVIDIA H200", "capability": "9.0"} for i in range(8)],
    "python": "3.12",
    "arch": "x86_64",
    "env": {"TORCHINDUCTOR_MAX_AUTOTUNE": "1", "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE": "1"},
    "cpu": {
        "threads": 1,
        "threads_from": "OMP_NUM_THREADS=1",
        "isa": "amx",
        "aten_cpu_capability": None,
    },
}

# Schema 1 (before the ``cpu`` field): what every manifest made before issue 17 holds.
SCHEMA_1: dict[str, Any] = {
    "schema": 1,
    "torch": "2.11.0+cu128",
    "triton": "3.5.1",
    "cuda": "12.8",
    "cuda_wheels": {"nvidia-cublas-cu12": "12.8.4.1"},
    "driver": "570.172.08",
    "gpus": [{"index": 0, "name": "NVIDIA H100 80GB HBM3", "capability": "9.0"}],
    "python": "3.11",
    "arch": "aarch64",
    "env": {},
}

# A node of a site that serves the per-key tier: the switches in torch's keys are in ``env``.
REMOTE_TIER: dict[str, Any] = {
    **DEV_VM,
    "env": {
        "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE": "1",
        "TORCHINDUCTOR_BUNDLED_AUTOTUNE_REMOTE_CACHE": "0",
    },
}

# From a newer cachekeeper: fields this one does not know, at the top and inside the
# known ones, and text outside ASCII (the canonical JSON keeps it as UTF-8, unescaped).
NEWER: dict[str, Any] = {
    **GPU_BUILDER,
    "schema": 3,
    "gpus": [{"index": 0, "name": "NVIDIA GH200 480GB", "capability": "9.0", "uuid": "GPU-1"}],
    "cpu": {**GPU_BUILDER["cpu"], "numa_nodes": 2},
    "compiler": {"cxx": "g++ 13.2", "note": "größer"},
}

EXPECTED = {  # name: the sha256 of its canonical JSON, i.e. its digest
    "dev_vm": "9b373af98accd3043f244c4e4da81242e6fd91e92e6b7c3e4d5c5fa3e6f38f6a",
    "gpu_builder": "6807c51c6e0c7d4738927ff798075c5aa748185f3eb1fcb254cc0a0e4b1dc45e",
    "schema_1": "ca13c0705d8fec47dde2c168b5810f1d6050ddc27311898ff0df73edc6e1822c",
    "remote_tier": "83cd7062d332ed71688364ba959614ccb86247fd9449cc0e2d4a6e06844d7975",
    "newer": "f6014028453316a2e755d9f3aeadc1f708829fbce625c78adbb44d49adea2d65",
}
IDENTITY = {  # name: digest_of, without provenance (issue 31)
    "dev_vm": "064de82a3904a57c5268279c12ae1b6fd2616d7d5b12e485402c1b61b0bb3466",
    "gpu_builder": "7df90337fd0e0dd79c031c04928e647b45688fae1d930d00ec3bb3733b3979c7",
    "schema_1": "ca13c0705d8fec47dde2c168b5810f1d6050ddc27311898ff0df73edc6e1822c",
    "remote_tier": "10d12469c4b8c9ab726f6f556c1840839e6120adf953b49362aaf3057b634adf",
    "newer": "581882d177c41a74e7db58142d8352e9f87ba47ac6c1fb9a53f6f080ac5ebbc7",
}
FINGERPRINTS = {
    "dev_vm": DEV_VM,
    "gpu_builder": GPU_BUILDER,
    "schema_1": SCHEMA_1,
    "remote_tier": REMOTE_TIER,
    "newer": NEWER,
}
# The id of a one-file manifest holding each fingerprint (a snapshot id on a server).
MANIFEST_IDS = {
    "gpu_builder": "144d7eb4ca41f4aeb586ad34f276ee6f467f611fd717aa04a3138d813ed2ed2a",
    "schema_1": "99b0160d0bb4ccb002b72ae7177460ff9e05f800f8f30b3c6d27c84098fd553b",
    "newer": "45fa40f19d136ecc507a0c60ba56a72d61be954bb4564ffe64a48e5011fb2c32",
}


@pytest.mark.parametrize("name", sorted(FINGERPRINTS))
def test_the_digest_of_each_fingerprint_is_pinned(name: str) -> None:
    fp = FINGERPRINTS[name]
    assert hashlib.sha256(canonical_json(fp).encode()).hexdigest() == EXPECTED[name]
    assert json_digest(fp) == EXPECTED[name]
    assert digest_of(fp) == IDENTITY[name]
    # as a manifest or a request body carries it: JSON text, decoded again, and parsed
    assert digest_of(json.loads(json.dumps(fp))) == IDENTITY[name]
    assert digest_of(parse(json.loads(json.dumps(fp)))) == IDENTITY[name]
    assert json_digest(parse(json.loads(json.dumps(fp)))) == EXPECTED[name]


@pytest.mark.parametrize("name", sorted(FINGERPRINTS))
def test_provenance_is_in_no_identity(name: str) -> None:
    fp = FINGERPRINTS[name]
    if "cpu" not in fp:  # schema 1: nothing to leave out, the two digests agree
        assert digest_of(fp) == json_digest(fp)
        return
    # where the same thread count came from does not change the environment ...
    for source in ("OMP_NUM_THREADS=1", "MKL_NUM_THREADS=1", "1 cpus this process may use"):
        assert digest_of({**fp, "cpu": {**fp["cpu"], "threads_from": source}}) == IDENTITY[name]
    # ... and every value does, the compared ones and one this version does not know
    for changed in ({"threads": 7}, {"isa": "sve"}, {"aten_cpu_capability": "avx2"}, {"x": 1}):
        assert digest_of({**fp, "cpu": {**fp["cpu"], **changed}}) != IDENTITY[name]


@pytest.mark.parametrize("name", sorted(MANIFEST_IDS))
def test_snapshot_ids_of_manifests_holding_them_are_pinned(name: str) -> None:
    entry = FileEntry(
        path="fxgraph/ab/entry", digest=hashlib.sha256(b"pinned").hexdigest(), size_bytes=6
    )
    made = Manifest(
        files=(entry,), fingerprint=FINGERPRINTS[name], devices=("cuda:0",), workload="drafter"
    )
    # the id and the manifest's key are unmoved; the environment is the identity
    assert (made.id, made.fingerprint_digest) == (MANIFEST_IDS[name], IDENTITY[name])
    assert json.loads(made.to_json())["fingerprint_digest"] == EXPECTED[name]
    parsed = Manifest.from_json(made.to_json())  # a stored manifest, read back
    assert (parsed.id, parsed.fingerprint_digest) == (MANIFEST_IDS[name], IDENTITY[name])


def test_the_environments_the_tier_switches_make_are_pinned() -> None:
    # what the server ranks a tier job's snapshots under, and a job that leaves the tier
    on = remote_tier.with_key_switches(DEV_VM, remote_tier.site_switches(tier=True))
    assert json_digest(on) == "f9cb8e7cf99c8de0950f7d66833f4655514c3a228b11849cf9c9cfdfdfe51e3c"
    assert digest_of(on) == "f59ce7e8000f8b30b41b45da09a4bcdc261c639099bffd4f937b91a25ee00e01"
    off = remote_tier.with_key_switches(REMOTE_TIER, {})
    assert json_digest(off) == "dfaaf194c185e5ea1442036314c045657bb1a1d29cc13b9e10bdf18b46d42e2b"
    assert digest_of(off) == "647fdd689c2d86c3ff2c7ad4fdf19ef47eed60fa0895c4c2511f143672c955a7"
    # what a job that exports the tier's switches records (on any machine)
    job = remote_tier.job_environ(remote_tier.site_switches(tier=True), url=remote_tier.OFF_URL)
    env = collect(environ=job)["env"]
    assert canonical_json(env) == '{"TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE":"1"}'


def test_the_default_cache_dir_of_a_thread_count_variant_is_pinned() -> None:
    # node_cache's variants: this node as a job with OMP_NUM_THREADS=1 fingerprints it
    # (before issue 31, /h/inductor/29337d237582925a: the digest covered threads_from)
    variant = {**DEV_VM, "cpu": cpu.with_threads(DEV_VM["cpu"], 1)}
    digest = digest_of(variant)
    assert digest == "3b57411de8984d86da2d4dc786c16e52e1d638adab0b1a2a24aa0a5e6928cd19"
    home = {"CACHEKEEPER_HOME": "/h"}
    assert config.node_cache_dir(digest, home) == Path("/h/inductor/3b57411de8984d86")


def test_this_machines_fingerprint_keeps_its_digest_through_json() -> None:
    # whatever this machine is: the hook's digest is the one the server computes from the
    # body it receives, and the one a manifest's fingerprint is checked against
    fp = collect()
    sent = parse(json.loads(json.dumps(fp)))
    assert digest_of(sent) == digest_of(fp)
    assert canonical_json(sent) == canonical_json(fp)
