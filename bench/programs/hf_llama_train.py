"""A real framework's training job for the command-workload benchmark (issue 23).

    python bench/programs/hf_llama_train.py --steps 5 --report OUT.json [--device cuda]

HF transformers' Llama, built from a config (random weights: nothing is downloaded), with
``attn_implementation="flex_attention"`` and the whole model compiled
(``torch.compile(model)``), trained for ``--steps`` AdamW steps on random tokens. Started
under torchrun or alone. The report (one JSON object) holds the wall time from this
process's start (``/proc/self/stat``, so interpreter start and imports count) to the end
of each step, and the process's own FX-graph / AOTAutograd counters: the job's account of
its misses, independent of cachekeeper's evidence hook. ``--no-backward`` runs forward
only under ``torch.no_grad()`` (flex_attention has no CPU backward).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path


def _process_age_s() -> float:
    """Seconds since this process started (the kernel's start time, not our first line)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    boot = next(
        float(line.split()[1])
        for line in Path("/proc/stat").read_text().splitlines()
        if line.startswith("btime")
    )
    return time.time() - (boot + int(fields[19]) / ticks)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--no-backward", action="store_true")
    parser.add_argument("--report", type=Path, default=None)
    args = parser.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", device.index or 0)))
        device = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=max(4096, args.seq),
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM._from_config(config, attn_implementation="flex_attention")
    model = model.to(device=device, dtype=dtype)
    compiled = torch.compile(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps: list[float] = []
    for _ in range(args.steps):
        ids = torch.randint(0, args.vocab, (args.batch, args.seq), device=device)
        if args.no_backward:
            with torch.no_grad():
                compiled(input_ids=ids)
        else:
            loss = compiled(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        steps.append(round(_process_age_s(), 3))

    from torch._dynamo.utils import counters

    report = {
        "rank": int(os.environ.get("RANK", 0)),
        "device": str(device),
        "torch": torch.__version__,
        "steps_end_s": steps,  # seconds from process start to the end of each step
        "end_s": steps[-1],
        "counters": {
            key: int(counters[group].get(key, 0))
            for group, keys in (
                ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
                ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss")),
            )
            for key in keys
        },
    }
    if args.report is not None:
        path = args.report
        if "RANK" in os.environ:
            path = path.with_name(f"{path.stem}-rank{report['rank']}{path.suffix}")
        path.write_text(json.dumps(report))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
