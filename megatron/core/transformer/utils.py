"""Small helpers of the transformer package: masks, GeLU variants, a plain linear layer."""

from functools import lru_cache

import torch

from megatron.core.utils import get_current_device


def get_linear_layer(rows: int, columns: int, init_method, perform_initialization: bool = True):
    """A plain (not parallel) `torch.nn.Linear(rows, columns)` with `init_method` on the weight
    and a zero bias."""
    layer = torch.nn.Linear(rows, columns)
    if perform_initialization:
        init_method(layer.weight)
    with torch.no_grad():
        layer.bias.zero_()
    return layer


@lru_cache(maxsize=32)
def _causal_mask(sq: int, sk: int, device: torch.device) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=1)


def get_default_causal_mask(sq: int, sk: int = None) -> torch.Tensor:
    """Boolean causal mask [sq, sk] on the current device; True marks a masked (future) key."""
    return _causal_mask(sq, sq if sk is None else sk, get_current_device())


def attention_mask_func(
    attention_scores: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Fill masked positions (mask True) of the scores with Megatron's -10000.0, in place."""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def gelu_impl(x: torch.Tensor) -> torch.Tensor:
    """OpenAI's GeLU (tanh approximation), as used by GPT-2 ("gelu_new"), with Megatron's
    constants (megatron/core/transformer/utils.py)."""
    return 0.5 * x * (1.0 + torch.tanh(0.7978845608028654 * x * (1.0 + 0.044715 * x * x)))


def openai_gelu(x: torch.Tensor) -> torch.Tensor:
    """OpenAI's GeLU (tanh approximation). Megatron's `--openai-gelu`."""
    return gelu_impl(x)


def erf_gelu(x: torch.Tensor) -> torch.Tensor:
    """Exact GeLU through erf, kept for old checkpoints. Megatron divides by the literal 1.41421
    (not sqrt(2)); kept so that results match its bit pattern."""
    return (
        x * 0.5 * (torch.erf(x / 1.41421).to(dtype=x.dtype) + torch.ones_like(x).to(dtype=x.dtype))
    )


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """x * sigmoid(1.702 x): the GeLU approximation of OpenAI's CLIP (HF's "quick_gelu")."""
    return x * torch.sigmoid(1.702 * x)


def fast_gelu(x: torch.Tensor) -> torch.Tensor:
    """The tanh approximation of GeLU (HF's "gelu_pytorch_tanh", used by SigLIP)."""
    return torch.nn.functional.gelu(x, approximate='tanh')


def squared_relu(x: torch.Tensor) -> torch.Tensor:
    """relu(x) ** 2 (Megatron's `--squared-relu`, defined in its
    megatron/training/arguments.py::core_transformer_config_from_args)."""
    return torch.pow(torch.nn.functional.relu(x), 2)
