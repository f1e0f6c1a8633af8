"""Rotary position embeddings (RoPE).

Shapes: s sequence, b batch, np heads, hn head size, d rotated size (= hn * rotary_percent).
`RotaryEmbedding(s)` returns the angles [s, 1, 1, d]; `apply_rotary_pos_emb(t, freqs)` rotates the
first d channels of t [s, b, np, hn] and passes the rest through.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron.core import group_fallbacks
from megatron.core.transformer.context_parallel.layout import slice_for_cp_rank
from megatron.core.transformer.context_parallel.packed import packed_position_ids_on_cp_rank
from megatron.core.utils import get_current_device


class RotaryEmbedding(torch.nn.Module):
    """Angles of rotary position embeddings.

    The frequencies are a plain attribute (not a buffer), so they are not in the state dict.

    Args:
        kv_channels (int): head size.
        rotary_percent (float): fraction of each head that is rotated.
        rotary_interleaved (bool): rotate interleaved channel pairs instead of the two halves.
        seq_len_interpolation_factor (float, optional): divide positions by this factor.
        rotary_base (int): base of the geometric frequency series.
        use_cpu_initialization (bool): build the frequencies on the CPU.
        cp_group (ProcessGroup, optional): context parallel group; with more than one rank the
            angles of the global sequence are sliced to this rank's dual-chunk positions
            (default: the global context parallel group, if initialized).
        rope_scaling (bool): apply Llama-3.1's frequency scaling (later Megatron's
            `--use-rope-scaling`: low / high frequency factors 1 and 4, original context 8192).
        rope_scaling_factor (float): its factor (`--rope-scaling-factor`).
    """

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: Optional[float] = None,
        rotary_base: int = 10000,
        use_cpu_initialization: bool = False,
        cp_group: Optional[torch.distributed.ProcessGroup] = None,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
    ) -> None:
        super().__init__()
        # Fallback: the global CP group (None before initialize_model_parallel: no slicing).
        self.cp_group = group_fallbacks.get_context_parallel_group_if_none(
            cp_group, check_initialized=False
        )
        if not 0.0 < rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {rotary_percent}")
        dim = kv_channels
        if rotary_percent < 1.0:
            dim = int(dim * rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        device = 'cpu' if use_cpu_initialization else get_current_device()
        self.inv_freq = 1.0 / (
            rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
        )
        if rope_scaling:
            from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
                llama3_inv_freq,
            )

            self.inv_freq = llama3_inv_freq(self.inv_freq, rope_scaling_factor)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> Tensor:
        """Angles for positions offset .. offset + max_seq_len - 1: [max_seq_len, 1, 1, d].

        With context parallelism `max_seq_len` is the global length and the result holds this
        rank's positions only ([max_seq_len / cp, 1, 1, d], chunks r and 2cp-1-r), unless
        `packed_seq` (later Megatron's flag): packed sequences are split per sequence, so the
        caller picks each token's angles from the whole table by its position in its sequence.
        """
        inv_freq = self.inv_freq.to(get_current_device())
        seq = torch.arange(max_seq_len, device=inv_freq.device, dtype=inv_freq.dtype) + offset
        if self.seq_len_interpolation_factor is not None:
            seq *= 1 / self.seq_len_interpolation_factor

        freqs = torch.outer(seq, inv_freq)  # [s, d/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)  # [s, d]
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(
                freqs.shape[0], -1
            )  # [s, d] with each angle repeated for its channel pair
        emb = emb[:, None, None, :]  # [s, 1, 1, d]
        if self.cp_group is not None and self.cp_group.size() > 1 and not packed_seq:
            # Built for the global positions, then sliced: never from local positions.
            emb = slice_for_cp_rank(emb, 0, self.cp_group.size(), self.cp_group.rank())
        return emb

    def get_rotary_seq_len(
        self, inference_params, transformer, transformer_input, transformer_config
    ) -> int:
        """Full sequence length the angles are needed for.

        The decoder input (or the pipeline input tensor) is [s/cp, b, h], or [s/cp/tp, b, h]
        under sequence parallelism, so the length is scaled back by the TP size there and by the
        context parallel size.
        """
        if inference_params is not None:
            return inference_params.max_sequence_length
        # Later pipeline stages see the previous stage's output instead of an embedding.
        block_input = transformer.input_tensor
        if block_input is None:
            block_input = transformer_input
        cfg = transformer_config
        tp_split = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
        return block_input.size(0) * tp_split * cfg.context_parallel_size

    def packed_angles(self, max_seq_len: int, packed_seq_params) -> Tensor:
        """Angles of packed sequences: each local token rotated by its position inside its own
        segment, not inside the row.

        Args:
            max_seq_len: the global sequence length s (all context parallel ranks together).
            packed_seq_params (PackedSeqParams): the segments of the batch-major stream; under
                context parallelism this rank's share of the per-sequence split.

        Returns:
            [s/cp, b, 1, d] angles, one row per local token and sample.
        """
        angles = self(max_seq_len, packed_seq=True)  # [s, 1, 1, d]
        cp = self.cp_group
        cp_size = 1 if cp is None else cp.size()
        cp_rank = 0 if cp is None else cp.rank()
        local = angles.size(0) // cp_size
        offsets = packed_seq_params.segment_offsets()
        b = int(offsets[-1]) // local
        positions = packed_position_ids_on_cp_rank(offsets, b * local, cp_size, cp_rank)
        positions = positions.view(b, local).t()  # [b, s/cp] -> [s/cp, b]
        return angles[:, 0, 0, :][positions].unsqueeze(2)  # [s/cp, b, d] -> [s/cp, b, 1, d]


def _rotate_half(x: Tensor, rotary_interleaved: bool) -> Tensor:
    """(x1, x2) -> (-x2, x1) on the two halves, or on each interleaved pair."""
    if not rotary_interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    x_new = torch.stack((-x2, x1), dim=-1)
    return x_new.view(x_new.shape[0], x_new.shape[1], x_new.shape[2], -1)


def apply_rotary_pos_emb(t: Tensor, freqs: Tensor, config=None, cu_seqlens=None) -> Tensor:
    """Rotate the first d channels of each head.

    Args:
        t: [s, b, np, hn] queries or keys.
        freqs: [s, 1, 1, d] angles from `RotaryEmbedding`.
        config: the TransformerConfig (reads rotary_interleaved).
        cu_seqlens: packed sequences (not supported; must be None).
    """
    if cu_seqlens is not None:
        raise NotImplementedError("packed sequences (cu_seqlens) are not supported by RoPE here")
    rotary_interleaved = bool(config.rotary_interleaved) if config is not None else False
    # Only the first d channels rotate (rotary_percent < 1 leaves the rest as they are).
    d = freqs.shape[-1]
    rotating, passing = t[..., :d], t[..., d:]
    cos = torch.cos(freqs).to(rotating.dtype)
    sin = torch.sin(freqs).to(rotating.dtype)
    rotated = (rotating * cos) + (_rotate_half(rotating, rotary_interleaved) * sin)
    return torch.cat((rotated, passing), dim=-1)
