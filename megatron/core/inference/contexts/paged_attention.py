"""Attention of packed requests over a paged KV cache, in plain PyTorch.

The step's T tokens belong to R requests; request r owns the packed rows [q_start, q_end) (its
new tokens) and its keys live in its own blocks of the pool: position j of the request is slot
j % B of block block_ids[j // B]. Each request attends over exactly its own kv_len keys with a
bottom-right aligned causal mask (new token i of a request with q_len new tokens sees keys
0 .. kv_len - q_len + i), which covers decode (q_len 1), whole prompts and prompt chunks alike.

Every request's attention is computed on its own: no reduction runs across requests, so a
request's output does not depend on which other requests share the step (batch invariance up to
the GEMMs of the surrounding layers).
"""

import math
from typing import List, Tuple

import torch
import torch.nn.functional as F


def write_to_paged_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter the step's keys / values into their slots.

    Args:
        key, value: [T, 1, ng, hn] (keys already rotated by RoPE).
        key_pool, value_pool: [num_blocks, B, ng, hn].
        slot_mapping: [T] int64, block_id * B + offset of each token.
    """
    ng, hn = key_pool.shape[-2:]
    key_pool.view(-1, ng, hn).index_copy_(0, slot_mapping, key.reshape(-1, ng, hn))
    value_pool.view(-1, ng, hn).index_copy_(0, slot_mapping, value.reshape(-1, ng, hn))


def kv_slots(block_ids: torch.Tensor, kv_len: int, block_size: int) -> torch.Tensor:
    """[kv_len] int64: the flat slot (block * B + offset) of each of a request's positions."""
    offsets = torch.arange(block_size, device=block_ids.device)
    return (block_ids[:, None] * block_size + offsets[None, :]).reshape(-1)[:kv_len]


def paged_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    requests: List[Tuple[int, int, int, torch.Tensor]],
    softmax_scale: float = None,
    all_slots: torch.Tensor = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its cached keys.

    Args:
        query: [T, 1, np, hn] (rotated).
        key_pool, value_pool: [num_blocks, B, ng, hn] and [num_blocks, B, ng, hv] (hv = hn
            except for multi-latent attention), this step's keys already written.
        requests: per request (q_start, q_end, kv_len, slots [kv_len] int64 from `kv_slots`).
        softmax_scale: default 1 / sqrt(hn).
        all_slots: the requests' slots concatenated (default: concatenated here; a step passes
            it once for all its layers).

    Returns:
        context [T, 1, np * hv].
    """
    num_tokens, _, np_, hn = query.shape
    ng, hv = key_pool.size(-2), value_pool.size(-1)
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(hn)
    # Every request's keys / values in one gather each (a copy, so exact); request r's are the
    # rows [offset_r, offset_r + kv_len_r).
    slots = all_slots if all_slots is not None else torch.cat([r[3] for r in requests])
    # Head-major views of the whole step, sliced per request below: a request's slice has the
    # shape and strides its own transposed copy would have, without a transpose per request.
    queries = query[:, 0].transpose(0, 1).unsqueeze(0)  # [1, np, T, hn]
    keys = key_pool.view(-1, ng, hn).index_select(0, slots)  # [sum of kv_len, ng, hn]
    values = value_pool.view(-1, ng, hv).index_select(0, slots)
    keys = keys.transpose(0, 1).unsqueeze(0)  # [1, ng, sum of kv_len, hn]
    values = values.transpose(0, 1).unsqueeze(0)
    out = query.new_empty(num_tokens, np_, hv)
    out_heads = out.transpose(0, 1)  # [np, T, hv], a view: the slices below write into `out`
    offset = 0
    for q_start, q_end, kv_len, _ in requests:
        q_len = q_end - q_start
        mask = None
        if 1 < q_len < kv_len:
            mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(
                diagonal=kv_len - q_len
            )
        ctx = F.scaled_dot_product_attention(
            queries[:, :, q_start:q_end],  # [1, np, q, hn]
            keys[:, :, offset : offset + kv_len],  # [1, ng, kv, hn]
            values[:, :, offset : offset + kv_len],
            attn_mask=mask,
            is_causal=1 < q_len == kv_len,
            scale=scale,
            enable_gqa=np_ != ng,  # each key head serves np / ng query heads
        )
        offset += kv_len
        out_heads[:, q_start:q_end] = ctx[0]  # [np, q, hv]
    return out.view(num_tokens, 1, np_ * hv)
