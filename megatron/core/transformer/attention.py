"""Self and cross attention with tensor-parallel projections.

Notation: sq / sk query / key length, b batch, h hidden size, np query heads per partition,
ng query groups (key/value heads) per partition, hn head size.

QKV layout (megatron-core, interchangeable with Megatron checkpoints): the rows of the fused
`linear_qkv` weight are grouped by query group, `[ng, np/ng + 2, hn]`: for each group its np/ng
query heads, then its key head, then its value head. The tensor-parallel split of the rows
(ColumnParallelLinear, dim 0) therefore hands each rank whole query groups.
"""

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional, Union

import torch

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.rotary_pos_embedding import apply_rotary_pos_emb
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide, get_current_device


@dataclass
class SelfAttentionSubmodules:
    """Specs of the submodules of `SelfAttention`."""

    linear_qkv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None
    q_layernorm: Union[ModuleSpec, type] = None
    k_layernorm: Union[ModuleSpec, type] = None


@dataclass
class CrossAttentionSubmodules:
    """Specs of the submodules of `CrossAttention`."""

    linear_q: Union[ModuleSpec, type] = None
    linear_kv: Union[ModuleSpec, type] = None
    core_attention: Union[ModuleSpec, type] = None
    linear_proj: Union[ModuleSpec, type] = None


class Attention(MegatronModule, ABC):
    """Attention base: Q/K/V projections (subclass), optional RoPE, core attention and the
    output projection.

    The output projection `linear_proj` is a RowParallelLinear: its input (the context of this
    rank's heads) is split along the hidden dimension, and its output is all-reduced (or
    reduce-scattered along the sequence under sequence parallelism) across the TP group; its
    bias is returned separately for the fused bias-dropout-add.

    Args:
        config (TransformerConfig): the model config.
        submodules: the specs of the projections and the core attention.
        layer_number (int): 1-based global layer number.
        attn_mask_type (AttnMaskType): the mask type passed to the core attention.
        attention_type (str): "self" or "cross".
        pg_collection (ProcessGroupCollection, optional): its `tp` group splits the heads
            (default: the global tensor model parallel group).
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: Union[SelfAttentionSubmodules, CrossAttentionSubmodules],
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        self.config = config
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        # For normal attention without groups, num_query_groups == num_attention_heads,
        # so these two are the same.
        self.query_projection_size = self.config.kv_channels * self.config.num_attention_heads
        self.kv_projection_size = self.config.kv_channels * self.config.num_query_groups

        world_size = self.pg_collection.tp.size()
        self.hidden_size_per_attention_head = divide(
            self.query_projection_size, self.config.num_attention_heads
        )
        self.num_attention_heads_per_partition = divide(self.config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(self.config.num_query_groups, world_size)

        self.core_attention = build_module(
            submodules.core_attention,
            config=self.config,
            layer_number=self.layer_number,
            attn_mask_type=self.attn_mask_type,
            attention_type=self.attention_type,
            pg_collection=self.pg_collection,
        )

        self.checkpoint_core_attention = self.config.recompute_granularity == 'selective'

        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size,
            self.config.hidden_size,
            config=self.config,
            init_method=self.config.output_layer_init_method,
            bias=self.config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name='proj',
            tp_group=self.pg_collection.tp,
        )

    def _checkpointed_attention_forward(
        self,
        query,
        key,
        value,
        attention_mask,
        rotary_pos_emb=None,
        attn_mask_type=None,
        packed_seq_params=None,
    ):
        """Core attention under activation checkpointing (selective recompute): the attention
        scores, softmax and dropout are recomputed in backward instead of being stored."""

        def custom_forward(*inputs):
            query, key, value, attention_mask = inputs[:4]
            attn_mask_type = AttnMaskType(int(inputs[5].item()))
            return self.core_attention(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=attn_mask_type,
                packed_seq_params=packed_seq_params,
            )

        if attn_mask_type is None:
            attn_mask_type = self.attn_mask_type
        # The checkpoint function takes tensors: carry the enum as one.
        attn_mask_type = torch.tensor([attn_mask_type.value], dtype=torch.int)
        return tensor_parallel.checkpoint(
            custom_forward, False, query, key, value, attention_mask, rotary_pos_emb, attn_mask_type
        )

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        """An empty KV buffer [max_seq, max_batch, ng, hn] on the current device."""
        return torch.empty(
            inference_max_sequence_length,
            batch_size,
            self.num_query_groups_per_partition,
            dim,
            dtype=dtype,
            device=get_current_device(),
        )

    def _adjust_key_value_for_inference(self, inference_params, key, value, rotary_pos_emb):
        """Write this step's keys and values into the layer's KV cache and return the cached ones.

        The new key [sq, b, ng, hn] goes to positions [sequence_len_offset, +sq) and batch rows
        [batch_size_offset, +b) of the cache; the returned key and value cover positions
        [0, sequence_len_offset + sq) of those rows. With RoPE, keys are cached after rotation
        (each position's rotation is independent of the others, so the result equals rotating
        all cached keys again at every step, as Megatron does, without the repeated work); the
        query is rotated at its own positions.

        Returns:
            (query_pos_emb, key, value, attn_mask_type): the query's RoPE angles (None without
            RoPE), the cached key/value [sk, b, ng, hn] (already rotated), and the mask type. The
            causal mask of the core attention is aligned to the last query, so a one-token step
            attends to every cached position and a longer step stays causal within itself.
        """
        attn_mask_type = self.attn_mask_type
        if self.layer_number not in inference_params.key_value_memory_dict:
            inf_max_seq_length = inference_params.max_sequence_length
            inf_max_batch_size = inference_params.max_batch_size
            inference_key_memory = self._allocate_memory(
                inf_max_seq_length, inf_max_batch_size, key.shape[-1], key.dtype
            )
            inference_value_memory = self._allocate_memory(
                inf_max_seq_length, inf_max_batch_size, value.shape[-1], value.dtype
            )
            inference_params.key_value_memory_dict[self.layer_number] = (
                inference_key_memory,
                inference_value_memory,
            )
        else:
            inference_key_memory, inference_value_memory = inference_params.key_value_memory_dict[
                self.layer_number
            ]

        batch_start = inference_params.batch_size_offset
        batch_end = batch_start + key.size(1)
        if batch_end > inference_key_memory.size(1):
            raise ValueError(
                f"inference batch rows [{batch_start}, {batch_end}) exceed max_batch_size "
                f"({inference_key_memory.size(1)})"
            )
        sequence_start = inference_params.sequence_len_offset
        sequence_end = sequence_start + key.size(0)
        if sequence_end > inference_key_memory.size(0):
            raise ValueError(
                f"inference positions [{sequence_start}, {sequence_end}) exceed "
                f"max_sequence_length ({inference_key_memory.size(0)})"
            )

        q_pos_emb = None
        if rotary_pos_emb is not None:
            q_pos_emb, k_pos_emb = rotary_pos_emb
            q_pos_emb = q_pos_emb[sequence_start:sequence_end]  # [sq, 1, 1, d]
            key = apply_rotary_pos_emb(
                key, k_pos_emb[sequence_start:sequence_end], config=self.config
            )

        # Copy the new keys and values into the cache.
        inference_key_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = key
        inference_value_memory[sequence_start:sequence_end, batch_start:batch_end, ...] = value
        # [sk, b, ng, hn] with sk = sequence_end
        key = inference_key_memory[:sequence_end, batch_start:batch_end, ...]
        value = inference_value_memory[:sequence_end, batch_start:batch_end, ...]
        return q_pos_emb, key, value, attn_mask_type

    @abstractmethod
    def get_query_key_value_tensors(self, hidden_states, key_value_states):
        """Project to query [sq, b, np, hn], key and value [sk, b, ng, hn]."""

    def forward(
        self,
        hidden_states,
        attention_mask,
        key_value_states=None,
        inference_params=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
    ):
        """hidden_states [sq, b, h] (sq/tp under sequence parallelism) -> (output [sq, b, h], bias).

        Args:
            hidden_states: input of the layer.
            attention_mask: bool [b, 1, sq, sk], True = masked out, or None (causal).
            key_value_states: [sk, b, h] memory for cross attention.
            inference_params (InferenceParams): KV cache for autoregressive inference (self
                attention only); the keys and values of this call are appended to it and the
                attention runs over every cached position. A DynamicInferenceContext
                (is_dynamic_batching()) runs its own paged attention instead.
            rotary_pos_emb: [s, 1, 1, d] angles, or a (query, key) pair of them (with
                inference_params: angles for every position up to max_sequence_length).
            packed_seq_params: packed sequences: each segment attends only to itself (the
                rotary angles must already restart per segment, see GPTModel).
        """
        if packed_seq_params is not None and inference_params is not None:
            raise NotImplementedError("packed sequences are not supported with a KV cache")

        # query: [sq, b, np, hn], key / value: [sk, b, ng, hn]
        query, key, value = self.get_query_key_value_tensors(hidden_states, key_value_states)

        if inference_params is not None and self.attention_type == "self":
            if inference_params.is_dynamic_batching():
                # Packed requests over a paged KV cache: the context attends each request over
                # its own blocks (megatron/core/inference/contexts/dynamic_context.py).
                core_attn_out = inference_params.attention(
                    self.layer_number, query, key, value, rotary_pos_emb, self.config
                )
                return self.linear_proj(core_attn_out)
            if rotary_pos_emb is not None and not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb,) * 2
            q_pos_emb, key, value, attn_mask_type = self._adjust_key_value_for_inference(
                inference_params, key, value, rotary_pos_emb
            )
            if q_pos_emb is not None:
                query = apply_rotary_pos_emb(query, q_pos_emb, config=self.config)
            core_attn_out = self.core_attention(
                query, key, value, attention_mask, attn_mask_type=attn_mask_type
            )
            # [sq, b, hp] -> [sq, b, h]
            return self.linear_proj(core_attn_out)
        if inference_params is not None:
            raise NotImplementedError(
                "inference_params (KV cache) is only supported for self attention"
            )

        if rotary_pos_emb is not None:
            if not isinstance(rotary_pos_emb, tuple):
                rotary_pos_emb = (rotary_pos_emb,) * 2
            q_pos_emb, k_pos_emb = rotary_pos_emb
            query = apply_rotary_pos_emb(query, q_pos_emb[: query.size(0)], config=self.config)
            key = apply_rotary_pos_emb(key, k_pos_emb[: key.size(0)], config=self.config)

        if getattr(self.config, 'qk_clip', False) and self.training:
            from megatron.core.transformer.attention_logits import is_causal, record_max_logits

            scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
            record_max_logits(self, query, key, scale, is_causal(self))

        if self.checkpoint_core_attention and self.training:
            core_attn_out = self._checkpointed_attention_forward(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=self.attn_mask_type,
                packed_seq_params=packed_seq_params,
            )
        else:
            core_attn_out = self.core_attention(
                query,
                key,
                value,
                attention_mask,
                attn_mask_type=self.attn_mask_type,
                packed_seq_params=packed_seq_params,
            )

        # [sq, b, hp] -> [sq, b, h]
        output, bias = self.linear_proj(core_attn_out)
        return output, bias


class SelfAttention(Attention):
    """Self attention with a fused QKV ColumnParallelLinear (grouped-query layout, see module
    docstring) split by query groups across the TP group; no communication in its forward (the
    input is copied to / all-gathered into the TP region by the linear layer), all-reduce of the
    input gradient in backward.

    Args:
        config (TransformerConfig): the model config.
        submodules (SelfAttentionSubmodules): linear_qkv, core_attention, linear_proj, and the
            optional q_layernorm / k_layernorm.
        layer_number (int): 1-based global layer number.
        attn_mask_type (AttnMaskType): default AttnMaskType.padding.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: SelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type=AttnMaskType.padding,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="self",
            pg_collection=pg_collection,
        )

        self.linear_qkv = build_module(
            submodules.linear_qkv,
            self.config.hidden_size,
            self.query_projection_size + 2 * self.kv_projection_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear or self.config.add_qkv_bias,
            skip_bias_add=False,
            is_expert=False,
            tp_comm_buffer_name='qkv',
            tp_group=self.pg_collection.tp,
        )

        if submodules.q_layernorm is not None:
            self.q_layernorm = build_module(
                submodules.q_layernorm,
                hidden_size=self.hidden_size_per_attention_head,
                config=self.config,
                eps=self.config.layernorm_epsilon,
            )
        else:
            self.q_layernorm = None

        if submodules.k_layernorm is not None:
            self.k_layernorm = build_module(
                submodules.k_layernorm,
                hidden_size=self.hidden_size_per_attention_head,
                config=self.config,
                eps=self.config.layernorm_epsilon,
            )
        else:
            self.k_layernorm = None

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        """Split the fused projection into query [sq, b, np, hn], key and value [sq, b, ng, hn]."""
        # [sq, b, h] -> [sq, b, ng * (np/ng + 2) * hn]
        mixed_qkv, _ = self.linear_qkv(hidden_states)

        heads_per_group = (
            self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        )
        new_tensor_shape = mixed_qkv.size()[:-1] + (
            self.num_query_groups_per_partition,
            (heads_per_group + 2) * self.hidden_size_per_attention_head,
        )
        # [sq, b, ng * (np/ng + 2) * hn] -> [sq, b, ng, (np/ng + 2) * hn]
        mixed_qkv = mixed_qkv.view(*new_tensor_shape)

        split_arg_list = [
            heads_per_group * self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
            self.hidden_size_per_attention_head,
        ]
        # [sq, b, ng, (np/ng + 2) * hn] -> [sq, b, ng, np/ng * hn], [sq, b, ng, hn], [sq, b, ng, hn]
        query, key, value = torch.split(mixed_qkv, split_arg_list, dim=3)

        # [sq, b, ng, np/ng * hn] -> [sq, b, np, hn]
        query = query.reshape(query.size(0), query.size(1), -1, self.hidden_size_per_attention_head)

        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)

        return query, key, value


class CrossAttention(Attention):
    """Cross attention: queries from hidden_states (linear_q), keys and values from
    key_value_states (linear_kv, rows laid out [np, 2, hn]); both ColumnParallelLinear split by
    heads across the TP group.

    Args:
        config (TransformerConfig): the model config (num_query_groups must equal
            num_attention_heads).
        submodules (CrossAttentionSubmodules): linear_q, linear_kv, core_attention, linear_proj.
        layer_number (int): 1-based global layer number.
        attn_mask_type (AttnMaskType): default AttnMaskType.padding.
    """

    def __init__(
        self,
        config: TransformerConfig,
        submodules: CrossAttentionSubmodules,
        layer_number: int,
        attn_mask_type=AttnMaskType.padding,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(
            config=config,
            submodules=submodules,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type="cross",
            pg_collection=pg_collection,
        )

        if self.config.num_query_groups != self.config.num_attention_heads:
            raise ValueError(
                f"CrossAttention: num_query_groups ({self.config.num_query_groups}) must equal "
                f"num_attention_heads ({self.config.num_attention_heads}); grouped-query cross "
                "attention is not supported."
            )
        assert self.query_projection_size == self.kv_projection_size

        self.linear_q = build_module(
            submodules.linear_q,
            self.config.hidden_size,
            self.query_projection_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear,
            skip_bias_add=False,
            is_expert=False,
            tp_group=self.pg_collection.tp,
        )

        self.linear_kv = build_module(
            submodules.linear_kv,
            self.config.hidden_size,
            2 * self.kv_projection_size,
            config=self.config,
            init_method=self.config.init_method,
            gather_output=False,
            bias=self.config.add_bias_linear,
            skip_bias_add=False,
            is_expert=False,
            tp_group=self.pg_collection.tp,
        )

    def get_query_key_value_tensors(self, hidden_states, key_value_states):
        """query [sq, b, np, hn] from hidden_states; key, value [sk, b, np, hn] from
        key_value_states."""
        # [sk, b, h] -> [sk, b, np * 2 * hn]
        mixed_kv, _ = self.linear_kv(key_value_states)

        new_tensor_shape = mixed_kv.size()[:-1] + (
            self.num_attention_heads_per_partition,
            2 * self.hidden_size_per_attention_head,
        )
        mixed_kv = mixed_kv.view(*new_tensor_shape)  # [sk, b, np * 2 * hn] -> [sk, b, np, 2 * hn]

        # [sk, b, np, 2 * hn] -> 2 x [sk, b, np, hn]
        key, value = torch.split(mixed_kv, self.hidden_size_per_attention_head, dim=3)

        # [sq, b, h] -> [sq, b, np * hn]
        query, _ = self.linear_q(hidden_states)
        new_tensor_shape = query.size()[:-1] + (
            self.num_attention_heads_per_partition,
            self.hidden_size_per_attention_head,
        )
        query = query.view(*new_tensor_shape)  # [sq, b, np * hn] -> [sq, b, np, hn]

        return query, key, value
