"""Shared experts: a dense MLP that every token goes through beside the routed experts
(Qwen2-MoE, DeepSeek), optionally scaled by a sigmoid gate (Qwen2-MoE's `shared_expert_gate`).

Notation: s sequence (s/tp under sequence parallelism), b batch, h hidden size, fs the shared
experts' ffn size (moe_shared_expert_intermediate_size).
"""

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig


class SharedExpertMLP(MLP):
    """A tensor-parallel MLP of size fs (an ordinary dense MLP: fc1 column-parallel, fc2
    row-parallel, with the sequence-parallel gather / reduce-scatter), whose output is added to
    the routed experts' output.

    With `moe_shared_expert_gate`, the output is multiplied per token by sigmoid(x gate^T),
    `gate_weight` [1, h] replicated (summed over tp under sequence parallelism).

    State-dict keys (later Megatron's): `shared_experts.linear_fc1.weight` [g fs / tp, h],
    `shared_experts.linear_fc2.weight` [h, fs / tp], `shared_experts.gate_weight` [1, h].

    Args:
        config (TransformerConfig): the model config.
        submodules (MLPSubmodules): the linear layers.
        pg_collection (ProcessGroupCollection, optional): its tp group splits fs.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: MLPSubmodules,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(
            config,
            submodules,
            pg_collection=pg_collection,
            ffn_hidden_size=config.moe_shared_expert_intermediate_size,
        )
        if config.moe_shared_expert_gate:
            weight = torch.empty((1, config.hidden_size), dtype=torch.float32)
            if config.perform_initialization:
                config.init_method(weight)
            self.gate_weight = torch.nn.Parameter(
                weight.to(device=self.linear_fc1.weight.device, dtype=config.params_dtype)
            )
            setattr(self.gate_weight, "sequence_parallel", config.sequence_parallel)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[s, b, h] -> [s, b, h] (the fc2 bias, if any, added)."""
        output, output_bias = super().forward(hidden_states)
        if output_bias is not None:
            output = output + output_bias
        if self.gate_weight is not None:
            gate = torch.sigmoid(F.linear(hidden_states, self.gate_weight))  # [s, b, 1]
            output = output * gate
        return output
