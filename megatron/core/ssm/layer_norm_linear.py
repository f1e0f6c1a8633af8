"""A column-parallel linear with its input norm fused in (the role of Transformer Engine's
`TELayerNormColumnParallelLinear` in Megatron's Mamba spec), in plain PyTorch.

The norm parameters live on the linear, so the state-dict keys are Megatron's:
`in_proj.layer_norm_weight` (and `in_proj.layer_norm_bias` with LayerNorm).
"""

import torch

from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


class LayerNormColumnParallelLinear(ColumnParallelLinear):
    """norm(x) @ W^T with W [o, h] split along dim 0 across tensor-parallel ranks.

    The norm (config.normalization: LayerNorm or RMSNorm, eps config.layernorm_epsilon, fp32
    statistics) runs on this rank's input before the linear: under sequence parallelism on the
    local [s/tp, b, h] slice, then the linear all-gathers along the sequence (backward
    reduce-scatter). The norm weight is replicated; its gradient is a partial sum under sequence
    parallelism, so it carries `sequence_parallel` and `finalize_model_grads` all-reduces it over
    tensor-parallel ranks. Other communication is that of ColumnParallelLinear.

    Args:
        input_size: h.
        output_size: o.
        config (TransformerConfig): normalization, layernorm_epsilon,
            layernorm_zero_centered_gamma, params_dtype, sequence_parallel.
        init_method: weight init (of this rank's block).
        bias, skip_bias_add, gather_output, tp_group: as in ColumnParallelLinear.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config: TransformerConfig,
        init_method,
        bias: bool = False,
        skip_bias_add: bool = False,
        gather_output: bool = False,
        tp_group=None,
    ):
        super().__init__(
            input_size,
            output_size,
            config=config,
            init_method=init_method,
            bias=bias,
            skip_bias_add=skip_bias_add,
            gather_output=gather_output,
            tp_group=tp_group,
        )
        if config.normalization not in ('LayerNorm', 'RMSNorm'):
            raise ValueError(
                f"normalization must be 'LayerNorm' or 'RMSNorm', got {config.normalization!r}"
            )
        self.normalization = config.normalization
        self.eps = config.layernorm_epsilon
        self.zero_centered_gamma = config.layernorm_zero_centered_gamma
        factory = dict(dtype=config.params_dtype, device=get_current_device())
        fill = torch.zeros if self.zero_centered_gamma else torch.ones
        self.layer_norm_weight = torch.nn.Parameter(fill(input_size, **factory))
        setattr(self.layer_norm_weight, 'sequence_parallel', config.sequence_parallel)
        if self.normalization == 'LayerNorm':
            self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size, **factory))
            setattr(self.layer_norm_bias, 'sequence_parallel', config.sequence_parallel)
        else:
            self.layer_norm_bias = None

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        """The fused norm alone: [..., h] -> [..., h] in x's dtype."""
        weight = self.layer_norm_weight + 1 if self.zero_centered_gamma else self.layer_norm_weight
        if self.normalization == 'LayerNorm':
            return torch.nn.functional.layer_norm(
                x, (x.shape[-1],), weight, self.layer_norm_bias, self.eps
            )
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x32.to(x.dtype)

    def forward(self, input_: torch.Tensor):
        """[s, b, h] ([s/tp, b, h] under sequence parallelism) -> ([s, b, o/tp], bias)."""
        return super().forward(self.normalize(input_))
