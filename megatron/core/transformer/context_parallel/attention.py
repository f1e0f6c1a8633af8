"""Context-parallel core attention: the one entry point the attention layer calls.

`context_parallel_attention(query, key, value, ...)` takes this rank's query [s/P, b, hq, hn] and
key/value [s/P, b, hkv, hn] in the dual-chunk layout (`layout.py`), runs exact softmax attention
over the whole sequence of the CP group, and returns [s/P, b, hq * hn]. The communication
(`comm_type`, later Megatron's `--cp-comm-type`):

- 'p2p': ring attention (`ring_attention.py`), keys/values passed around the ring, transfer
  overlapped with compute; per-rank traffic about constant in P.
- 'all_gather': keys/values all-gathered once (`all_gather_attention.py`); simplest, P-1 more
  key/value blocks of memory per layer.
- 'a2a': Ulysses (`all_to_all.py`): sequence-to-heads all-to-all of q, k, v, ordinary attention
  on hq/P heads of the full sequence, heads-to-sequence all-to-all of the output. Needs hq and hkv
  (per TP rank) divisible by P.
- 'a2a+p2p': all-to-all inside the level-0 groups of `--hierarchical-context-parallel-sizes`,
  ring across the level-1 groups.

Only masks that follow the sequence layout are exact here: causal and no mask, and packed
sequences (`packed_seq_params`, the per-sequence split of `packed.py`): each sequence attends
only to itself, causally, with every comm type; padding rows inside a sequence get a zero output.
The micro-batch's samples are then one batch-major stream (b folded into the sequence).

Attention dropout uses one seed per call (drawn by the caller under the model-parallel RNG) and
per-block keep-masks; it is statistically the same as CP=1 dropout, not bitwise.
"""

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from megatron.core.packed_seq_params import PackedSeqParams, packed_real_rows

from .all_gather_attention import all_gather_attention
from .all_to_all import HeadsToSeq, SeqToHeads, gathered_segments
from .packed import packed_segments
from .ring_attention import ring_attention

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass
class ContextParallelGroups:
    """The process groups of context parallelism.

    Attributes:
        cp: the context parallel group (ring and all-gather run over it; a2a over it when there
            is no hierarchy).
        a2a: level-0 group of hierarchical CP (all-to-all), for 'a2a+p2p'.
        p2p: level-1 group of hierarchical CP (ring), for 'a2a+p2p'.
    """

    cp: torch.distributed.ProcessGroup
    a2a: Optional[torch.distributed.ProcessGroup] = None
    p2p: Optional[torch.distributed.ProcessGroup] = None


def cp_comm_type_of_layer(config, layer_number: int) -> str:
    """The CP communication type of 1-based `layer_number` (config.cp_comm_type: None = 'p2p',
    one string, or one string per layer)."""
    comm_type = config.cp_comm_type
    if comm_type is None:
        return "p2p"
    if isinstance(comm_type, str):
        return comm_type
    return comm_type[layer_number - 1]


def context_parallel_groups(config, pg_collection) -> ContextParallelGroups:
    """The CP groups of a layer from its resolved process groups (`cp`, and `hcp` when a layer
    uses 'a2a+p2p'); checks their sizes against the config."""
    cp = pg_collection.cp
    if cp.size() != config.context_parallel_size:
        raise ValueError(
            f"context_parallel_size ({config.context_parallel_size}) does not match the size of "
            f"the context parallel group ({cp.size()})"
        )
    hierarchy = getattr(pg_collection, "hcp", None)
    if hierarchy is None:
        return ContextParallelGroups(cp=cp)
    a2a, p2p = hierarchy
    sizes = config.hierarchical_context_parallel_sizes
    if sizes is not None and [a2a.size(), p2p.size()] != list(sizes):
        raise ValueError(
            f"hierarchical_context_parallel_sizes ({list(sizes)}) do not match the hierarchical "
            f"groups ([{a2a.size()}, {p2p.size()}])"
        )
    return ContextParallelGroups(cp=cp, a2a=a2a, p2p=p2p)


def check_cp_attention_shapes(
    comm_type: str,
    cp_size: int,
    heads_per_tp_rank: int,
    query_groups_per_tp_rank: int,
    a2a_size: Optional[int] = None,
) -> None:
    """Raise ValueError if `comm_type` cannot split these heads (one line, with the numbers).

    Args:
        comm_type: one of CP_COMM_TYPES.
        cp_size: context parallel size.
        heads_per_tp_rank: attention heads per tensor-parallel rank.
        query_groups_per_tp_rank: key/value heads per tensor-parallel rank.
        a2a_size: size of the all-to-all level for 'a2a+p2p' (cp_size for 'a2a').
    """
    if comm_type not in CP_COMM_TYPES:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
    if comm_type not in ("a2a", "a2a+p2p"):
        return
    size = cp_size if comm_type == "a2a" or a2a_size is None else a2a_size
    if heads_per_tp_rank % size or query_groups_per_tp_rank % size:
        raise ValueError(
            f"--cp-comm-type {comm_type} splits heads over {size} ranks, but the attention heads "
            f"({heads_per_tp_rank}) and query groups ({query_groups_per_tp_rank}) per "
            f"tensor-parallel rank are not both divisible by {size}; use --cp-comm-type p2p"
        )


def _a2a_then(q, k, v, a2a_group, inner, segments=None, **kwargs) -> Tensor:
    """All-to-all q, k, v to head groups, run `inner` on them, all-to-all the output back."""
    q, k, v = (SeqToHeads.apply(t, a2a_group, segments) for t in (q, k, v))
    rank = torch.distributed.get_rank(group=a2a_group)
    size = torch.distributed.get_world_size(group=a2a_group)
    # Different head groups must not share dropout masks.
    kwargs["dropout_seed"] = (kwargs["dropout_seed"] + 104729 * rank) % (2**63)
    inner_segments = None if segments is None else gathered_segments(segments, size)
    out = inner(q, k, v, segments=inner_segments, **kwargs)
    return HeadsToSeq.apply(out, a2a_group, segments)


def context_parallel_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    groups: ContextParallelGroups,
    comm_type: str,
    causal: bool,
    scale: float,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    packed_seq_params: Optional[PackedSeqParams] = None,
) -> Tensor:
    """Exact attention over the CP group's sequence (see the module docstring).

    Args:
        query: [s/P, b, hq, hn] this rank's queries (dual-chunk layout, or the per-sequence
            layout of packed sequences).
        key, value: [s/P, b, hkv, hn] (hq a multiple of hkv).
        groups: the CP groups.
        comm_type: 'p2p', 'all_gather', 'a2a' or 'a2a+p2p'.
        causal: causal mask (True) or no mask (False).
        scale: softmax scale, usually 1 / sqrt(hn).
        dropout_p: attention dropout probability (0 when not training).
        dropout_seed: seed of this call's dropout masks (same on all CP ranks).
        packed_seq_params: this rank's packed sequences (from
            `packed.get_thd_batch_on_this_cp_rank`) over the batch-major b * s/P stream, or None.

    Returns:
        [s/P, b, hq * hn] in query's dtype.
    """
    sq, b, hq, hn = query.shape
    if sq % 2:
        raise ValueError(f"context parallel attention needs an even local length, got {sq}")
    segments = None
    if packed_seq_params is None:
        # [s, b, h, hn] -> [b, h, s, hn]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
    else:
        segments = packed_segments(packed_seq_params, b * sq)
        # [s, b, h, hn] -> [b, s, h, hn] -> [1, h, b s, hn]: the batch-major stream
        q, k, v = (
            t.transpose(0, 1).reshape(1, b * sq, t.size(2), hn).transpose(1, 2)
            for t in (query, key, value)
        )
    kwargs = dict(
        causal=causal,
        scale=scale,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        segments=segments,
    )
    if comm_type == "p2p":
        out = ring_attention(q, k, v, groups.cp, **kwargs)
    elif comm_type == "all_gather":
        out = all_gather_attention(q, k, v, groups.cp, **kwargs)
    elif comm_type == "a2a":
        out = _a2a_then(q, k, v, groups.cp, ring_attention, group=None, **kwargs)
    elif comm_type == "a2a+p2p":
        if groups.a2a is None or groups.p2p is None:
            raise ValueError(
                "--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes (the a2a and "
                "p2p groups)"
            )
        out = _a2a_then(q, k, v, groups.a2a, ring_attention, group=groups.p2p, **kwargs)
    else:
        raise ValueError(f"--cp-comm-type {comm_type!r} is not one of {', '.join(CP_COMM_TYPES)}")
    if packed_seq_params is None:
        # [b, hq, s, hn] -> [s, b, hq, hn] -> [s, b, hq * hn]
        return out.permute(2, 0, 1, 3).reshape(sq, b, hq * hn)
    # [1, hq, b s, hn] -> [b s, hq, hn] -> [b, s, hq hn] -> [s, b, hq hn]
    out = out[0].transpose(0, 1).reshape(b, sq, hq * hn)
    real = packed_real_rows(packed_seq_params, b * sq)
    if real is not None:
        # Padding inside a sequence gets no output (Transformer Engine's THD semantics).
        out = out * real.view(b, sq, 1).to(out.dtype)
    return out.transpose(0, 1).contiguous()
