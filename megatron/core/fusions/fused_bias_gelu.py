"""Bias + GeLU (tanh approximation) with a hand-written backward, as Megatron's fused op.

The tanh approximation is the one Megatron's fused kernel uses (and GPT-2's "gelu_new"):
gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))). Forward and backward run torch's native
kernels for it (`gelu(approximate='tanh')` and `aten.gelu_backward`), one pass over the tensor on
CPU and GPU alike, where the elementwise formula would launch a dozen ops; only the biased input is
saved, and the activation is recomputed from it in backward.
"""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.function_apply import apply_function


def bias_gelu(bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(y + bias)."""
    return F.gelu(bias + y, approximate='tanh')


def bias_gelu_back(g: torch.Tensor, bias: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Gradient of `bias_gelu` w.r.t. its input: g * d gelu_tanh(x) / dx at x = y + bias."""
    return torch.ops.aten.gelu_backward(g, bias + y, approximate='tanh')


class GeLUFunction(torch.autograd.Function):
    """Autograd function for bias + GeLU.

    It saves the pre-activation `input + bias` (the same size as `input`, which it replaces, so
    no more memory than saving the inputs) and recomputes only tanh in backward: one pass over
    the tensor there instead of two.
    """

    @staticmethod
    def forward(ctx, input, bias):
        pre_activation = bias + input
        ctx.save_for_backward(pre_activation)
        ctx.bias_is_vector = bias.dim() == 1
        return F.gelu(pre_activation, approximate='tanh')

    @staticmethod
    def backward(ctx, grad_output):
        (pre_activation,) = ctx.saved_tensors
        tmp = torch.ops.aten.gelu_backward(grad_output, pre_activation, approximate='tanh')
        # The bias broadcasts over every leading dimension: reduce its gradient over them.
        grad_bias = tmp.reshape(-1, tmp.shape[-1]).sum(dim=0) if ctx.bias_is_vector else tmp
        return tmp, grad_bias


def bias_gelu_impl(input, bias):
    """gelu_tanh(input + bias), through GeLUFunction (no autograd node without gradients)."""
    return apply_function(GeLUFunction, input, bias)
