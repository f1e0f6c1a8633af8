"""BERT's masked-LM head transform: dense -> exact GeLU -> LayerNorm (before the output layer)."""

import torch
from torch import Tensor

from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.torch_norm import WrappedTorchNorm
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer


class BertLMHead(MegatronModule):
    """LayerNorm(gelu(dense(x))), applied to the final hidden states before the vocabulary
    projection (`BertModel.output_layer`).

    `dense` is a plain `torch.nn.Linear(h, h)` replicated on every tensor-parallel rank (no
    communication). Under sequence parallelism each rank transforms its own slice of the sequence,
    so the dense and LayerNorm parameters are marked `sequence_parallel` and `finalize_model_grads`
    all-reduces their gradients over the TP group. The GeLU is always the exact (erf) one,
    whatever the MLP uses (`--openai-gelu` and the bias-GeLU fusion do not reach it).

    Args:
        hidden_size (int): h.
        config (TransformerConfig): init_method, layernorm_epsilon, sequence_parallel.
    """

    def __init__(self, hidden_size: int, config: TransformerConfig):
        super().__init__(config=config)
        self.dense = get_linear_layer(
            hidden_size, hidden_size, config.init_method, config.perform_initialization
        )
        # Replicated over tp but fed a sequence slice each: gradients need a tp all-reduce.
        for param in (self.dense.weight, self.dense.bias):
            param.sequence_parallel = config.sequence_parallel

        self.layer_norm = WrappedTorchNorm(
            config=config, hidden_size=hidden_size, eps=config.layernorm_epsilon
        )
        self.gelu = torch.nn.functional.gelu

    def forward(self, hidden_states: Tensor) -> Tensor:
        """[s, b, h] -> [s, b, h]."""
        return self.layer_norm(self.gelu(self.dense(hidden_states)))
