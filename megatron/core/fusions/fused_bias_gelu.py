"""Bias + GeLU (tanh approximation) with a hand-written backward, as Megatron's fused op.

The tanh approximation is the one Megatron's fused kernel uses (and GPT-2's "gelu_new").
"""

import torch


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(y + bias)."""
    x = bias + y
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of `bias_gelu` w.r.t. its input: g * d gelu_tanh(x) / dx at x = y + bias."""
    x = bias + y
    tanh_out = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
    # 0.1070322243 = 3 * 0.044715 * 0.79788456
    ff = 0.5 * x * ((1 - tanh_out * tanh_out) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (
        1 + tanh_out
    )
    return ff * g


class GeLUFunction(torch.autograd.Function):
    """Autograd function for bias + GeLU that saves only its inputs (recomputes tanh in backward)."""

    @staticmethod
    def forward(ctx, input, bias):
        ctx.save_for_backward(input, bias)
        return bias_gelu(bias, input)

    @staticmethod
    def backward(ctx, grad_output):
        input, bias = ctx.saved_tensors
        tmp = bias_gelu_back(grad_output, bias, input)
        # The bias broadcasts over every leading dimension: reduce its gradient over them.
        return tmp, tmp.reshape(-1, tmp.shape[-1]).sum(dim=0) if bias.dim() == 1 else tmp


bias_gelu_impl = GeLUFunction.apply
