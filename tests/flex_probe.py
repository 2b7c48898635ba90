"""A tiny real torch.compile(flex_attention) run, used by the tests as a fresh process.

    python tests/flex_probe.py            # uses $TORCHINDUCTOR_CACHE_DIR
Prints one JSON line: the inductor and aot_autograd counters after the compiled call.
The cache dir must be set in the environment before this process starts.
"""

import json
import sys


def main() -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def causal(b, h, q_idx, kv_idx):
        return q_idx >= kv_idx

    seq = int(sys.argv[1]) if len(sys.argv) > 1 else 128
    q, k, v = (torch.randn(1, 2, seq, 16) for _ in range(3))
    block_mask = create_block_mask(causal, B=None, H=None, Q_LEN=seq, KV_LEN=seq, device="cpu")
    with torch.no_grad():
        out = torch.compile(flex_attention)(q, k, v, block_mask=block_mask)
    assert out.shape == q.shape
    print(
        json.dumps(
            {"inductor": dict(counters["inductor"]), "aot_autograd": dict(counters["aot_autograd"])}
        )
    )


if __name__ == "__main__":
    main()
