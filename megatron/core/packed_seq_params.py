"""Parameters describing packed (variable-length, concatenated) sequences for attention.

Accepted by GPTModel.forward for API compatibility; the local attention implementation here does
not support packed sequences and raises if they are given.
"""

from dataclasses import dataclass

from torch import Tensor


@dataclass
class PackedSeqParams:
    """Cumulative sequence lengths and maxima of a packed batch ('thd' layout)."""

    qkv_format: str = None
    """Layout of q/k/v: 'thd' (packed tokens) or 'sbhd'."""

    cu_seqlens_q: Tensor = None
    """Cumulative query sequence lengths, int32 [num_seqs + 1]."""

    cu_seqlens_kv: Tensor = None
    """Cumulative key/value sequence lengths, int32 [num_seqs + 1]."""

    max_seqlen_q: Tensor = None
    """Longest query sequence."""

    max_seqlen_kv: Tensor = None
    """Longest key/value sequence."""
