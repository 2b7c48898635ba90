"""A synthetic Inductor-like cache dir, deterministic for a seed.

    python bench/synthetic_cache.py DIR [--size-mb 350] [--seed 0]

Layout and size mix modelled on a real Inductor cache (DESIGN section 4: 23 MB in 104
files for one flex_attention workload; a drafter pipeline's dir was 353 MB):

    fxgraph/<xx>/<key>/<entry>          small pickled graph entries
    aotautograd/<xx>/<key>/<entry>      small entries
    <xx>/<name>.py, <xx>/<name>.json    many small generated sources (text, compressible)
    <xx>/<name>.cpp                     medium C++ sources (text)
    <xx>/<name>.so                      larger binaries, partly compressible
    triton/0/<hash>/{*.cubin,*.ptx,*.json,__grp__*.json}   kernels per GPU index

About a third of the bytes are random (incompressible), the rest text-like, as in a real
cache where compiled binaries sit beside generated Python and C++.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

_WORDS = (
    b"def kernel triton_poi_fused tmp0 tl.load xindex xmask tl.store in_ptr0 out_ptr0 "
    b"import torch from torch._inductor buf0 buf1 reinterpret_tensor empty_strided "
    b"extern_kernels.mm assert_size_stride aten.add float32 bfloat16 XBLOCK RBLOCK "
).split()


def _text(rng: random.Random, size: int) -> bytes:
    out = bytearray()
    while len(out) < size:
        out += b" ".join(rng.choice(_WORDS) for _ in range(12)) + b"\n"
    return bytes(out[:size])


def _binary(rng: random.Random, size: int) -> bytes:
    """Half random bytes, half text-like: roughly 2:1 under zstd -3."""
    half = size // 2
    return rng.randbytes(half) + _text(rng, size - half)


def _hex(rng: random.Random, n: int) -> str:
    return f"{rng.getrandbits(4 * n):0{n}x}"


def make_synthetic_cache(root: Path, *, size_mb: int = 350, seed: int = 0) -> None:
    """Fill ``root`` with about ``size_mb`` MB of Inductor-like files (a few thousand)."""
    rng = random.Random(seed)
    root = Path(root)
    budget = size_mb << 20
    scale = max(size_mb / 350, 0.01)
    written = 0

    def put(rel: str, data: bytes) -> None:
        nonlocal written
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        written += len(data)

    def two() -> str:
        return _hex(rng, 2)

    for _ in range(int(600 * scale) + 1):
        key = _hex(rng, 52)
        put(f"fxgraph/{key[:2]}/f{key}/{_hex(rng, 16)}", _binary(rng, rng.randint(2_000, 60_000)))
    for _ in range(int(300 * scale) + 1):
        key = _hex(rng, 52)
        put(
            f"aotautograd/{key[:2]}/a{key}/{_hex(rng, 16)}",
            _binary(rng, rng.randint(2_000, 40_000)),
        )
    for _ in range(int(1500 * scale) + 1):
        name = _hex(rng, 52)
        put(f"{two()}/c{name}.py", _text(rng, rng.randint(1_000, 30_000)))
        if rng.random() < 0.3:
            put(f"{two()}/c{name}.json", json.dumps({"key": name, "n": rng.random()}).encode())
    for _ in range(int(150 * scale) + 1):
        name = _hex(rng, 52)
        put(f"{two()}/c{name}.cpp", _text(rng, rng.randint(20_000, 300_000)))
    for _ in range(int(300 * scale) + 1):
        khash = _hex(rng, 52)
        folder = f"triton/0/{khash}"
        name = f"triton_poi_fused_{_hex(rng, 6)}"
        children = {}
        for ext, lo, hi in (
            (".cubin", 20_000, 200_000),
            (".ptx", 10_000, 80_000),
            (".json", 200, 2_000),
        ):
            rel = f"{folder}/{name}{ext}"
            put(rel, _binary(rng, rng.randint(lo, hi)) if ext != ".json" else _text(rng, hi))
            children[name + ext] = str((root / rel).absolute())
        put(f"{folder}/__grp__{name}.json", json.dumps({"child_paths": children}).encode())
    # the rest: large .so files until the budget is met
    while written < budget:
        size = min(budget - written, rng.randint(1 << 20, 6 << 20))
        put(f"{two()}/c{_hex(rng, 52)}.so", _binary(rng, max(size, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--size-mb", type=int, default=350)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    make_synthetic_cache(args.root, size_mb=args.size_mb, seed=args.seed)


if __name__ == "__main__":
    main()
