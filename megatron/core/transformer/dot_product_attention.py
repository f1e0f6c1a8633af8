"""Core attention: softmax(Q K^T / sqrt(hn)) V on the heads of this tensor-parallel rank.

Notation: sq / sk query / key length, b batch, np query heads per partition, ng query groups
(key/value heads) per partition, hn head size, hp = np * hn.
"""

import contextlib
import math
from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.fusions.fused_softmax import FusedScaleMaskSoftmax, causal_mask_for_queries
from megatron.core.packed_seq_params import (
    PackedSeqParams,
    packed_real_rows,
    packed_segment_ids,
)
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.context_parallel.attention import (
    context_parallel_attention,
    context_parallel_groups,
    cp_comm_type_of_layer,
)
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import attention_mask_func
from megatron.core.utils import divide


class DotProductAttention(MegatronModule):
    """Scaled dot-product attention over this rank's heads (no parameters, no communication).

    The attention heads are split across the tensor-parallel group by the QKV projection, so each
    rank attends over its own np heads. Attention dropout on those heads runs under the
    model-parallel RNG tracker (`get_cuda_rng_tracker().fork()`), so different TP ranks drop
    different elements while data-parallel replicas of a rank stay identical. Under sequence
    parallelism the whole transformer block already runs under that fork.

    Args:
        config (TransformerConfig): the model config.
        layer_number (int): 1-based global layer number (query-key layer scaling uses it).
        attn_mask_type (AttnMaskType): causal: fused causal attention, any passed mask ignored
            (see `_can_use_sdpa`); other types apply the passed mask. With packed sequences
            (PackedSeqParams) each packed segment attends only to itself.
        attention_type (str): "self" or "cross".
        attention_dropout (float, optional): overrides config.attention_dropout.
        pg_collection (ProcessGroupCollection, optional): its `tp` group splits the heads
            (default: the global tensor model parallel group); with context_parallel_size > 1
            its `cp` group (and `hcp` for 'a2a+p2p') splits the sequence.

    With context parallelism each rank holds s/cp tokens in the dual-chunk layout (packed
    sequences: the per-sequence layout, with this rank's PackedSeqParams) and the attention runs
    over the CP group (`config.cp_comm_type`: ring, all-gather or all-to-all; see
    megatron/core/transformer/context_parallel); only causal and no_mask layers are exact there,
    other mask types raise ValueError.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        # Context parallelism: this rank holds s/cp tokens; attention runs over the CP group.
        self.cp_groups, self.cp_comm_type = None, None
        if self.config.context_parallel_size > 1:
            self.cp_comm_type = cp_comm_type_of_layer(config, max(1, layer_number))
            required = ("tp", "cp", "hcp") if self.cp_comm_type == "a2a+p2p" else ("tp", "cp")
            self.pg_collection = resolve_process_groups(pg_collection, required)
            self.cp_groups = context_parallel_groups(config, self.pg_collection)
            if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
                raise ValueError(
                    f"context_parallel_size ({config.context_parallel_size}): {attention_type} "
                    f"attention with a {attn_mask_type.name} mask cannot be split over the "
                    "sequence; context parallelism supports causal and no_mask attention only "
                    "(GPT), not padding masks (BERT, T5) or --reset-attention-mask"
                )

        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type

        self._derive_head_sizes()
        # Query-key layer scaling divides the scores by an extra layer_number before the
        # softmax (which multiplies them back in fp32) to keep fp16 scores in range.
        coeff = self.layer_number if self.config.apply_query_key_layer_scaling else None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if coeff is not None:
            self.norm_factor *= coeff
        cfg = self.config
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            attn_mask_type=self.attn_mask_type,
            mask_func=attention_mask_func,
            scale=coeff,
            input_in_fp16=cfg.fp16,
            input_in_bf16=cfg.bf16,
            scaled_masked_softmax_fusion=cfg.masked_softmax_fusion,
            softmax_in_fp32=cfg.attention_softmax_in_fp32,
        )

        # Dropping out whole keys per query, as in the original Transformer.
        self.attention_dropout_p = (
            self.config.attention_dropout if attention_dropout is None else attention_dropout
        )
        self.attention_dropout = torch.nn.Dropout(self.attention_dropout_p)

    def _derive_head_sizes(self):
        """Per-rank sizes: the tp ranks split the num_attention_heads query heads (hp = np * hn
        each) and the num_query_groups key/value heads evenly."""
        heads, groups = self.config.num_attention_heads, self.config.num_query_groups
        tp_size = self.pg_collection.tp.size()
        projection_size = self.config.kv_channels * heads
        self.hidden_size_per_partition = divide(projection_size, tp_size)
        self.hidden_size_per_attention_head = divide(projection_size, heads)
        self.num_attention_heads_per_partition = divide(heads, tp_size)
        self.num_query_groups_per_partition = divide(groups, tp_size)

    def _can_use_sdpa(
        self, query: Tensor, attention_mask: Optional[Tensor], attn_mask_type
    ) -> bool:
        """Whether torch's fused scaled_dot_product_attention runs: causal layers, no dropout, and
        the softmax in the input precision.

        A causal layer ignores `attention_mask`, as Megatron's fused upper-triangular softmax and
        Transformer Engine's causal attention do: the dataloader's mask of a causal model without
        per-document resets is the causal mask itself. Models whose mask carries more than
        causality (`--reset-attention-mask`) build their attention with `AttnMaskType.arbitrary`,
        which keeps the exact masked path.
        """
        # A no_mask layer given no mask (the ViT) attends to every key: the fused kernel's
        # non-causal form computes exactly that.
        unmasked = attn_mask_type == AttnMaskType.no_mask and attention_mask is None
        if attn_mask_type != AttnMaskType.causal and not unmasked:
            return False
        if self.training and self.attention_dropout_p > 0.0:
            return False
        if query.dtype != torch.float32 and self.config.attention_softmax_in_fp32:
            return False
        return True

    def _context_parallel_forward(
        self, query, key, value, attn_mask_type, packed_seq_params=None
    ) -> Tensor:
        """Exact attention over the whole sequence of the context parallel group.

        query [s/cp, b, np, hn], key / value [s/cp, b, ng, hn] in the dual-chunk layout (packed
        sequences: the per-sequence layout, with this rank's packed_seq_params) -> context
        [s/cp, b, hp]; the communication (`cp_comm_type`) runs forward and backward over the CP
        group (see megatron/core/transformer/context_parallel).
        """
        if query.size(0) != key.size(0):
            raise ValueError(
                "context parallel attention needs queries and keys of the same (local) length; "
                "inference with a KV cache needs --context-parallel-size 1"
            )
        if attn_mask_type not in (AttnMaskType.causal, AttnMaskType.no_mask):
            raise ValueError(
                f"context parallelism supports causal and no_mask attention only, got "
                f"{attn_mask_type.name} (an explicit mask cannot be split over the sequence)"
            )
        dropout_p = self.attention_dropout_p if self.training else 0.0
        seed = 0
        if dropout_p > 0.0:
            # One seed per call, from the model-parallel stream (TP ranks differ, as their
            # heads do); the per-block masks derive from it.
            if self.config.sequence_parallel:
                seed = int(torch.randint(0, 2**62, (1,), device=query.device).item())
            else:
                with tensor_parallel.get_cuda_rng_tracker().fork():
                    seed = int(torch.randint(0, 2**62, (1,), device=query.device).item())
        return context_parallel_attention(
            query,
            key,
            value,
            groups=self.cp_groups,
            comm_type=self.cp_comm_type,
            causal=attn_mask_type == AttnMaskType.causal,
            scale=1.0 / math.sqrt(self.hidden_size_per_attention_head),
            dropout_p=dropout_p,
            dropout_seed=seed,
            packed_seq_params=packed_seq_params,
        )

    def _packed_sdpa(self, query, key, value, cu_seqlens: Tensor, causal: bool) -> Tensor:
        """One fused scaled_dot_product_attention call per packed segment.

        The segments index the batch-major stream of the b samples (see PackedSeqParams).
        """
        sq, b, np_, hn = query.shape
        # [sq, b, np, hn] -> [b * sq, np, hn]
        q, k, v = (t.transpose(0, 1).reshape(b * sq, np_, hn) for t in (query, key, value))
        bounds = cu_seqlens.tolist()
        assert bounds[0] == 0 and bounds[-1] == b * sq, (bounds[-1], b, sq)
        pieces = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            # [n, np, hn] -> [np, n, hn] -> attention -> [n, np, hn]
            piece = torch.nn.functional.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                is_causal=causal and end - start > 1,
                scale=1.0 / math.sqrt(hn),
            )
            pieces.append(piece.transpose(0, 1))
        context = torch.cat(pieces).view(b, sq, self.hidden_size_per_partition)  # [b, sq, hp]
        return context.transpose(0, 1).contiguous()  # [b, sq, hp] -> [sq, b, hp]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Optional[Tensor],
        attn_mask_type: AttnMaskType = None,
        packed_seq_params: Optional[PackedSeqParams] = None,
    ) -> Tensor:
        """query [sq, b, np, hn], key / value [sk, b, ng, hn], attention_mask bool [b, 1, sq, sk]
        (True = masked out) or None -> context [sq, b, hp].

        With packed_seq_params (cu_seqlens over the b * sq stream, see PackedSeqParams) the
        passed mask is ignored and every segment attends only to itself: one fused call per
        segment where `_can_use_sdpa` allows, else the masked path with a block-diagonal mask;
        padding rows inside a segment (cu_seqlens_q_padded) get a zero output.
        """
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        if self.cp_groups is not None:
            return self._context_parallel_forward(
                query, key, value, attn_mask_type, packed_seq_params
            )

        # Expand key/value heads to one per query head (grouped-query attention).
        groups = self.num_attention_heads_per_partition // self.num_query_groups_per_partition
        if groups > 1:
            key = key.repeat_interleave(groups, dim=2)  # [sk, b, ng, hn] -> [sk, b, np, hn]
            value = value.repeat_interleave(groups, dim=2)

        sq, b, np_, hn = query.shape
        sk = key.size(0)

        if packed_seq_params is not None:
            # Each packed segment attends to itself only; padding inside a segment gets no output.
            assert sq == sk, "packed sequences need self attention over the whole sequence"
            causal = attn_mask_type == AttnMaskType.causal
            offsets = packed_seq_params.segment_offsets()
            real = packed_real_rows(packed_seq_params, b * sq)
            if self._can_use_sdpa(query, None, attn_mask_type):
                context = self._packed_sdpa(query, key, value, offsets, causal)
            else:
                # Dropout or a 16-bit softmax in fp32: the exact masked path, segments apart.
                mask = packed_attention_mask(offsets, sq, b, causal)
                context = self._masked_attention(query, key, value, mask, AttnMaskType.arbitrary)
            if real is not None:
                context = context * real.view(b, sq).t().unsqueeze(-1).to(context.dtype)
            return context

        if self._can_use_sdpa(query, attention_mask, attn_mask_type):
            q = query.permute(1, 2, 0, 3)  # [b, np, sq, hn]
            k = key.permute(1, 2, 0, 3)  # [b, np, sk, hn]
            v = value.permute(1, 2, 0, 3)
            if attn_mask_type == AttnMaskType.no_mask:
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, scale=1.0 / math.sqrt(hn)
                )
            elif sq == sk:
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, is_causal=sq > 1, scale=1.0 / math.sqrt(hn)
                )
            else:
                mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
                context = torch.nn.functional.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=1.0 / math.sqrt(hn)
                )
            context = context.permute(2, 0, 1, 3).contiguous()  # [b, np, sq, hn] -> [sq, b, np, hn]
            return context.view(sq, b, self.hidden_size_per_partition)  # [sq, b, hp]

        if self.config.use_flash_attn:
            return self._fused_attention(query, key, value, attention_mask, attn_mask_type)
        return self._masked_attention(query, key, value, attention_mask, attn_mask_type)

    def _fused_attention(self, query, key, value, attention_mask, attn_mask_type) -> Tensor:
        """--use-flash-attn: one scaled_dot_product_attention call with the mask (causal, or
        the boolean mask, True = masked out) and the attention dropout inside the kernel, drawn
        from the model-parallel RNG like the unfused dropout; the fused kernels keep the softmax
        in fp32 whatever the input precision.

        query [sq, b, np, hn], key / value [sk, b, np, hn] (heads already expanded) -> [sq, b, hp].
        """
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        q = query.permute(1, 2, 0, 3)  # [sq, b, np, hn] -> [b, np, sq, hn]
        k = key.permute(1, 2, 0, 3)  # [sk, b, np, hn] -> [b, np, sk, hn]
        v = value.permute(1, 2, 0, 3)
        mask, causal = None, False
        if attn_mask_type == AttnMaskType.causal:
            if sq == sk:
                causal = sq > 1
            else:
                mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(diagonal=sk - sq)
        elif attention_mask is not None:
            # Additive, as Megatron's mask fill value: a fully masked (padding) row stays finite.
            mask = torch.zeros(attention_mask.shape, dtype=q.dtype, device=q.device)
            mask = mask.masked_fill(attention_mask, -10000.0)  # [b, 1, sq, sk]
        dropout_p = self.attention_dropout_p if self.training else 0.0
        rng = contextlib.nullcontext()
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            rng = tensor_parallel.get_cuda_rng_tracker().fork()
        with rng:
            context = torch.nn.functional.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=dropout_p,
                is_causal=causal,
                scale=1.0 / math.sqrt(hn),
            )  # [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3).contiguous()  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.view(sq, b, self.hidden_size_per_partition)  # [sq, b, hp]

    def _masked_attention(self, query, key, value, attention_mask, attn_mask_type) -> Tensor:
        """The unfused path: scores, masked softmax, dropout, weighted values.

        query [sq, b, np, hn], key / value [sk, b, np, hn] (heads already expanded) ->
        [sq, b, hp].
        """
        sq, b, np_, hn = query.shape
        sk = key.size(0)
        # Raw attention scores [b, np, sq, sk].
        query = query.reshape(sq, b * np_, hn)  # [sq, b, np, hn] -> [sq, b * np, hn]
        key = key.reshape(sk, b * np_, hn)  # [sk, b, np, hn] -> [sk, b * np, hn]
        matmul_result = torch.bmm(
            query.transpose(0, 1), key.transpose(0, 1).transpose(1, 2)
        )  # [b * np, sq, sk]
        matmul_result = matmul_result * (1.0 / self.norm_factor)
        attention_scores = matmul_result.view(b, np_, sq, sk)  # [b, np, sq, sk]

        if attn_mask_type == AttnMaskType.causal:
            # Causal layers ignore the passed mask (see `_can_use_sdpa`); the softmax builds the
            # square one, and queries after a KV cache get theirs here.
            attention_mask = (
                None if sq == sk or sq == 1 else causal_mask_for_queries(sq, sk, query.device)
            )
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)

        if not self.config.sequence_parallel:
            with tensor_parallel.get_cuda_rng_tracker().fork():
                attention_probs = self.attention_dropout(attention_probs)
        else:
            # The block already forked the model-parallel RNG for sequence parallelism.
            attention_probs = self.attention_dropout(attention_probs)

        value = value.reshape(sk, b * np_, hn)  # [sk, b, np, hn] -> [sk, b * np, hn]
        attention_probs = attention_probs.view(
            b * np_, sq, sk
        )  # [b, np, sq, sk] -> [b * np, sq, sk]
        context = torch.bmm(attention_probs, value.transpose(0, 1))  # [b * np, sq, hn]
        context = context.view(b, np_, sq, hn)  # [b * np, sq, hn] -> [b, np, sq, hn]
        context = context.permute(2, 0, 1, 3).contiguous()  # [b, np, sq, hn] -> [sq, b, np, hn]
        return context.view(sq, b, self.hidden_size_per_partition)  # [sq, b, np, hn] -> [sq, b, hp]


def packed_attention_mask(cu_seqlens: Tensor, s: int, b: int, causal: bool) -> Tensor:
    """Block-diagonal mask of packed segments: bool [b, 1, s, s], True = masked out.

    cu_seqlens index the batch-major stream of b samples of length s (see PackedSeqParams).
    """
    segment = packed_segment_ids(cu_seqlens, b * s).view(b, s)
    mask = segment[:, :, None] != segment[:, None, :]  # [b, s, s]
    if causal:
        mask = mask | torch.ones(s, s, dtype=torch.bool, device=mask.device).triu(1)
    return mask.unsqueeze(1)
