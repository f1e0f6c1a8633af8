"""Pooler of BERT's binary head: dense + tanh on the hidden state of one position ([CLS])."""

from typing import Optional

import torch
from torch import Tensor

from megatron.core import group_fallbacks, tensor_parallel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer


class Pooler(MegatronModule):
    """tanh(dense(hidden_states[sequence_index])): one vector per sample for the binary head.

    `dense` is a plain `torch.nn.Linear(h, h)` replicated on every tensor-parallel rank. Under
    sequence parallelism the input [s/p, b, h] is first all-gathered along s (its backward
    scatters the gradient back without a reduction, since every rank computes the same pooler),
    so each rank holds the same weights and gradients.

    Args:
        hidden_size (int): h.
        init_method (callable): initialiser of the dense weight (the bias starts at zero).
        config (TransformerConfig): the model config.
        sequence_parallel (bool): the input is split along the sequence across the TP group.
        tp_group (ProcessGroup, optional): the tensor parallel group the sequence is gathered
            over (default: the global one).
    """

    def __init__(
        self,
        hidden_size: int,
        init_method,
        config: TransformerConfig,
        sequence_parallel: bool = False,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__(config)
        self.dense = get_linear_layer(
            hidden_size, hidden_size, init_method, config.perform_initialization
        )
        self.sequence_parallel = sequence_parallel
        self.tp_group = group_fallbacks.get_tensor_model_parallel_group_if_none(tp_group)

    def forward(self, hidden_states: Tensor, sequence_index: int = 0) -> Tensor:
        """hidden_states [s, b, h] ([s/p, b, h] under sequence parallelism) -> pooled [b, h]."""
        if self.sequence_parallel:
            # [s/p, b, h] -> [s, b, h]
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.tp_group
            )
        pooled = hidden_states[sequence_index, :, :]  # [b, h]
        pooled = self.dense(pooled)
        return torch.tanh(pooled)
