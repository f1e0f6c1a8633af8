"""LayerNorm and RMSNorm in plain PyTorch, built from a TransformerConfig.

Under sequence parallelism each tensor-parallel rank normalises a different slice of the sequence,
so the gradients of the (replicated) norm weights are partial sums: every norm parameter carries
`sequence_parallel = config.sequence_parallel`, and `finalize_model_grads` all-reduces the
gradients of the parameters marked True over the tensor-parallel group.
"""

import numbers

import torch

from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


def _mark_sequence_parallel(module: torch.nn.Module, sequence_parallel: bool) -> None:
    for param in module.parameters():
        setattr(param, 'sequence_parallel', sequence_parallel)


class LayerNorm(torch.nn.LayerNorm):
    """LayerNorm over the last dimension, with an optional zero-centred weight.

    Args:
        config (TransformerConfig): reads sequence_parallel, layernorm_zero_centered_gamma,
            params_dtype.
        hidden_size (int): normalised size.
        eps (float): epsilon.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__(
            hidden_size, eps=eps, dtype=config.params_dtype, device=get_current_device()
        )
        self.config = config
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        if self.zero_centered_gamma:
            with torch.no_grad():
                self.weight.zero_()
        _mark_sequence_parallel(self, config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight + 1 if self.zero_centered_gamma else self.weight
        return torch.nn.functional.layer_norm(x, self.normalized_shape, weight, self.bias, self.eps)


class RMSNorm(torch.nn.Module):
    """Root-mean-square norm: x / sqrt(mean(x^2) + eps) * weight, computed in fp32.

    Args:
        config (TransformerConfig): reads sequence_parallel, params_dtype.
        hidden_size (int): normalised size.
        eps (float): epsilon.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        super().__init__()
        self.config = config
        self.eps = eps
        self.weight = torch.nn.Parameter(
            torch.ones(hidden_size, dtype=config.params_dtype, device=get_current_device())
        )
        _mark_sequence_parallel(self, config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


class WrappedTorchNorm:
    """Factory used in layer specs: builds `LayerNorm` or `RMSNorm` following config.normalization.

    Args:
        config (TransformerConfig): normalization, sequence_parallel, params_dtype.
        hidden_size (int): normalised size.
        eps (float): epsilon.
    """

    def __new__(cls, config: TransformerConfig, hidden_size: int, eps: float = 1e-5):
        if not isinstance(hidden_size, numbers.Integral):
            raise ValueError(f"norm hidden_size must be an int, got {hidden_size!r}")
        if config.normalization == "LayerNorm":
            return LayerNorm(config, hidden_size, eps)
        if config.normalization == "RMSNorm":
            return RMSNorm(config, hidden_size, eps)
        raise ValueError(
            f"normalization must be 'LayerNorm' or 'RMSNorm', got {config.normalization!r}"
        )


# Megatron's name for the torch layernorm used by the local spec.
WrappedTorchLayerNorm = WrappedTorchNorm
