"""Bias + SwiGLU: silu(first half) * second half of the last dimension."""

import torch
import torch.nn.functional as F


def swiglu(y: torch.Tensor) -> torch.Tensor:
    """[..., 2f] -> [..., f]: silu(y[..., :f]) * y[..., f:]."""
    y_1, y_2 = torch.chunk(y, 2, -1)
    return F.silu(y_1) * y_2


def bias_swiglu(y: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """swiglu(y + bias)."""
    return swiglu(y + bias)


def bias_swiglu_impl(input: torch.Tensor, bias: torch.Tensor, fp8_input_store: bool = False):
    """SwiGLU of `input + bias` (bias may be None). `fp8_input_store` is accepted and unused."""
    if bias is not None:
        return bias_swiglu(input, bias)
    return swiglu(input)
