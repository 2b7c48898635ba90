"""A training job's stand-in for the per-key tier's fault tests (run as a fresh process).

    python tests/tier_job.py [GATE_FILE]

Compiles one small function (puts and gets through the tier, when the environment points
torch at it), prints ``STEP1``, waits for GATE_FILE to exist (when given: the test does
its damage meanwhile), compiles a second one, checks both against eager, and prints one
JSON line: the inductor and aot_autograd counters, torch's remote cache stats, and the two
results (rounded sums: a job's output, the same with or without a tier).
"""

import json
import os
import sys
import time


def main() -> None:
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.remote_cache import cache_stats

    torch.manual_seed(0)
    x = torch.randn(256)
    first = torch.compile(lambda t: (t.sin() * 2 + 1).relu())
    one = first(x)
    assert torch.allclose(one, (x.sin() * 2 + 1).relu(), atol=1e-5)
    print("STEP1", flush=True)
    if len(sys.argv) > 1:
        deadline = time.monotonic() + 120
        while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
            time.sleep(0.05)
    second = torch.compile(lambda t: t.cos() * t.exp() - t)
    two = second(x)
    assert torch.allclose(two, x.cos() * x.exp() - x, atol=1e-5)
    print(
        json.dumps(
            {
                "inductor": dict(counters["inductor"]),
                "aot_autograd": dict(counters["aot_autograd"]),
                "remote": {k: vars(v) for k, v in cache_stats._stats.items()},
                "outputs": [round(float(one.sum()), 3), round(float(two.sum()), 3)],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
