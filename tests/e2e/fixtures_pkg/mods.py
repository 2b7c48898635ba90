"""A score_mod factory named by import path, as a training repo's own would be."""

from typing import Any


def relative_bias(scale: float) -> Any:
    """score + scale * (q_idx - kv_idx), cast to float."""
    import torch

    def relative_bias_score(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return score + scale * (q_idx - kv_idx).to(torch.float32)

    return relative_bias_score


NOT_CALLABLE = 42
