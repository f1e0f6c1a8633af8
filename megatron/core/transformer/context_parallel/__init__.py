"""Context parallelism: the sequence split over the ranks of the CP group, exact attention across.

- `layout`: the dual-chunk (load-balanced) sequence layout and batch slicing.
- `packed`: packed sequences (THD): the per-sequence dual-chunk split, per-rank PackedSeqParams.
- `block_attention`: one attention block returning its log-sum-exp, and the LSE merge.
- `ring_attention` ('p2p'), `all_gather_attention` ('all_gather'), `all_to_all` ('a2a',
  'a2a+p2p'): the communication schemes.
- `attention`: `context_parallel_attention`, the entry point the attention layer calls.

See docs/context_parallel.md for the algorithms and their equations.
"""

from .attention import (
    CP_COMM_TYPES,
    ContextParallelGroups,
    check_cp_attention_shapes,
    context_parallel_attention,
    context_parallel_groups,
    cp_comm_type_of_layer,
)
from .layout import (
    cp_global_positions,
    gather_from_cp_layout,
    get_batch_on_this_cp_rank,
    slice_for_cp_rank,
)
from .packed import (
    get_thd_batch_on_this_cp_rank,
    packed_position_ids_on_cp_rank,
    sample_boundaries,
    thd_partitioned_indices,
)

__all__ = [
    "CP_COMM_TYPES",
    "ContextParallelGroups",
    "check_cp_attention_shapes",
    "context_parallel_attention",
    "context_parallel_groups",
    "cp_comm_type_of_layer",
    "cp_global_positions",
    "gather_from_cp_layout",
    "get_batch_on_this_cp_rank",
    "get_thd_batch_on_this_cp_rank",
    "packed_position_ids_on_cp_rank",
    "sample_boundaries",
    "thd_partitioned_indices",
    "slice_for_cp_rank",
]
