"""Multi-latent attention (MLA, DeepSeek-V2/V3; later Megatron's `multi_latent_attention.py`).

Notation: s sequence, b batch, h hidden, n heads, np = n / tp heads of this rank, dn =
qk_head_dim (the non-rotary query/key part), dr = qk_pos_emb_head_dim (the rotary part), dv =
v_head_dim, rq = q_lora_rank, rkv = kv_lora_rank.

    q        = W_q_up · norm_q(W_q_down · x)              (or W_q · x without q_lora_rank)
    [c ; kr] = W_kv_down · x                               c [rkv], kr [dr] (one for all heads)
    [kn ; v] = W_kv_up · norm_kv(c)                        per head: kn [dn], v [dv]
    q = [qn ; rope(qr)], k = [kn ; rope(kr)]               per head [dn + dr]
    out = W_proj · softmax(q k^T · scale) v

Tensor parallelism: the up projections and the query projection are ColumnParallelLinear split by
heads; the down projections are duplicated (whole on every rank, see duplicated_linear.py);
linear_proj is a RowParallelLinear whose output is all-reduced (reduce-scattered under sequence
parallelism). The shared rotary key `kr` enters every rank's heads, so its gradient is
all-reduced over TP in backward (reduce-scattered under sequence parallelism, where it is first
all-gathered along the sequence).

KV cache: the static cache, and the paged cache of the dynamic engine, store the normalised
latent c [rkv] and the rotated kr [dr] per token instead of the expanded keys and values
[n (dn + dr + dv)]; every step re-expands the cached latent with W_kv_up.
"""

import math
from dataclasses import dataclass
from typing import Optional, Union

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
    YarnRotaryEmbedding,
    optional_offset,
    rotary_cos_sin,
    rotate_deinterleaved,
    yarn_get_mscale,
)
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.utils import divide, get_current_device


@dataclass
class MLASelfAttentionSubmodules:
    """Specs of the submodules of `MLASelfAttention` (Megatron's names)."""

    linear_q_proj: Optional[Union[ModuleSpec, type]] = None
    linear_q_down_proj: Optional[Union[ModuleSpec, type]] = None
    linear_q_up_proj: Optional[Union[ModuleSpec, type]] = None
    linear_kv_down_proj: Optional[Union[ModuleSpec, type]] = None
    linear_kv_up_proj: Optional[Union[ModuleSpec, type]] = None
    core_attention: Optional[Union[ModuleSpec, type]] = None
    linear_proj: Optional[Union[ModuleSpec, type]] = None
    q_layernorm: Optional[Union[ModuleSpec, type]] = None
    kv_layernorm: Optional[Union[ModuleSpec, type]] = None


def mla_softmax_scale(config) -> float:
    """1 / sqrt(dn + dr), times g(factor, mscale_all_dim)^2 under YaRN."""
    scale = 1.0 / math.sqrt(config.qk_head_dim + config.qk_pos_emb_head_dim)
    if config.rope_type == "yarn":
        mscale = yarn_get_mscale(config.rotary_scaling_factor, config.mscale_all_dim)
        scale *= mscale * mscale
    return scale


class MLACoreAttention(MegatronModule):
    """softmax(q k^T · scale) v over this rank's heads, with value heads of their own size.

    No parameters and no communication. Causal layers ignore the passed mask (as the GPT core
    attention does); other mask types apply it. Attention dropout runs under the model-parallel
    RNG tracker, so TP ranks drop different elements.

    Args:
        config (MLATransformerConfig): the model config.
        layer_number (int): 1-based layer number.
        attn_mask_type (AttnMaskType): causal or padding.
        softmax_scale (float): the logit scale.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, softmax_scale):
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale
        self.dropout_p = config.attention_dropout

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask) -> Tensor:
        """query [sq, b, np, dq], key [sk, b, np, dq], value [sk, b, np, dv] -> [sq, b, np * dv].

        With sq < sk (decoding over a KV cache) the causal mask is aligned to the last query.
        """
        sq, b, np_, _ = query.shape
        sk = key.size(0)
        q = query.permute(1, 2, 0, 3)  # [b, np, sq, dq]
        k = key.permute(1, 2, 0, 3)  # [b, np, sk, dq]
        v = value.permute(1, 2, 0, 3)  # [b, np, sk, dv]
        dropout = self.training and self.dropout_p > 0.0
        fused = not dropout and q.dtype == torch.float32
        # Square causal attention takes the fused causal kernel instead of an explicit mask.
        square_causal = self.attn_mask_type == AttnMaskType.causal and sq == sk
        if fused and square_causal:
            keep = None
        elif self.attn_mask_type == AttnMaskType.causal:
            keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        elif attention_mask is not None:
            keep = ~attention_mask  # [b, 1, sq, sk], True = attend
        else:
            keep = None
        if fused:
            context = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=keep,
                is_causal=square_causal and sq > 1,
                scale=self.softmax_scale,
            )
        else:
            scores = torch.matmul(q, k.transpose(-1, -2)).float() * self.softmax_scale
            if keep is not None:
                scores = scores.masked_fill(~keep, float('-inf'))
            probs = torch.softmax(scores, dim=-1).to(v.dtype)  # [b, np, sq, sk]
            if dropout:
                if self.config.sequence_parallel:
                    probs = torch.nn.functional.dropout(probs, self.dropout_p)
                else:
                    with tensor_parallel.get_cuda_rng_tracker().fork():
                        probs = torch.nn.functional.dropout(probs, self.dropout_p)
            context = torch.matmul(probs, v)  # [b, np, sq, dv]
        context = context.permute(2, 0, 1, 3).contiguous()  # [sq, b, np, dv]
        return context.view(sq, b, -1)  # [sq, b, np * dv]


class MLASelfAttention(MegatronModule):
    """Multi-latent self attention (see the module docstring for the math and the TP split).

    Args:
        config (MLATransformerConfig): the model config.
        submodules (MLASelfAttentionSubmodules): the projections, latent norms and core attention.
        layer_number (int): 1-based global layer number.
        attn_mask_type (AttnMaskType): default causal.
        pg_collection (ProcessGroupCollection, optional): its `tp` group splits the heads.
    """

    def __init__(
        self,
        config,
        submodules: MLASelfAttentionSubmodules,
        layer_number: int,
        attn_mask_type: AttnMaskType = AttnMaskType.causal,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        tp_group = self.pg_collection.tp
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.attention_type = "self"
        n = config.num_attention_heads
        self.num_attention_heads_per_partition = divide(n, tp_group.size())
        self.q_head_dim = config.qk_head_dim + config.qk_pos_emb_head_dim
        self.kv_cache_latent = True

        def column(in_size, out_size):
            return dict(
                input_size=in_size,
                output_size=out_size,
                config=config,
                init_method=config.init_method,
                gather_output=False,
                bias=False,
                skip_bias_add=False,
                is_expert=False,
                tp_group=tp_group,
            )

        if config.q_lora_rank is None:
            self.linear_q_proj = build_module(
                submodules.linear_q_proj, **column(config.hidden_size, n * self.q_head_dim)
            )
        else:
            self.linear_q_down_proj = build_module(
                submodules.linear_q_down_proj,
                config.hidden_size,
                config.q_lora_rank,
                config=config,
                init_method=config.init_method,
                bias=False,
            )
            self.q_layernorm = build_module(
                submodules.q_layernorm,
                hidden_size=config.q_lora_rank,
                config=config,
                eps=config.layernorm_epsilon,
            )
            self.linear_q_up_proj = build_module(
                submodules.linear_q_up_proj, **column(config.q_lora_rank, n * self.q_head_dim)
            )
        self.linear_kv_down_proj = build_module(
            submodules.linear_kv_down_proj,
            config.hidden_size,
            config.kv_lora_rank + config.qk_pos_emb_head_dim,
            config=config,
            init_method=config.init_method,
            bias=False,
        )
        self.kv_layernorm = build_module(
            submodules.kv_layernorm,
            hidden_size=config.kv_lora_rank,
            config=config,
            eps=config.layernorm_epsilon,
        )
        self.linear_kv_up_proj = build_module(
            submodules.linear_kv_up_proj,
            **column(config.kv_lora_rank, n * (config.qk_head_dim + config.v_head_dim)),
        )
        # The latent norms see the same (or, under sequence parallelism, this rank's share of
        # the) tokens on every TP rank: they are not per-head norms.
        for norm in (getattr(self, 'q_layernorm', None), self.kv_layernorm):
            for param in norm.parameters() if norm is not None else ():
                setattr(param, 'is_latent_norm', True)

        self.core_attention = build_module(
            submodules.core_attention,
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            softmax_scale=mla_softmax_scale(config),
        )
        self.linear_proj = build_module(
            submodules.linear_proj,
            n * config.v_head_dim,
            config.hidden_size,
            config=config,
            init_method=config.output_layer_init_method,
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=True,
            is_expert=False,
            tp_comm_buffer_name='proj',
            tp_group=tp_group,
        )
        yarn = config.rope_type == "yarn"
        self.rotary_pos_emb = YarnRotaryEmbedding(
            config.qk_pos_emb_head_dim,
            rotary_base=config.rotary_base,
            scaling_factor=config.rotary_scaling_factor if yarn else 1.0,
            original_max_position_embeddings=config.original_max_position_embeddings,
            beta_fast=config.beta_fast,
            beta_slow=config.beta_slow,
            mscale=config.mscale if yarn else 1.0,
            mscale_all_dim=config.mscale_all_dim if yarn else 0.0,
            correction_range_round_to_int=config.yarn_correction_range_round_to_int,
        )

    def _query(self, hidden_states: Tensor) -> Tensor:
        """[s(/tp), b, h] -> [s, b, np, dn + dr]; the column-parallel projection all-gathers the
        sequence under sequence parallelism."""
        if self.config.q_lora_rank is None:
            q, _ = self.linear_q_proj(hidden_states)  # [s, b, np * (dn + dr)]
        else:
            q_latent, _ = self.linear_q_down_proj(hidden_states)  # [s(/tp), b, rq]
            q, _ = self.linear_q_up_proj(self.q_layernorm(q_latent))  # [s, b, np * (dn + dr)]
        return q.view(q.size(0), q.size(1), self.num_attention_heads_per_partition, -1)

    def _latent(self, hidden_states: Tensor):
        """[s(/tp), b, h] -> normalised latent c [s(/tp), b, rkv] and the rotary key [s, b, 1, dr]
        (sequence-gathered under sequence parallelism; its backward sums over TP)."""
        kv_latent, _ = self.linear_kv_down_proj(hidden_states)  # [s(/tp), b, rkv + dr]
        latent, k_pos = torch.split(
            kv_latent, [self.config.kv_lora_rank, self.config.qk_pos_emb_head_dim], dim=-1
        )
        if self.config.sequence_parallel:
            k_pos = tensor_parallel.gather_from_sequence_parallel_region(
                k_pos, group=self.pg_collection.tp
            )
        else:
            k_pos = tensor_parallel.copy_to_tensor_model_parallel_region(
                k_pos, group=self.pg_collection.tp
            )
        return self.kv_layernorm(latent), k_pos.unsqueeze(2)  # [s, b, 1, dr]

    def _expand(self, latent: Tensor, k_pos: Tensor):
        """Keys [sk, b, np, dn + dr] and values [sk, b, np, dv] from the latent and the rotated
        rotary key."""
        kv, _ = self.linear_kv_up_proj(latent)  # [sk, b, np * (dn + dv)]
        kv = kv.view(kv.size(0), kv.size(1), self.num_attention_heads_per_partition, -1)
        k_nope, value = torch.split(kv, [self.config.qk_head_dim, self.config.v_head_dim], dim=-1)
        k_pos = k_pos.expand(-1, -1, self.num_attention_heads_per_partition, -1)
        return torch.cat((k_nope, k_pos), dim=-1), value

    def _cache_latent(self, inference_params, latent: Tensor, k_pos: Tensor):
        """Append this step's latent [sq, b, rkv] and rotated rotary key [sq, b, 1, dr] to the
        layer's cache; return the cached ones of every position so far."""
        store = inference_params.key_value_memory_dict
        if self.layer_number not in store:
            shape = (inference_params.max_sequence_length, inference_params.max_batch_size)
            device = get_current_device()
            store[self.layer_number] = (
                torch.empty(*shape, latent.size(-1), dtype=latent.dtype, device=device),
                torch.empty(*shape, 1, k_pos.size(-1), dtype=k_pos.dtype, device=device),
            )
        latent_memory, k_pos_memory = store[self.layer_number]
        start = inference_params.sequence_len_offset
        end = start + latent.size(0)
        b0 = inference_params.batch_size_offset
        b1 = b0 + latent.size(1)
        if end > latent_memory.size(0) or b1 > latent_memory.size(1):
            raise ValueError(
                f"inference positions [{start}, {end}) / batch rows [{b0}, {b1}) exceed the "
                f"cache ({latent_memory.size(0)} positions, {latent_memory.size(1)} rows)"
            )
        latent_memory[start:end, b0:b1] = latent
        k_pos_memory[start:end, b0:b1] = k_pos
        return latent_memory[:end, b0:b1], k_pos_memory[:end, b0:b1]

    def _rotate(self, query: Tensor, k_pos: Tensor, cos: Tensor, sin: Tensor):
        """RoPE on the rotary part of the query [s, b, np, dn + dr] and on k_pos [s, b, 1, dr];
        cos, sin [s, 1, 1, dr/2] from `rotary_cos_sin`."""
        q_nope, q_pos = torch.split(
            query, [self.config.qk_head_dim, self.config.qk_pos_emb_head_dim], dim=-1
        )
        query = torch.cat((q_nope, rotate_deinterleaved(q_pos, cos, sin)), dim=-1)
        return query, rotate_deinterleaved(k_pos, cos, sin)

    def _forward_paged(self, hidden_states: Tensor, context):
        """A dynamic-engine step: the requests' new tokens packed as [T, 1, h], each at its own
        position; the latent cache is paged by the context (`latent_attention`)."""
        if self.config.sequence_parallel:
            raise NotImplementedError("KV-cache inference with sequence parallelism")
        query = self._query(hidden_states)  # [T, 1, np, dn + dr]
        latent, k_pos = self._latent(hidden_states)  # [T, 1, rkv], [T, 1, 1, dr]
        freqs, mscale = self.rotary_pos_emb(context.max_sequence_length)  # [S, 1, 1, dr]
        freqs = freqs.index_select(0, context.step_position_ids[0])  # [T, 1, 1, dr]
        cos, sin = rotary_cos_sin(freqs, mscale, query.dtype)  # [T, 1, 1, dr/2] each
        query, k_pos = self._rotate(query, k_pos, cos, sin)
        out = context.latent_attention(
            self.layer_number, query, latent, k_pos, self._expand, self.core_attention.softmax_scale
        )  # [T, 1, np * dv]
        return self.linear_proj(out)

    def forward(
        self,
        hidden_states: Tensor,
        attention_mask: Optional[Tensor],
        key_value_states=None,
        inference_params=None,
        rotary_pos_emb=None,
        packed_seq_params=None,
    ):
        """hidden_states [s, b, h] ([s/tp, b, h] under sequence parallelism) -> (output, bias).

        The rotary angles are computed here for positions 0 .. s-1 (after the cached positions
        with a KV cache); a GPT-level `rotary_pos_emb` is not used.
        """
        if packed_seq_params is not None:
            raise NotImplementedError("multi-latent attention does not support packed sequences")
        if inference_params is not None and inference_params.is_dynamic_batching():
            return self._forward_paged(hidden_states, inference_params)
        query = self._query(hidden_states)  # [s, b, np, dn + dr]
        latent, k_pos = self._latent(hidden_states)
        offset = optional_offset(inference_params)
        # [s, 1, 1, dr/2] each, kept by the embedding from one call to the next
        cos, sin = self.rotary_pos_emb.cos_sin(query.size(0), offset=offset, dtype=query.dtype)
        query, k_pos = self._rotate(query, k_pos, cos, sin)
        if inference_params is not None:
            if self.config.sequence_parallel:
                raise NotImplementedError("KV-cache inference with sequence parallelism")
            latent, k_pos = self._cache_latent(inference_params, latent, k_pos)
        # Under sequence parallelism the latent stays [s/tp, b, rkv]: the up projection
        # all-gathers it.
        key, value = self._expand(latent, k_pos)
        if self.config.qk_clip and self.training:
            from megatron.core.transformer.attention_logits import is_causal, record_max_logits

            scale = self.core_attention.softmax_scale
            record_max_logits(self, query, key, scale, is_causal(self))
        context = self.core_attention(query, key, value, attention_mask)  # [s, b, np * dv]
        return self.linear_proj(context)
