"""Warm-up entrypoints: one that compiles, one that hits the classic cold-compile bug."""

from typing import Any


def step(*, size: int, device: str = "cpu") -> None:
    """A tiny real torch.compile: one pointwise kernel of ``size`` elements."""
    import torch

    @torch.compile
    def scaled_gelu(x: Any) -> Any:
        return torch.nn.functional.gelu(x) * 2.0

    x = torch.randn(size, device=device)
    scaled_gelu(x)


def fx_traces_compiled(*, size: int, device: str = "cpu") -> None:
    """Compile something, then FX-trace a function that calls a dynamo-optimized one.

    This is the real failure a warm cache can hide: torch.fx.symbolic_trace over a
    torch.compile'd callee raises "Detected that you are using FX to symbolically trace a
    dynamo-optimized function".
    """
    import torch

    step(size=size, device=device)
    compiled = torch.compile(lambda x: x * 3.0)

    def outer(x: Any) -> Any:
        return compiled(x) + 1

    torch.fx.symbolic_trace(outer)


def sleep(*, seconds: float) -> None:
    """Hang for ``seconds`` (the timeout test's entrypoint)."""
    import time

    time.sleep(seconds)
