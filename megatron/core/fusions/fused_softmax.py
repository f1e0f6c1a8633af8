"""Scale + mask + softmax over attention scores (plain-torch version of Megatron's fused kernel)."""

from typing import Optional

import torch

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.utils import get_default_causal_mask


class FusedScaleMaskSoftmax(torch.nn.Module):
    """softmax(mask(scale * scores)) over the last dimension.

    Args:
        input_in_fp16: scores arrive in fp16.
        input_in_bf16: scores arrive in bf16.
        attn_mask_type: causal builds a causal mask when none is given (square scores only, as
            in Megatron: sq != sk asserts; pass `causal_mask_for_queries(sq, sk)` instead).
        scaled_masked_softmax_fusion: accepted for API parity; the plain-torch path is always used.
        mask_func: fills masked positions (True in the mask) of the scores.
        softmax_in_fp32: compute the softmax in fp32 and cast back.
        scale: multiplier applied to the scores before masking (None = 1; needs fp32 softmax
            when the input is 16-bit).
    """

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func,
        softmax_in_fp32: bool,
        scale: Optional[float],
    ):
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        if self.input_in_fp16 and self.input_in_bf16:
            raise ValueError("FusedScaleMaskSoftmax: input_in_fp16 and input_in_bf16 are both True")
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        # The fused CUDA kernel's switch is kept for the API: the softmax here is torch's.
        self.attn_mask_type, self.scaled_masked_softmax_fusion = (
            attn_mask_type,
            scaled_masked_softmax_fusion,
        )
        self.mask_func, self.softmax_in_fp32, self.scale = mask_func, softmax_in_fp32, scale
        if not (self.scale is None or softmax_in_fp32 or not self.input_in_float16):
            raise ValueError(
                "FusedScaleMaskSoftmax: a scale with 16-bit input needs softmax_in_fp32=True"
            )

    def forward(self, input: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """input: [b, np, sq, sk] scores; mask: bool broadcastable to it (True = masked) or None."""
        assert input.dim() == 4
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input, mask):
        upcast = self.input_in_float16 and self.softmax_in_fp32
        if upcast:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.shape[2:4]  # [b, np, sq, sk]
        if self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            # sq == 1 is one query (a decode step against a KV cache): it sees every key. Other
            # shapes need the caller's mask (see causal_mask_for_queries), as in Megatron.
            assert sq == sk, "causal mask is only for self attention"
            mask = get_default_causal_mask(sq, sk)

        scores = input if mask is None else self.mask_func(input, mask)
        probs = torch.nn.Softmax(dim=-1)(scores)
        if upcast:  # back to the input's half precision
            probs = probs.half() if self.input_in_fp16 else probs.bfloat16()
        return probs


def causal_mask_for_queries(sq: int, sk: int, device) -> torch.Tensor:
    """bool [sq, sk], True = masked: the queries are the last sq positions of sk keys (a prefill
    chunk after a KV cache). For sq == sk it is the usual upper triangle."""
    return torch.triu(torch.ones(sq, sk, dtype=torch.bool, device=device), diagonal=sk - sq + 1)
