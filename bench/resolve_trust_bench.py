"""What resolve's signature check (issue 32, ``trusted_keys``) costs a node.

    .venv/bin/python bench/resolve_trust_bench.py [--files 2000] [--shadows 20] [--rounds 200]

One ``cachekeeper serve`` process on loopback holds one snapshot of a workload signed by
the builder's key and ``--shadows`` newer ones that claim "verified" (the attack
of issue 32: without trust they rank first), each listing ``--files`` files (a manifest's
size is what a check costs: it is parsed, made canonical and verified). Measured, each
case in turn, ``--rounds`` sequential ``POST /v1/resolve`` from one client:

- **no trust**: the request as before issue 32 (the newest shadow answers);
- **trust, first**: the first request with the builder's key (every shadow and the signed
  one checked once; the verdicts are then kept);
- **trust**: the same request again (verdicts kept).

Twice: with unsigned shadows (refused at once: the catalog says they were published
without a signature), and with forged ones carrying a copy of the builder's signature
block (each costs one full check: its canonical JSON rebuilt and verified).

Ratios are against "no trust" in the same run; nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench._server import serve  # noqa: E402
from cachekeeper.environment.fingerprint import collect  # noqa: E402
from cachekeeper.snapshot.manifest import FileEntry, Manifest  # noqa: E402
from cachekeeper.snapshot.signing import generate_keypair, load_public_key, sign_manifest  # noqa: E402


def _common(files: int) -> tuple[tuple[FileEntry, ...], dict[str, bytes]]:
    """``files`` entries every snapshot shares (uploaded once), and their blobs."""
    blobs = {}
    entries = []
    for i in range(files):
        data = f"graph {i}".encode()
        digest = hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        entries.append(FileEntry(path=f"fxgraph/{i % 256:02x}/k{i}/entry", digest=digest,
                                 size_bytes=len(data)))  # fmt: skip
    return tuple(entries), blobs


def _manifest(tag: str, common: tuple[FileEntry, ...], fingerprint: dict) -> Manifest:
    """The shared entries plus one of its own (so each snapshot has its own id)."""
    data = tag.encode()
    own = FileEntry(path="tag", digest=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    return Manifest(
        files=(*common, own),
        fingerprint=fingerprint,  # type: ignore[arg-type]
        devices=("cpu",),
        workload="w",
        stats={"verify": {"effective": True}},
    )


def _publish(client: httpx.Client, manifest: Manifest, tag: str) -> None:
    client.put(f"/v1/blobs/{hashlib.sha256(tag.encode()).hexdigest()}", content=tag.encode())
    client.post("/v1/snapshots", content=manifest.to_json()).raise_for_status()


def _times(client: httpx.Client, body: dict, rounds: int) -> tuple[list[float], str]:
    out = []
    answer = {}
    for _ in range(rounds):
        started = time.perf_counter()
        answer = client.post("/v1/resolve", json=body).raise_for_status().json()
        out.append(time.perf_counter() - started)
    return out, answer["snapshot"]["id"]


def _scenario(work: Path, args: argparse.Namespace, *, forged: bool) -> dict:
    """One server: the signed snapshot, then the shadows (unsigned, or carrying a copy of
    the builder's signature block: each then costs a full check once)."""
    fingerprint = dict(collect())
    key, pub, _ = generate_keypair(work / "builder")
    wire = base64.b64encode(load_public_key(pub).raw).decode()
    common, blobs = _common(args.files)
    signed = sign_manifest(_manifest("signed", common, fingerprint), key)
    with serve(work / "data") as server, httpx.Client(base_url=server.url, timeout=120) as c:
        for digest, data in blobs.items():
            c.put(f"/v1/blobs/{digest}", content=data).raise_for_status()
        _publish(c, signed, "signed")
        for n in range(args.shadows):
            shadow = _manifest(f"shadow {n}", common, fingerprint)
            _publish(
                c, shadow.with_signature(signed.signature) if forged else shadow, f"shadow {n}"
            )
        plain = {"fingerprint": fingerprint, "workload": "w"}
        trusting = {**plain, "trusted_keys": [wire]}
        c.post("/v1/resolve", json=plain).raise_for_status()  # the server's own first request
        started = time.perf_counter()
        first = c.post("/v1/resolve", json=trusting).raise_for_status().json()
        first_s = time.perf_counter() - started
        assert first["snapshot"]["id"] == signed.id, first
        base, base_id = _times(c, plain, args.rounds)
        kept, kept_id = _times(c, trusting, args.rounds)
    assert kept_id == signed.id and base_id != signed.id
    p50 = statistics.median
    return {
        "shadows": f"{args.shadows} {'forged (a copied signature)' if forged else 'unsigned'}",
        "no_trust_p50_ms": round(p50(base) * 1000, 2),
        "trust_first_ms": round(first_s * 1000, 1),
        "trust_p50_ms": round(p50(kept) * 1000, 2),
        "trust_over_no_trust": round(p50(kept) / p50(base), 2),
        "first_per_checked_manifest_ms": round(
            first_s * 1000 / ((args.shadows if forged else 0) + 1), 1
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--files", type=int, default=2000)
    parser.add_argument("--shadows", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=200)
    args = parser.parse_args()
    out: dict = {"files_per_manifest": args.files, "rounds": args.rounds, "cases": []}
    for forged in (False, True):
        with tempfile.TemporaryDirectory() as tmp:
            out["cases"].append(_scenario(Path(tmp), args, forged=forged))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
