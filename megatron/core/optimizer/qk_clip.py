"""QK-clip (MuonClip; later Megatron's `qk_clip.py`): after each optimizer step, shrink the query
and key weights of the heads whose largest attention logit of the step exceeded a threshold.

During training every attention layer records S_h, the largest scaled logit q·k·scale of each of
its heads over the step's micro-batches (`record_max_logits`; here computed from q and k, as our
attention does not return it). After the step, `clip_qk(model)` takes the MAX of S over the
data-parallel ranks, and for S > tau rescales with eta = min(tau / S, 1):

- MHA / GQA (`linear_qkv`): eta per query group (the max over its heads); the group's query rows
  x eta^alpha, its key rows x eta^(1 - alpha); values and biases untouched.
- MLA: per head, the q_nope rows of `linear_q_up_proj` (or `linear_q_proj`) x eta^alpha, the q_pe
  rows x eta, the k_nope rows of `linear_kv_up_proj` x eta^(1 - alpha); the shared rotary key and
  the values untouched.

A head's logits are bilinear in its q and k rows, so its largest logit becomes exactly tau
(MHA; MLA's q_pe·k_pe part is scaled by eta too). Then the maxima are reset. The weights are
rescaled in place, so this needs the optimizer to step the model's own parameters (fp32 without
the distributed optimizer).
"""

from typing import List

import torch

from megatron.core.transformer.attention_logits import is_causal, record_max_logits  # noqa: F401


def _scale_rows(weight: torch.Tensor, rows: torch.Tensor) -> None:
    """weight [R, c] *= rows [R] (one factor per row)."""
    weight.mul_(rows.to(weight.dtype).unsqueeze(-1))


def _clip_mha(attn, eta: torch.Tensor, alpha: float) -> None:
    ng = attn.num_query_groups_per_partition
    per_group = attn.num_attention_heads_per_partition // ng
    hn = attn.hidden_size_per_attention_head
    eta_group = eta.view(ng, per_group).amin(dim=1)  # the group's largest logit decides
    q_rows = eta_group.pow(alpha).repeat_interleave(per_group * hn).view(ng, per_group * hn)
    k_rows = eta_group.pow(1 - alpha).repeat_interleave(hn).view(ng, hn)
    v_rows = torch.ones(ng, hn, device=eta.device)
    rows = torch.cat([q_rows, k_rows, v_rows], dim=1).reshape(-1)  # grouped [ng, np/ng + 2, hn]
    _scale_rows(attn.linear_qkv.weight, rows)


def _clip_mla(attn, eta: torch.Tensor, alpha: float) -> None:
    c = attn.config
    dn, dr, dv = c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim
    q_rows = torch.cat(
        [eta.pow(alpha).unsqueeze(1).expand(-1, dn), eta.unsqueeze(1).expand(-1, dr)], dim=1
    ).reshape(-1)  # [np * (dn + dr)]
    q_proj = attn.linear_q_proj if c.q_lora_rank is None else attn.linear_q_up_proj
    _scale_rows(q_proj.weight, q_rows)
    kv_rows = torch.cat(
        [eta.pow(1 - alpha).unsqueeze(1).expand(-1, dn), torch.ones(eta.numel(), dv)], dim=1
    ).reshape(-1)  # [np * (dn + dv)]
    _scale_rows(attn.linear_kv_up_proj.weight, kv_rows)


def attention_modules(model_chunks) -> List[torch.nn.Module]:
    """The attention modules that record max logits."""
    # Imported here: the attention modules are a layer above the optimizer package.
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    found = []
    for chunk in model_chunks:
        for module in chunk.modules():
            if isinstance(module, (SelfAttention, MLASelfAttention)):
                found.append(module)
    return found


@torch.no_grad()
def clip_qk(model_chunks, threshold: float, alpha: float, dp_group=None) -> int:
    """Rescale the q/k weights of the heads whose max logit exceeded `threshold`; reset the
    maxima. Returns how many heads were clipped on this rank (for logs and tests).

    Every data-parallel rank must call it (one MAX all-reduce per layer that recorded).
    """
    clipped = 0
    for attn in attention_modules(model_chunks):
        maxima = getattr(attn, 'max_attention_logit', None)
        if maxima is None:
            continue
        if dp_group is not None and dp_group.size() > 1:
            torch.distributed.all_reduce(maxima, op=torch.distributed.ReduceOp.MAX, group=dp_group)
        eta = torch.clamp(threshold / maxima.clamp(min=1e-30), max=1.0)
        if bool((eta < 1.0).any()):
            clipped += int((eta < 1.0).sum())
            if hasattr(attn, 'linear_qkv'):
                _clip_mha(attn, eta, alpha)
            else:
                _clip_mla(attn, eta, alpha)
        attn.max_attention_logit = None
    return clipped
