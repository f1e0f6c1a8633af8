"""The MoE layer: router -> token dispatcher -> experts -> token dispatcher (+ shared experts).

Notation: s sequence (s/tp under sequence parallelism), b batch, h hidden size, E experts,
ep expert parallel size, nle = E / ep local experts.
"""

from abc import ABC, abstractmethod
from typing import Optional

import torch

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
from megatron.core.transformer.moe.token_dispatcher import (
    MoEAllGatherTokenDispatcher,
    MoEAlltoAllTokenDispatcher,
)
from megatron.core.transformer.transformer_config import TransformerConfig


class BaseMoELayer(MegatronModule, ABC):
    """Base of MoE layers: the local expert ids and the layer number.

    Expert parallel rank r holds experts [r nle, (r + 1) nle); with moe_extended_tp every rank
    holds all E (each split over tp x ep).

    Args:
        config (TransformerConfig): the model config.
        layer_number (int, optional): the global 1-based layer number (the tracker index).
        pg_collection (ProcessGroupCollection, optional): tp, ep, tp_ep, cp, tp_cp, dp groups;
            None fields fall back to the global ones.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config)
        self.config = config
        self.pg_collection = resolve_process_groups(
            pg_collection, ("tp", "ep", "tp_ep", "cp", "tp_cp", "dp")
        )
        self.expert_parallel_size = self.pg_collection.ep.size()
        if self.expert_parallel_size <= 0:
            raise ValueError("Expected non-negative expert parallel size")
        if config.moe_extended_tp:
            self.num_local_experts = config.num_moe_experts
            local_expert_indices_offset = 0
        else:
            if config.num_moe_experts % self.expert_parallel_size != 0:
                raise ValueError(
                    f"num_moe_experts ({config.num_moe_experts}) must be a multiple of the "
                    f"expert parallel size ({self.expert_parallel_size})"
                )
            self.num_local_experts = config.num_moe_experts // self.expert_parallel_size
            local_expert_indices_offset = self.pg_collection.ep.rank() * self.num_local_experts
        # Global indices of the experts this rank holds (a contiguous block).
        self.local_expert_indices = list(
            range(local_expert_indices_offset, local_expert_indices_offset + self.num_local_experts)
        )
        self.layer_number = layer_number
        # The subclass builds these three parts.
        self.router = self.experts = self.token_dispatcher = None

    @abstractmethod
    def forward(self, hidden_states):
        """[s, b, h] -> ([s, b, h], None)."""

    def set_layer_number(self, layer_number: int):
        """The global 1-based layer number (TransformerLayer sets it)."""
        self.layer_number = layer_number
        self.router.set_layer_number(layer_number)


class MoELayer(BaseMoELayer):
    """Mixture of experts: each token goes to its top-k experts, weighted by its routing probs.

    Forward: the router scores the tokens ([s, b, h] -> probs, indices); the dispatcher
    (`moe_token_dispatcher_type` allgather / alltoall) moves each (token, slot) pair to the rank
    holding its expert; the experts (`SequentialMLP`, or `GroupedMLP` with moe_grouped_gemm) run
    on their rows; the dispatcher brings the outputs back and sums each token's slots weighted by
    its probs; shared experts, if any, add their output. `moe_layer_recompute` checkpoints the
    whole layer.

    Args:
        config (TransformerConfig): the model config.
        submodules (MLPSubmodules, optional): the experts' (and shared experts') linear layers;
            None with moe_grouped_gemm.
        layer_number (int, optional): the global 1-based layer number.
        pg_collection (ProcessGroupCollection, optional): see BaseMoELayer.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Optional[MLPSubmodules] = None,
        layer_number: Optional[int] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        self.submodules = submodules
        super().__init__(config=config, layer_number=layer_number, pg_collection=pg_collection)
        self.router = TopKRouter(config=self.config, pg_collection=self.pg_collection)
        if self.config.moe_grouped_gemm:
            self.experts = GroupedMLP(
                self.num_local_experts,
                self.config,
                pg_collection=self.pg_collection,
                local_expert_indices=self.local_expert_indices,
            )
        else:
            if not isinstance(self.submodules, MLPSubmodules):
                raise ValueError(
                    "MoELayer without moe_grouped_gemm needs MLPSubmodules (the experts' "
                    f"linear layers), got {type(self.submodules).__name__}"
                )
            self.experts = SequentialMLP(
                self.num_local_experts,
                self.config,
                self.submodules,
                pg_collection=self.pg_collection,
                local_expert_indices=self.local_expert_indices,
            )
        dispatcher_type = config.moe_token_dispatcher_type
        if dispatcher_type == "allgather":
            dispatcher_class = MoEAllGatherTokenDispatcher
        elif dispatcher_type == "alltoall":
            dispatcher_class = MoEAlltoAllTokenDispatcher
        else:
            raise ValueError(f"Unsupported token dispatcher type: {dispatcher_type}")
        self.token_dispatcher = dispatcher_class(
            self.num_local_experts,
            self.local_expert_indices,
            config=self.config,
            pg_collection=self.pg_collection,
        )
        self.shared_experts = None
        if config.moe_shared_expert_intermediate_size is not None:
            shared_submodules = self.submodules
            if not isinstance(shared_submodules, MLPSubmodules):
                shared_submodules = MLPSubmodules(
                    linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
                )
            self.shared_experts = SharedExpertMLP(
                self.config, shared_submodules, pg_collection=self.pg_collection
            )
        self.moe_layer_recompute = config.moe_layer_recompute
        if layer_number is not None:
            self.router.set_layer_number(layer_number)

    def forward(self, hidden_states: torch.Tensor):
        """[s, b, h] -> ([s, b, h], None)."""
        if self.training and self.pg_collection.tp.size() > 1 and not self.config.sequence_parallel:
            raise ValueError(
                "During training, performance may degrade if MoE and tensor parallelism"
                " are enabled without also enabling sequence parallelism."
            )

        def custom_forward(hidden_states):
            probs, indices = self.router(hidden_states)
            dispatched_input, tokens_per_expert = self.token_dispatcher.token_permutation(
                hidden_states, probs, indices
            )
            expert_output, mlp_bias = self.experts(dispatched_input, tokens_per_expert)
            output, mlp_bias = self.token_dispatcher.token_unpermutation(expert_output, mlp_bias)
            if self.shared_experts is not None:
                output = output + self.shared_experts(hidden_states)
            return output

        if self.moe_layer_recompute and self.training:
            output = tensor_parallel.checkpoint(custom_forward, False, hidden_states)
        else:
            output = custom_forward(hidden_states)
        return output, None
