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
from megatron.core.transformer.replica_consistency import check_replicated_parameters
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import divide, get_current_device

# A submodule slot of a spec: a ModuleSpec, a bare class, or None when the slot is left out.
_SubmoduleSpec = Optional[Union[ModuleSpec, type]]


@dataclass
class SelfAttentionSubmodules:
    """Specs of the submodules of `SelfAttention`; q_layernorm / k_layernorm are optional."""

    linear_qkv: _SubmoduleSpec = None
    core_attention: _SubmoduleSpec = None
    linear_proj: _SubmoduleSpec = None
    q_layernorm: _SubmoduleSpec = None
    k_layernorm: _SubmoduleSpec = None


@dataclass
class CrossAttentionSubmodules:
    """Specs of the submodules of `CrossAttention`."""

    linear_q: _SubmoduleSpec = None
    linear_kv: _SubmoduleSpec = None
    core_attention: _SubmoduleSpec = None
    linear_proj: _SubmoduleSpec = None


_AttentionSubmodules = Union[SelfAttentionSubmodules, CrossAttentionSubmodules]


def _cache_window(start, length, capacity, what, limit_name):
    """The slice [start, start + length) of one KV-cache dimension, or a ValueError when the
    cache (sized by `limit_name`) is too small for it."""
    end = start + length
    if end > capacity:
        raise ValueError(f"inference {what} [{start}, {end}) exceed {limit_name} ({capacity})")
    return start, end


def _as_query_key_pair(rotary_pos_emb):
    """RoPE angles as a (query, key) pair; one tensor serves both."""
    if rotary_pos_emb is None or isinstance(rotary_pos_emb, tuple):
        return rotary_pos_emb
    return (rotary_pos_emb, rotary_pos_emb)


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
        submodules: _AttentionSubmodules,
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
        self._derive_head_sizes()

        # Construction order is the order of the weight-init draws: the core attention (no
        # weights of its own in most backends) first, then the output projection; the subclass
        # builds its input projections afterwards.
        core_kwargs = {
            name: getattr(self, name)
            for name in ('config', 'layer_number', 'attn_mask_type', 'attention_type')
        }
        self.core_attention = build_module(
            submodules.core_attention, pg_collection=self.pg_collection, **core_kwargs
        )
        self.checkpoint_core_attention = self.config.recompute_granularity == 'selective'
        # [s, b, np * hn] split across TP -> [s, b, h] summed across TP.
        self.linear_proj = build_module(
            submodules.linear_proj,
            self.query_projection_size,
            self.config.hidden_size,
            input_is_parallel=True,
            tp_comm_buffer_name='proj',
            **self._projection_kwargs(
                self.config.output_layer_init_method, self.config.add_bias_linear, True
            ),
        )

    def _derive_head_sizes(self):
        """Projection widths and per-rank head counts: each of the tp ranks holds
        num_attention_heads / tp query heads and num_query_groups / tp key/value heads."""
        cfg = self.config
        tp_size = self.pg_collection.tp.size()
        # Equal widths unless grouped-query attention shares key/value heads between queries.
        self.query_projection_size = cfg.kv_channels * cfg.num_attention_heads
        self.kv_projection_size = cfg.kv_channels * cfg.num_query_groups
        self.hidden_size_per_attention_head = divide(
            self.query_projection_size, cfg.num_attention_heads
        )
        self.num_attention_heads_per_partition = divide(cfg.num_attention_heads, tp_size)
        self.num_query_groups_per_partition = divide(cfg.num_query_groups, tp_size)

    def _projection_kwargs(self, init_method, bias, skip_bias_add):
        """Keyword arguments every projection of this module shares (none is an MoE expert)."""
        return {
            'config': self.config,
            'init_method': init_method,
            'bias': bias,
            'skip_bias_add': skip_bias_add,
            'is_expert': False,
            'tp_group': self.pg_collection.tp,
        }

    def _checkpointed_attention_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
        rotary_pos_emb=None,
        attn_mask_type=None,
        packed_seq_params=None,
    ):
        """Core attention under activation checkpointing (selective recompute): the attention
        scores, softmax and dropout are recomputed in backward instead of being stored."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type

        def run_core_attention(q, k, v, mask, _rotary, mask_type_code):
            return self.core_attention(
                q,
                k,
                v,
                mask,
                attn_mask_type=AttnMaskType(int(mask_type_code.item())),
                packed_seq_params=packed_seq_params,
            )

        # checkpoint() passes tensors through, so the enum travels as a one-element tensor.
        mask_type_code = torch.tensor([mask_type.value], dtype=torch.int)
        inputs = (query, key, value, attention_mask, rotary_pos_emb, mask_type_code)
        return tensor_parallel.checkpoint(run_core_attention, False, *inputs)

    def _allocate_memory(self, inference_max_sequence_length, batch_size, dim, dtype):
        """An uninitialised KV buffer on the current device."""
        # [max_seq, max_batch, ng, hn]
        shape = (
            inference_max_sequence_length,
            batch_size,
            self.num_query_groups_per_partition,
            dim,
        )
        return torch.empty(shape, dtype=dtype, device=get_current_device())

    def _layer_kv_cache(self, inference_params, key, value):
        """This layer's (key, value) cache buffers, allocated on the first call."""
        caches = inference_params.key_value_memory_dict
        if self.layer_number not in caches:
            caches[self.layer_number] = tuple(
                self._allocate_memory(
                    inference_params.max_sequence_length,
                    inference_params.max_batch_size,
                    t.shape[-1],
                    t.dtype,
                )
                for t in (key, value)
            )
        return caches[self.layer_number]

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
        key_cache, value_cache = self._layer_kv_cache(inference_params, key, value)
        b0, b1 = _cache_window(
            inference_params.batch_size_offset,
            key.size(1),
            key_cache.size(1),
            "batch rows",
            "max_batch_size",
        )
        s0, s1 = _cache_window(
            inference_params.sequence_len_offset,
            key.size(0),
            key_cache.size(0),
            "positions",
            "max_sequence_length",
        )

        q_pos_emb = None
        if rotary_pos_emb is not None:
            # Angles of this step's positions only: [sq, 1, 1, d]
            q_pos_emb = rotary_pos_emb[0][s0:s1]
            key = apply_rotary_pos_emb(key, rotary_pos_emb[1][s0:s1], config=self.config)

        key_cache[s0:s1, b0:b1, ...] = key
        value_cache[s0:s1, b0:b1, ...] = value
        # Everything cached so far for these rows: [sk, b, ng, hn] with sk = s1
        return (
            q_pos_emb,
            key_cache[:s1, b0:b1, ...],
            value_cache[:s1, b0:b1, ...],
            self.attn_mask_type,
        )

    @abstractmethod
    def get_query_key_value_tensors(self, hidden_states, key_value_states):
        """Project to query [sq, b, np, hn], key and value [sk, b, ng, hn]."""

    def _forward_with_kv_cache(
        self, query, key, value, attention_mask, inference_params, rotary_pos_emb
    ):
        """One decoding step of self attention against the KV cache -> (output, bias)."""
        if inference_params.is_dynamic_batching():
            # Packed requests over a paged KV cache: the context attends each request over
            # its own blocks (megatron/core/inference/contexts/dynamic_context.py).
            context = inference_params.attention(
                self.layer_number, query, key, value, rotary_pos_emb, self.config
            )
            return self.linear_proj(context)
        q_pos_emb, key, value, mask_type = self._adjust_key_value_for_inference(
            inference_params, key, value, _as_query_key_pair(rotary_pos_emb)
        )
        if q_pos_emb is not None:
            query = apply_rotary_pos_emb(query, q_pos_emb, config=self.config)
        context = self.core_attention(query, key, value, attention_mask, attn_mask_type=mask_type)
        # [sq, b, np * hn] -> [sq, b, h]
        return self.linear_proj(context)

    def _rotate(self, query, key, rotary_pos_emb):
        """RoPE on query and key, each with the angles of its own leading positions."""
        q_angles, k_angles = _as_query_key_pair(rotary_pos_emb)
        query = apply_rotary_pos_emb(query, q_angles[: query.size(0)], config=self.config)
        key = apply_rotary_pos_emb(key, k_angles[: key.size(0)], config=self.config)
        return query, key

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: Optional[torch.Tensor],
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

        if inference_params is not None:
            if self.attention_type != "self":
                raise NotImplementedError(
                    "inference_params (KV cache) is only supported for self attention"
                )
            return self._forward_with_kv_cache(
                query, key, value, attention_mask, inference_params, rotary_pos_emb
            )

        if rotary_pos_emb is not None:
            query, key = self._rotate(query, key, rotary_pos_emb)

        if getattr(self.config, 'qk_clip', False) and self.training:
            from megatron.core.transformer.attention_logits import is_causal, record_max_logits

            scale = 1.0 / math.sqrt(self.hidden_size_per_attention_head)
            record_max_logits(self, query, key, scale, is_causal(self))

        recompute = self.checkpoint_core_attention and self.training
        attend = self._checkpointed_attention_forward if recompute else self.core_attention
        context = attend(
            query,
            key,
            value,
            attention_mask,
            attn_mask_type=self.attn_mask_type,
            packed_seq_params=packed_seq_params,
        )
        # [sq, b, np * hn] -> [sq, b, h]
        return self.linear_proj(context)


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
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(
            config, submodules, layer_number, attn_mask_type, "self", pg_collection=pg_collection
        )
        # [s, b, h] -> [s, b, ng * (np/ng + 2) * hn], rows split across TP by query group.
        qkv_width = self.query_projection_size + 2 * self.kv_projection_size
        qkv_bias = self.config.add_bias_linear or self.config.add_qkv_bias
        self.linear_qkv = build_module(
            submodules.linear_qkv,
            self.config.hidden_size,
            qkv_width,
            gather_output=False,
            tp_comm_buffer_name='qkv',
            **self._projection_kwargs(self.config.init_method, qkv_bias, False),
        )
        # Optional per-head norms of query and key (QK-norm), over the head dimension hn.
        for name in ('q_layernorm', 'k_layernorm'):
            spec = getattr(submodules, name)
            norm = None
            if spec is not None:
                norm = build_module(
                    spec,
                    hidden_size=self.hidden_size_per_attention_head,
                    config=self.config,
                    eps=self.config.layernorm_epsilon,
                )
            setattr(self, name, norm)

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None):
        """Split the fused projection into query [sq, b, np, hn], key and value [sq, b, ng, hn]."""
        hn = self.hidden_size_per_attention_head
        ng = self.num_query_groups_per_partition
        heads_per_group = self.num_attention_heads_per_partition // ng
        # [sq, b, h] -> [sq, b, ng * (np/ng + 2) * hn]
        mixed_qkv, _ = self.linear_qkv(hidden_states)
        # -> [sq, b, ng, np/ng + 2, hn]: per group its queries, then one key, then one value
        grouped = mixed_qkv.view(*mixed_qkv.shape[:-1], ng, heads_per_group + 2, hn)
        query, key, value = torch.split(grouped, [heads_per_group, 1, 1], dim=3)
        # [sq, b, ng, np/ng, hn] -> [sq, b, np, hn]
        query = query.reshape(*query.shape[:2], -1, hn)
        # [sq, b, ng, 1, hn] -> [sq, b, ng, hn]
        key, value = key.squeeze(3), value.squeeze(3)

        if self.q_layernorm is not None:
            query = self.q_layernorm(query)
        if self.k_layernorm is not None:
            key = self.k_layernorm(key)
        if self.config.test_mode:
            self.run_realtime_tests()
        return query, key, value

    def run_realtime_tests(self):
        """`test_mode`: the query/key layernorm parameters must be bit-identical on every tensor-
        and data-parallel (with context-parallel) rank; raises ReplicaMismatchError otherwise.

        One all-gather per group in each forward (see replica_consistency.py); nothing to check
        without qk-layernorm.
        """
        norms = [(n, m) for n, m in (('q', self.q_layernorm), ('k', self.k_layernorm)) if m]
        if not norms:
            return
        params = [
            (f'{label}_layernorm.{name}', param)
            for label, module in norms
            for name, param in module.named_parameters()
        ]
        check_replicated_parameters(
            params,
            {'tensor-parallel': self.pg_collection.tp, 'data-parallel': self._replica_group()},
            where=f'layer {self.layer_number} self_attention.',
        )

    def _replica_group(self):
        """The data-parallel group with context parallelism (resolved on first use only, so a
        model built without test_mode needs no data-parallel group)."""
        if self.pg_collection.dp_cp is None:
            self.pg_collection = resolve_process_groups(self.pg_collection, ("dp_cp",))
        return self.pg_collection.dp_cp


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
        attn_mask_type: AttnMaskType = AttnMaskType.padding,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(
            config, submodules, layer_number, attn_mask_type, "cross", pg_collection=pg_collection
        )
        if self.config.num_query_groups != self.config.num_attention_heads:
            raise ValueError(
                f"CrossAttention: num_query_groups ({self.config.num_query_groups}) must equal "
                f"num_attention_heads ({self.config.num_attention_heads}); grouped-query cross "
                "attention is not supported."
            )
        assert self.query_projection_size == self.kv_projection_size

        # Queries [s, b, h] -> [s, b, np * hn] first, then keys and values -> [s, b, np * 2 * hn]:
        # the order of their weight-init draws.
        shared = self._projection_kwargs(
            self.config.init_method, self.config.add_bias_linear, False
        )
        for name, width in (
            ('linear_q', self.query_projection_size),
            ('linear_kv', 2 * self.kv_projection_size),
        ):
            layer = build_module(
                getattr(submodules, name),
                self.config.hidden_size,
                width,
                gather_output=False,
                **shared,
            )
            setattr(self, name, layer)

    def get_query_key_value_tensors(self, hidden_states, key_value_states):
        """query [sq, b, np, hn] from hidden_states; key, value [sk, b, np, hn] from
        key_value_states."""
        heads = self.num_attention_heads_per_partition
        hn = self.hidden_size_per_attention_head
        # [sk, b, h] -> [sk, b, np * 2 * hn] -> [sk, b, np, 2, hn]
        mixed_kv, _ = self.linear_kv(key_value_states)
        mixed_kv = mixed_kv.view(*mixed_kv.shape[:-1], heads, 2, hn)
        # [sk, b, np, 2, hn] -> 2 x [sk, b, np, hn]
        key, value = mixed_kv.unbind(dim=3)
        # [sq, b, h] -> [sq, b, np * hn] -> [sq, b, np, hn]
        query, _ = self.linear_q(hidden_states)
        query = query.view(*query.shape[:-1], heads, hn)
        return query, key, value
