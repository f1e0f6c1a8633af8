"""Attention of one (query block, key/value block) pair that also returns its log-sum-exp.

Context-parallel attention splits the score matrix into blocks, runs each block on its own and
merges the partial outputs by their log-sum-exp (see `merge_block_output`). Every block's
backward then uses the *merged* output and log-sum-exp of its query rows, which makes the sum of
the blocks' gradients the exact gradient:

    P = exp(scale * Q K^T - lse)      D = rowsum(dO * O)      dS = P * (dO V^T - D)
    dV = P^T dO      dQ = scale * dS K      dK = scale * dS^T Q

Shapes: q [b, hq, sq, d]; k, v [b, hkv, sk, d] with hq a multiple of hkv (grouped-query
attention: query head i uses key/value head i // (hq / hkv)); lse [b, hq, sq] in fp32. A causal
block is square with the standard (top-left) mask; the other blocks are unmasked.

Kernels, by device and dtype:
- CPU: `aten._scaled_dot_product_flash_attention_for_cpu` and its backward (fused, returns the
  log-sum-exp, handles grouped-query heads), any float dtype.
- CUDA, fp16/bf16: `aten._scaled_dot_product_flash_attention` and its backward (the kernels
  torch's own context-parallel code uses), key/value heads expanded for grouped queries.
- Everything else (CUDA fp32) and any block with attention dropout: explicit fp32 matmul-softmax
  (memory O(sq * sk) per head).

Attention dropout draws its keep-mask from a generator seeded per block (`BlockDropout`), so the
backward replays the mask of the forward without storing it.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
from torch import Tensor

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(
    torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None
)


@dataclass(frozen=True)
class BlockDropout:
    """Attention dropout of one block: drop probability and the seed of its keep-mask."""

    p: float
    seed: int

    def keep_mask(self, shape, device, dtype=torch.float32) -> Tensor:
        """The scaled keep-mask (0 or 1 / (1 - p)) of this block, identical on every call."""
        gen = torch.Generator(device=device)
        gen.manual_seed(self.seed)
        keep = torch.rand(shape, generator=gen, device=device) >= self.p
        return keep.to(dtype) / (1.0 - self.p)


def _fused_kind(q: Tensor, dropout: Optional[BlockDropout]) -> Optional[str]:
    if dropout is not None:
        return None
    if q.device.type == "cpu" and _CPU_FLASH is not None:
        return "cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16):
        return "cuda_flash"
    return None


def _expand_kv(t: Tensor, groups: int) -> Tensor:
    # [b, hkv, s, d] -> [b, hkv * groups, s, d]
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _sum_kv_groups(t: Tensor, groups: int) -> Tensor:
    # [b, hkv * groups, s, d] -> [b, hkv, s, d]
    if groups == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // groups, groups, s, d).sum(dim=2)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit inputs, else the input's dtype (fp64 stays fp64)."""
    return torch.promote_types(dtype, torch.float32)


def _causal_mask(sq: int, sk: int, device) -> Tensor:
    """True above the diagonal (masked out), top-left aligned."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(diagonal=1)


def _explicit_scores(q, k, causal, scale, groups):
    acc = accumulation_dtype(q.dtype)
    k = _expand_kv(k, groups).to(acc)
    scores = torch.matmul(q.to(acc), k.transpose(-1, -2)) * scale  # [b, hq, sq, sk]
    if causal:
        scores.masked_fill_(_causal_mask(q.size(2), k.size(2), q.device), float("-inf"))
    return scores


def block_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool,
    scale: float,
    dropout: Optional[BlockDropout] = None,
) -> Tuple[Tensor, Tensor]:
    """Softmax attention of one block -> (out [b, hq, sq, d] in q's dtype, lse [b, hq, sq] in
    fp32, fp64 for fp64 inputs)."""
    groups = q.size(1) // k.size(1)
    kind = _fused_kind(q, dropout)
    if kind == "cpu":
        out, lse = _CPU_FLASH(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse.to(accumulation_dtype(q.dtype))
    if kind == "cuda_flash":
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
            q, _expand_kv(k, groups), _expand_kv(v, groups), 0.0, causal, False, scale=scale
        )
        return out, lse.float()
    scores = _explicit_scores(q, k, causal, scale, groups)
    lse = torch.logsumexp(scores, dim=-1)  # [b, hq, sq]
    probs = torch.exp(scores - lse.unsqueeze(-1))
    if dropout is not None:
        probs = probs * dropout.keep_mask(probs.shape, q.device, probs.dtype)
    out = torch.matmul(probs, _expand_kv(v, groups).to(probs.dtype))
    return out.to(q.dtype), lse


def block_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    causal: bool,
    scale: float,
    dropout: Optional[BlockDropout] = None,
) -> Tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block, given the merged output `out` and log-sum-exp `lse` of its rows.

    Returns (dq, dk, dv) in fp32 (fp64 for fp64 inputs): this block's contributions, to be
    summed over blocks.
    """
    groups = q.size(1) // k.size(1)
    kind = _fused_kind(q, dropout)
    acc = accumulation_dtype(q.dtype)
    dout = dout.to(q.dtype).contiguous()
    out = out.to(q.dtype).contiguous()
    if kind == "cpu":
        lse = lse.to(acc).contiguous()
        dq, dk, dv = _CPU_FLASH_BWD(
            dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale
        )
        return dq.to(acc), dk.to(acc), dv.to(acc)
    if kind == "cuda_flash":
        empty = torch.empty(0, device=q.device)
        zero = torch.zeros((), dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout,
            q,
            _expand_kv(k, groups),
            _expand_kv(v, groups),
            out,
            lse.float().contiguous(),
            empty,
            empty,
            q.size(2),
            k.size(2),
            0.0,
            causal,
            zero,
            zero,
            scale=scale,
        )
        return dq.float(), _sum_kv_groups(dk.float(), groups), _sum_kv_groups(dv.float(), groups)
    scores = _explicit_scores(q, k, causal, scale, groups)
    probs = torch.exp(scores - lse.to(acc).unsqueeze(-1))  # globally normalised rows
    dout = dout.to(acc)
    v_full = _expand_kv(v, groups).to(acc)
    dprobs = torch.matmul(dout, v_full.transpose(-1, -2))  # [b, hq, sq, sk]
    if dropout is not None:
        keep = dropout.keep_mask(probs.shape, q.device, acc)
        dv = torch.matmul((probs * keep).transpose(-1, -2), dout)
        dprobs = dprobs * keep
    else:
        dv = torch.matmul(probs.transpose(-1, -2), dout)
    # rowsum(dO * O) equals rowsum(P * dP) of the global softmax, dropout or not.
    delta = (dout * out.to(acc)).sum(dim=-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.matmul(dscores, _expand_kv(k, groups).to(acc))
    dk = torch.matmul(dscores.transpose(-1, -2), q.to(acc))
    return dq, _sum_kv_groups(dk, groups), _sum_kv_groups(dv, groups)


def merge_block_output(
    out: Tensor, lse: Tensor, block_out: Tensor, block_lse: Tensor, rows: slice
) -> None:
    """Fold one block's result into the running output and log-sum-exp (both in the
    accumulation dtype), in place.

    For the rows `rows` of `out` [b, h, s, d] and `lse` [b, h, s]:

        lse' = log(exp(lse) + exp(lse_i))
        out' = out * exp(lse - lse') + out_i * exp(lse_i - lse')

    which is the softmax over the union of the two key sets.
    """
    old_out, old_lse = out[:, :, rows], lse[:, :, rows]
    new_lse = torch.logaddexp(old_lse, block_lse)
    out[:, :, rows] = old_out * torch.exp(old_lse - new_lse).unsqueeze(-1) + block_out.to(
        out.dtype
    ) * (torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse[:, :, rows] = new_lse
