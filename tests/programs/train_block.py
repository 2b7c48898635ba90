"""A small training-like program for the command-workload tests: each rank compiles a block.

    torchrun --nproc-per-node 2 tests/programs/train_block.py [--seq 128] [--steps 2]
    python tests/programs/train_block.py               # one process, no torch.distributed

Each process builds a transformer-like block (qkv projection, flex_attention with a causal
block mask, output projection), compiles the whole block with ``torch.compile`` (as
frameworks do, so the FX graphs are block-sized, not flex_attention's own), and runs its
forward under ``torch.no_grad()`` (flex_attention has no CPU backward). Under torchrun
(``WORLD_SIZE`` > 1) the ranks join a gloo group and all-reduce the output, as training does.

Options for the tests:
- ``--report DIR``: each process writes ``DIR/rank-<rank>.json`` with its own cache
  counters (the job's own account, independent of cachekeeper's evidence hook).
- ``--crash-when-cold``: raise after compiling when the FX graph cache missed, the shape of
  a job that works warm and crashes cold (DESIGN.md §1).
- ``$CK_TEST_RANK1_SEQ``: rank 1 uses this sequence length instead (a rank that compiles
  what the others do not).
- ``$CK_TEST_EXTRA_SEQ``: every rank then also runs this sequence length, after the first
  (a site's launcher whose own configuration, outside the workload file, grew a shape).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.attention.flex_attention import create_block_mask, flex_attention


def causal(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN201 - a mask_mod's signature
    return q_idx >= kv_idx


class Block(torch.nn.Module):
    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, block_mask: object) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = flex_attention(q, k, v, block_mask=block_mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def counters() -> dict[str, int]:
    from torch._dynamo.utils import counters as raw

    keys = {
        "inductor": ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass"),
        "aot_autograd": ("autograd_cache_hit", "autograd_cache_miss"),
    }
    return {k: int(raw[g].get(k, 0)) for g, ks in keys.items() for k in ks}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--report", type=Path, default=None)
    parser.add_argument("--crash-when-cold", action="store_true")
    args = parser.parse_args()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    seq = args.seq
    if rank == 1 and os.environ.get("CK_TEST_RANK1_SEQ"):
        seq = int(os.environ["CK_TEST_RANK1_SEQ"])
    torch.manual_seed(0)
    block = torch.compile(Block(), dynamic=False)
    mask = create_block_mask(causal, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cpu")
    with torch.no_grad():
        for _ in range(args.steps):
            out = block(torch.randn(1, seq, 64), mask)
        extra = int(os.environ.get("CK_TEST_EXTRA_SEQ") or 0)
        if extra:
            extra_mask = create_block_mask(
                causal, B=None, H=None, Q_LEN=extra, KV_LEN=extra, device="cpu"
            )
            block(torch.randn(1, extra, 64), extra_mask)
    if distributed:
        total = out.sum().reshape(1)
        dist.all_reduce(total)
    found = counters()
    if args.report is not None:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / f"rank-{rank}.json").write_text(
            json.dumps({"rank": rank, "threads": torch.get_num_threads(), **found})
        )
    if args.crash_when_cold and found["fxgraph_cache_miss"]:
        raise RuntimeError(
            "Detected that you are using FX to symbolically trace a dynamo-optimized function"
            " (this program crashes only when it compiles cold)"
        )
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
