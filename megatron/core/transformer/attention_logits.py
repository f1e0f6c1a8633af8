"""Per-head maximum attention logits, recorded during the forward pass for QK-clip.

The attention modules call `record_max_logits` when `config.qk_clip` is on;
`megatron.core.optimizer.qk_clip` reads `module.max_attention_logit` after the step.
"""

import torch

from megatron.core.transformer.enums import AttnMaskType


def record_max_logits(module, query, key, scale: float, causal: bool) -> None:
    """Fold this call's per-head max of scale·q·k ([np]) into `module.max_attention_logit`.

    query [sq, b, np, d], key [sk, b, np or ng, d] (groups expanded to heads here).
    """
    with torch.no_grad():
        heads = query.size(2)
        if key.size(2) != heads:
            key = key.repeat_interleave(heads // key.size(2), dim=2)
        q = query.permute(1, 2, 0, 3).float()  # [b, np, sq, d]
        k = key.permute(1, 2, 0, 3).float()  # [b, np, sk, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [b, np, sq, sk]
        if causal:
            sq, sk = scores.shape[-2:]
            keep = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
            scores = scores.masked_fill(~keep, float('-inf'))
        current = scores.amax(dim=(0, 2, 3))  # [np]
        previous = getattr(module, 'max_attention_logit', None)
        module.max_attention_logit = (
            current if previous is None else torch.maximum(previous, current)
        )


def is_causal(module) -> bool:
    return getattr(module, 'attn_mask_type', None) == AttnMaskType.causal
