"""Model and data parallel groups: the process-group bootstrap of megatron.core.

`initialize_model_parallel()` splits the world into tensor (tp), context (cp), expert (ep), data
(dp) and pipeline (pp) parallel groups with Megatron's rank layout and stores them in module
globals; the `get_*` accessors read them. Core modules should take groups as arguments and fall
back to these globals only through the `get_*_group_if_none(group)` helpers of
`megatron.core.group_fallbacks`.

Rank layout: a rank's coordinates follow `order` (default "tp-cp-ep-dp-pp", first = fastest
varying), so `rank = tp_rank + tp * (cp_rank + cp * (dp_rank + dp * pp_rank))`. Expert parallelism
splits the data parallel dimension: with it, the order reads tp-cp-ep-(dp/ep)-pp.

Example (16 ranks, tp=2, pp=4, so dp=2):

    8 tensor parallel groups:   [0, 1] [2, 3] [4, 5] [6, 7] [8, 9] [10, 11] [12, 13] [14, 15]
    8 data parallel groups:     [0, 2] [1, 3] [4, 6] [5, 7] [8, 10] [9, 11] [12, 14] [13, 15]
    4 pipeline parallel groups: [0, 4, 8, 12] [1, 5, 9, 13] [2, 6, 10, 14] [3, 7, 11, 15]
    4 embedding groups:         [0, 12] [1, 13] [2, 14] [3, 15]

`generate_model_parallel_groups()` computes every group's rank lists without any process, which
is what `initialize_model_parallel()` uses and what the layout tests check.
"""

import warnings
from datetime import timedelta
from typing import Callable, List, Optional

import torch

from megatron.core.global_memory_buffer import GlobalMemoryBuffer
from megatron.core.parallel_layout import (  # noqa: F401 (re-exported, as in Megatron)
    ModelParallelInitError,
    ParallelLayoutError,
    RankGenerator,
    default_embedding_ranks,
    default_position_embedding_ranks,
    generate_masked_orthogonal_rank_groups,
    generate_model_parallel_groups,
)

# Intra-layer (tensor) model parallel group that the current rank belongs to.
_TENSOR_MODEL_PARALLEL_GROUP = None
# Inter-layer (pipeline) model parallel group that the current rank belongs to.
_PIPELINE_MODEL_PARALLEL_GROUP = None
# Model parallel group (tensor + pipeline) that the current rank belongs to.
_MODEL_PARALLEL_GROUP = None
# Model parallel group (tensor + expert + pipeline) that the current rank belongs to.
_MODEL_PARALLEL_GROUP_WITH_EP = None
# Embedding group (first and last pipeline stage, plus the split rank).
_EMBEDDING_GROUP = None
# Position embedding group (first pipeline stage, plus the split rank).
_POSITION_EMBEDDING_GROUP = None
# Data parallel group (and its gloo copy) that the current rank belongs to.
_DATA_PARALLEL_GROUP = None
_DATA_PARALLEL_GROUP_GLOO = None
# Tensor + data parallel group (used by the distributed optimizer with fp8 and MoE).
_TENSOR_AND_DATA_PARALLEL_GROUP = None
# Expert parallel groups.
_EXPERT_MODEL_PARALLEL_GROUP = None
_TENSOR_AND_EXPERT_PARALLEL_GROUP = None
_DATA_MODULO_EXPERT_PARALLEL_GROUP = None
_DATA_MODULO_EXPERT_PARALLEL_GROUP_GLOO = None
_DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP = None
_DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP_GLOO = None

_VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = None
_VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_PIPELINE_MODEL_PARALLEL_SPLIT_RANK = None

# Overrides of the sizes and ranks (used when a process pretends to be another rank, e.g. when
# converting checkpoints).
_MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = None
_MPU_TENSOR_MODEL_PARALLEL_RANK = None
_MPU_PIPELINE_MODEL_PARALLEL_RANK = None
_MPU_EXPERT_MODEL_PARALLEL_RANK = None

# Global ranks of the embedding groups and of the current rank's pipeline group.
_EMBEDDING_GLOBAL_RANKS = None
_POSITION_EMBEDDING_GLOBAL_RANKS = None
_PIPELINE_GLOBAL_RANKS = None

# Global ranks of the current rank's data parallel group (without / with context parallel).
_DATA_PARALLEL_GLOBAL_RANKS = None
_DATA_PARALLEL_GLOBAL_RANKS_WITH_CP = None

# Context parallel group and its global ranks.
_CONTEXT_PARALLEL_GROUP = None
_CONTEXT_PARALLEL_GLOBAL_RANKS = None
# Hierarchical context parallel groups of the caller (one per level, level 0 first).
_HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = None

# Data parallel group including context parallel ranks (and its gloo copy).
_DATA_PARALLEL_GROUP_WITH_CP = None
_DATA_PARALLEL_GROUP_WITH_CP_GLOO = None
# Partial data parallel (HSDP): the data x context parallel ranks split into instances of
# contiguous ranks (intra: the shard group) and the strided groups across instances (inter).
_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None
_INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP = None

# Tensor + context parallel group; tensor + data + context parallel group.
_TENSOR_AND_CONTEXT_PARALLEL_GROUP = None
_TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP = None

# Every process group created by initialize_model_parallel on this rank (destroyed on reset).
_CREATED_GROUPS = []

# Reusable scratch buffers (see get_global_memory_buffer).
_GLOBAL_MEMORY_BUFFER = None

# Every global above that starts as None: destroy_model_parallel resets them all, so a global
# added above cannot be forgotten there.
_RESET_TO_NONE = [
    name
    for name, value in list(globals().items())
    if name.startswith("_") and name.isupper() and value is None
]

_INIT_HINT = "call megatron.core.parallel_state.initialize_model_parallel() first"


def _not_initialized(what: str) -> RuntimeError:
    return RuntimeError(f"{what} is not initialized; {_INIT_HINT}")


# --------------------------------------------------------------------------------------------
# Initialization
# --------------------------------------------------------------------------------------------


def _new_group(ranks: List[int], timeout: timedelta, backend: Optional[str] = None):
    group = torch.distributed.new_group(ranks, timeout=timeout, backend=backend)
    if torch.distributed.get_rank() in ranks:
        _CREATED_GROUPS.append(group)
    return group


def _build(groups: List[List[int]], timeout: timedelta, with_gloo: bool = False):
    """Create every group (all ranks must call new_group for every group); return this rank's."""
    rank = torch.distributed.get_rank()
    mine, mine_gloo, my_ranks = None, None, None
    for ranks in groups:
        group = _new_group(ranks, timeout)
        group_gloo = _new_group(ranks, timeout, backend="gloo") if with_gloo else None
        if rank in ranks:
            mine, mine_gloo, my_ranks = group, group_gloo, ranks
    return mine, mine_gloo, my_ranks


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    virtual_pipeline_model_parallel_size: Optional[int] = None,
    pipeline_model_parallel_split_rank: Optional[int] = None,
    use_sharp: bool = False,
    context_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    nccl_communicator_config_path: Optional[str] = None,
    distributed_timeout_minutes: int = 30,
    order: str = "tp-cp-ep-dp-pp",
    get_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    get_position_embedding_ranks: Optional[Callable[[List[int]], List[int]]] = None,
    hierarchical_context_parallel_sizes: Optional[List[int]] = None,
    num_distributed_optimizer_instances: int = 1,
) -> None:
    """Create the model and data parallel groups of Megatron's layout.

    Needs `torch.distributed` initialized (any backend: gloo on CPU, nccl on GPU). Every rank
    must call it with the same arguments. See the module docstring for the layout.

    Args:
        tensor_model_parallel_size: ranks splitting each layer (intra-layer parallelism).
        pipeline_model_parallel_size: pipeline stages (inter-layer parallelism).
        virtual_pipeline_model_parallel_size: model chunks per stage (interleaved schedule).
        pipeline_model_parallel_split_rank: first decoder stage of an encoder-decoder model.
        use_sharp: NCCL SHARP for data parallel groups; accepted, no effect here.
        context_parallel_size: ranks splitting the sequence inside attention.
        expert_model_parallel_size: ranks splitting the MoE experts (subdivides data parallel).
        nccl_communicator_config_path: NCCL communicator options; accepted, no effect here.
        distributed_timeout_minutes: timeout of every created group.
        order: rank layout, first dimension fastest varying.
        get_embedding_ranks: pipeline group ranks -> ranks of its word-embedding group
            (default `default_embedding_ranks`: first and last stage, plus the split stage).
        get_position_embedding_ranks: pipeline group ranks -> ranks of its position-embedding
            group (default `default_position_embedding_ranks`: first stage, plus the split stage).
        hierarchical_context_parallel_sizes: sizes of the levels of hierarchical context
            parallelism inside each CP group (product = context_parallel_size; level 0 contiguous,
            level 1 strided), for cp_comm_type 'a2a+p2p'.
        num_distributed_optimizer_instances: N > 1 splits every data x context parallel group
            into N instances of contiguous ranks (the partial data parallel groups, FSDP2's
            shard groups under HSDP) and the N-rank groups across them (the replicate groups).

    Raises:
        ModelParallelInitError: torch.distributed is not initialized, or groups already exist.
        ParallelLayoutError: the sizes do not divide the world size (the message has numbers).
    """
    if not torch.distributed.is_initialized():
        raise ModelParallelInitError(
            "initialize_model_parallel needs torch.distributed; call "
            "torch.distributed.init_process_group() first"
        )
    world_size = torch.distributed.get_world_size()
    rank = torch.distributed.get_rank()
    groups = generate_model_parallel_groups(
        world_size,
        tensor_model_parallel_size=tensor_model_parallel_size,
        pipeline_model_parallel_size=pipeline_model_parallel_size,
        context_parallel_size=context_parallel_size,
        expert_model_parallel_size=expert_model_parallel_size,
        order=order,
        pipeline_model_parallel_split_rank=pipeline_model_parallel_split_rank,
        virtual_pipeline_model_parallel_size=virtual_pipeline_model_parallel_size,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        hierarchical_context_parallel_sizes=hierarchical_context_parallel_sizes,
    )
    dp_cp_size = len(groups["dp-cp"][0])
    if num_distributed_optimizer_instances < 1 or dp_cp_size % num_distributed_optimizer_instances:
        raise ParallelLayoutError(
            f"num_distributed_optimizer_instances ({num_distributed_optimizer_instances}) must "
            f"divide the data x context parallel size ({dp_cp_size})"
        )
    if model_parallel_is_initialized():
        raise ModelParallelInitError(
            "initialize_model_parallel called twice; call destroy_model_parallel() in between"
        )
    if (use_sharp or nccl_communicator_config_path is not None) and rank == 0:
        warnings.warn(
            "use_sharp / nccl_communicator_config_path have no effect in this implementation"
        )
    timeout = timedelta(minutes=distributed_timeout_minutes)

    _set_virtual_pipeline_and_split_rank(
        virtual_pipeline_model_parallel_size, pipeline_model_parallel_split_rank
    )
    _build_data_and_context_parallel_groups(groups, timeout, hierarchical_context_parallel_sizes)
    _build_partial_data_parallel_groups(
        groups["dp-cp"], timeout, num_distributed_optimizer_instances
    )
    _build_model_and_tensor_parallel_groups(groups, timeout)
    _build_pipeline_and_embedding_groups(groups, timeout, rank)
    _build_tensor_data_context_groups(groups, timeout)
    _build_expert_parallel_groups(groups, timeout)
    _set_global_memory_buffer()


def _set_virtual_pipeline_and_split_rank(
    virtual_pipeline_model_parallel_size: Optional[int],
    pipeline_model_parallel_split_rank: Optional[int],
) -> None:
    """The interleaved schedule starts on model chunk 0; the split rank is the first decoder
    stage."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK, _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    if virtual_pipeline_model_parallel_size is not None:
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = 0
        _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = virtual_pipeline_model_parallel_size
    _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = pipeline_model_parallel_split_rank


def _build_data_and_context_parallel_groups(
    groups: dict, timeout: timedelta, hierarchical_context_parallel_sizes: Optional[List[int]]
) -> None:
    """Data parallel groups (without and with CP, each with a gloo copy) and the CP groups."""
    global _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS
    global _DATA_PARALLEL_GROUP_WITH_CP, _DATA_PARALLEL_GROUP_WITH_CP_GLOO
    global _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP
    # The gloo copies carry CPU-side traffic (e.g. the distributed optimizer's state gather).
    _DATA_PARALLEL_GROUP, _DATA_PARALLEL_GROUP_GLOO, _DATA_PARALLEL_GLOBAL_RANKS = _build(
        groups["dp"], timeout, with_gloo=True
    )
    (
        _DATA_PARALLEL_GROUP_WITH_CP,
        _DATA_PARALLEL_GROUP_WITH_CP_GLOO,
        _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP,
    ) = _build(groups["dp-cp"], timeout, with_gloo=True)

    global _CONTEXT_PARALLEL_GROUP, _CONTEXT_PARALLEL_GLOBAL_RANKS
    _CONTEXT_PARALLEL_GROUP, _, _CONTEXT_PARALLEL_GLOBAL_RANKS = _build(groups["cp"], timeout)
    global _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS
    if hierarchical_context_parallel_sizes is not None:
        _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS = [
            _build(groups[f"hcp-{level}"], timeout)[0]
            for level in range(len(hierarchical_context_parallel_sizes))
        ]


def _build_partial_data_parallel_groups(
    dp_cp_groups: List[List[int]], timeout: timedelta, instances: int
) -> None:
    """Intra (contiguous, size dp*cp / instances) and inter (strided, size instances) groups."""
    global _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, _INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
    if instances == 1:
        return
    shard = len(dp_cp_groups[0]) // instances
    intra = [ranks[i * shard : (i + 1) * shard] for ranks in dp_cp_groups for i in range(instances)]
    inter = [ranks[j::shard] for ranks in dp_cp_groups for j in range(shard)]
    _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, _, _ = _build(intra, timeout)
    _INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP, _, _ = _build(inter, timeout)


def _build_model_and_tensor_parallel_groups(groups: dict, timeout: timedelta) -> None:
    """Model parallel (tp x pp, and with ep) and tensor parallel groups."""
    global _MODEL_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP_WITH_EP
    _MODEL_PARALLEL_GROUP, _, _ = _build(groups["mp"], timeout)
    _MODEL_PARALLEL_GROUP_WITH_EP, _, _ = _build(groups["mp-ep"], timeout)

    global _TENSOR_MODEL_PARALLEL_GROUP
    _TENSOR_MODEL_PARALLEL_GROUP, _, _ = _build(groups["tp"], timeout)


def _build_pipeline_and_embedding_groups(groups: dict, timeout: timedelta, rank: int) -> None:
    """Pipeline groups with the word- and position-embedding groups of each (made in one pass)."""
    global _PIPELINE_MODEL_PARALLEL_GROUP, _PIPELINE_GLOBAL_RANKS
    global _EMBEDDING_GROUP, _EMBEDDING_GLOBAL_RANKS
    global _POSITION_EMBEDDING_GROUP, _POSITION_EMBEDDING_GLOBAL_RANKS
    for pp_ranks, emb_ranks, pos_ranks in zip(
        groups["pp"], groups["embedding"], groups["position_embedding"]
    ):
        pp_group = _new_group(pp_ranks, timeout)
        if rank in pp_ranks:
            _PIPELINE_MODEL_PARALLEL_GROUP, _PIPELINE_GLOBAL_RANKS = pp_group, pp_ranks
        emb_group = _new_group(emb_ranks, timeout)
        if rank in emb_ranks:
            _EMBEDDING_GROUP = emb_group
        if rank in pp_ranks:
            _EMBEDDING_GLOBAL_RANKS = emb_ranks
        pos_group = _new_group(pos_ranks, timeout)
        if rank in pos_ranks:
            _POSITION_EMBEDDING_GROUP = pos_group
        if rank in pp_ranks:
            _POSITION_EMBEDDING_GLOBAL_RANKS = pos_ranks


def _build_tensor_data_context_groups(groups: dict, timeout: timedelta) -> None:
    """The combined tp-dp-cp, tp-dp and tp-cp groups."""
    global _TENSOR_AND_DATA_PARALLEL_GROUP, _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP
    global _TENSOR_AND_CONTEXT_PARALLEL_GROUP
    _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP, _, _ = _build(groups["tp-dp-cp"], timeout)
    _TENSOR_AND_DATA_PARALLEL_GROUP, _, _ = _build(groups["tp-dp"], timeout)
    _TENSOR_AND_CONTEXT_PARALLEL_GROUP, _, _ = _build(groups["tp-cp"], timeout)


def _build_expert_parallel_groups(groups: dict, timeout: timedelta) -> None:
    """Expert parallel groups: tp-ep, ep and data-modulo-expert (without and with CP, each with
    a gloo copy)."""
    global _TENSOR_AND_EXPERT_PARALLEL_GROUP, _EXPERT_MODEL_PARALLEL_GROUP
    global _DATA_MODULO_EXPERT_PARALLEL_GROUP, _DATA_MODULO_EXPERT_PARALLEL_GROUP_GLOO
    global _DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP
    global _DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP_GLOO
    _TENSOR_AND_EXPERT_PARALLEL_GROUP, _, _ = _build(groups["tp-ep"], timeout)
    _EXPERT_MODEL_PARALLEL_GROUP, _, _ = _build(groups["ep"], timeout)
    _DATA_MODULO_EXPERT_PARALLEL_GROUP, _DATA_MODULO_EXPERT_PARALLEL_GROUP_GLOO, _ = _build(
        groups["dp-modulo-ep"], timeout, with_gloo=True
    )
    (
        _DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP,
        _DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP_GLOO,
        _,
    ) = _build(groups["dp-modulo-ep-cp"], timeout, with_gloo=True)


def model_parallel_is_initialized() -> bool:
    """Whether initialize_model_parallel() has created the tp, pp and dp groups."""
    return (
        _TENSOR_MODEL_PARALLEL_GROUP is not None
        and _PIPELINE_MODEL_PARALLEL_GROUP is not None
        and _DATA_PARALLEL_GROUP is not None
    )


def is_initialized() -> bool:
    """Whether the data parallel group exists (for code that may run with or without mpu)."""
    return _DATA_PARALLEL_GROUP is not None


def is_unitialized() -> bool:
    """Deprecated Megatron spelling: True when the data parallel group does not exist yet."""
    return _DATA_PARALLEL_GROUP is None


# --------------------------------------------------------------------------------------------
# Group accessors
# --------------------------------------------------------------------------------------------


def _checked(group, what: str, check_initialized: bool = True):
    if check_initialized and group is None:
        raise _not_initialized(what)
    return group


def get_model_parallel_group(with_expert_parallel: bool = False, check_initialized: bool = True):
    """The model parallel (tensor + pipeline) group of the caller; with `with_expert_parallel`,
    the tensor + expert + pipeline group (equal to it when expert parallelism is 1)."""
    if with_expert_parallel:
        return _checked(
            _MODEL_PARALLEL_GROUP_WITH_EP,
            "model parallel group with expert parallel",
            check_initialized,
        )
    return _checked(_MODEL_PARALLEL_GROUP, "model parallel group", check_initialized)


def get_tensor_model_parallel_group(check_initialized: bool = True):
    """The tensor model parallel group of the caller."""
    return _checked(_TENSOR_MODEL_PARALLEL_GROUP, "tensor model parallel group", check_initialized)


def get_pipeline_model_parallel_group(check_initialized: bool = True):
    """The pipeline model parallel group of the caller."""
    return _checked(
        _PIPELINE_MODEL_PARALLEL_GROUP, "pipeline model parallel group", check_initialized
    )


def get_data_parallel_group(
    with_context_parallel: bool = False,
    check_initialized: bool = True,
    partial_data_parallel: bool = False,
):
    """The data parallel group of the caller (optionally including the context parallel ranks).

    With `partial_data_parallel` (needs `with_context_parallel`): the caller's instance of
    contiguous data x context parallel ranks when num_distributed_optimizer_instances > 1, else
    the whole data x context parallel group.
    """
    if partial_data_parallel:
        if not with_context_parallel:
            raise ValueError("partial_data_parallel needs with_context_parallel=True")
        if _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP is not None:
            return _INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP
    if with_context_parallel:
        return _checked(
            _DATA_PARALLEL_GROUP_WITH_CP,
            "data parallel group with context parallel",
            check_initialized,
        )
    return _checked(_DATA_PARALLEL_GROUP, "data parallel group", check_initialized)


def get_inter_partial_data_parallel_group(check_initialized: bool = True):
    """The group of the caller's rank and its counterparts in the other distributed-optimizer
    instances (one rank per instance); None with a single instance."""
    if check_initialized and _DATA_PARALLEL_GROUP_WITH_CP is None:
        raise _not_initialized("inter partial data parallel group")
    return _INTER_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP


def get_data_parallel_group_gloo(
    with_context_parallel: bool = False, check_initialized: bool = True
):
    """The gloo copy of the caller's data parallel group (for CPU-side collectives)."""
    if with_context_parallel:
        return _checked(
            _DATA_PARALLEL_GROUP_WITH_CP_GLOO,
            "data parallel gloo group with context parallel",
            check_initialized,
        )
    return _checked(_DATA_PARALLEL_GROUP_GLOO, "data parallel gloo group", check_initialized)


def get_context_parallel_group(check_initialized: bool = True):
    """The context parallel group of the caller."""
    return _checked(_CONTEXT_PARALLEL_GROUP, "context parallel group", check_initialized)


def get_context_parallel_global_ranks(check_initialized: bool = True):
    """Global ranks of the caller's context parallel group."""
    return _checked(_CONTEXT_PARALLEL_GLOBAL_RANKS, "context parallel group", check_initialized)


def get_hierarchical_context_parallel_groups(check_initialized: bool = True):
    """The caller's hierarchical context parallel groups, level 0 (all-to-all) first."""
    return _checked(
        _HIERARCHICAL_CONTEXT_PARALLEL_GROUPS,
        "hierarchical context parallel groups (pass hierarchical_context_parallel_sizes)",
        check_initialized,
    )


def get_embedding_group(check_initialized: bool = True):
    """The embedding group (first + last pipeline stage) of the caller, None if not a member."""
    if check_initialized and _EMBEDDING_GLOBAL_RANKS is None:
        raise _not_initialized("embedding group")
    return _EMBEDDING_GROUP


def get_position_embedding_group(check_initialized: bool = True):
    """The position embedding group of the caller, None if not a member."""
    if check_initialized and _POSITION_EMBEDDING_GLOBAL_RANKS is None:
        raise _not_initialized("position embedding group")
    return _POSITION_EMBEDDING_GROUP


def get_embedding_global_ranks() -> List[int]:
    """Global ranks of the embedding group of the caller's pipeline."""
    return _checked(_EMBEDDING_GLOBAL_RANKS, "embedding group")


def get_position_embedding_global_ranks() -> List[int]:
    """Global ranks of the position embedding group of the caller's pipeline."""
    return _checked(_POSITION_EMBEDDING_GLOBAL_RANKS, "position embedding group")


def get_tensor_and_data_parallel_group(
    with_context_parallel: bool = False, check_initialized: bool = True
):
    """The tensor + data parallel group (optionally + context parallel) of the caller."""
    if with_context_parallel:
        return _checked(
            _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP,
            "tensor and data parallel group with context parallel",
            check_initialized,
        )
    return _checked(
        _TENSOR_AND_DATA_PARALLEL_GROUP, "tensor and data parallel group", check_initialized
    )


def get_tensor_and_context_parallel_group(check_initialized: bool = True):
    """The tensor + context parallel group of the caller."""
    return _checked(
        _TENSOR_AND_CONTEXT_PARALLEL_GROUP, "tensor and context parallel group", check_initialized
    )


def get_expert_model_parallel_group(check_initialized: bool = True):
    """The expert model parallel group of the caller."""
    return _checked(_EXPERT_MODEL_PARALLEL_GROUP, "expert model parallel group", check_initialized)


def get_tensor_and_expert_parallel_group(check_initialized: bool = True):
    """The tensor + expert parallel group of the caller."""
    return _checked(
        _TENSOR_AND_EXPERT_PARALLEL_GROUP, "tensor and expert parallel group", check_initialized
    )


def get_amax_reduction_group(with_context_parallel: bool = False):
    """The group fp8 amax statistics are reduced over: tensor (+ context) parallel."""
    if with_context_parallel:
        return _checked(_TENSOR_AND_CONTEXT_PARALLEL_GROUP, "FP8 amax reduction group")
    return _checked(_TENSOR_MODEL_PARALLEL_GROUP, "FP8 amax reduction group")


def get_nccl_options(pg_name: str, nccl_comm_cfgs: dict):
    """NCCL options for the process group `pg_name` from a communicator config dict, or None.

    `nccl_comm_cfgs` maps a group name ('tp', 'dp', 'pp', ...) to {'cga_cluster_size',
    'max_ctas', 'min_ctas'} (missing keys take 4, 32 and 1). Groups not in it use NCCL's
    defaults (None).

    Raises:
        RuntimeError: options are asked for but this PyTorch build has no NCCL.
    """
    if pg_name not in nccl_comm_cfgs:
        return None
    if not hasattr(torch.distributed, "ProcessGroupNCCL"):
        raise RuntimeError(f"NCCL options for group '{pg_name}' need a PyTorch build with NCCL")
    nccl_options = torch.distributed.ProcessGroupNCCL.Options()
    nccl_options.config.cga_cluster_size = nccl_comm_cfgs[pg_name].get("cga_cluster_size", 4)
    nccl_options.config.max_ctas = nccl_comm_cfgs[pg_name].get("max_ctas", 32)
    nccl_options.config.min_ctas = nccl_comm_cfgs[pg_name].get("min_ctas", 1)
    return nccl_options


def get_data_modulo_expert_parallel_group(
    with_context_parallel: bool = False, check_initialized: bool = True
):
    """The data parallel group of expert parameters (data parallel / expert parallel)."""
    if with_context_parallel:
        return _checked(
            _DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP,
            "data modulo expert parallel group with context parallel",
            check_initialized,
        )
    return _checked(
        _DATA_MODULO_EXPERT_PARALLEL_GROUP, "data modulo expert parallel group", check_initialized
    )


def get_data_modulo_expert_parallel_group_gloo(with_context_parallel: bool = False):
    """The gloo copy of the data-modulo-expert parallel group."""
    if with_context_parallel:
        return _checked(
            _DATA_MODULO_EXPERT_PARALLEL_GROUP_WITH_CP_GLOO,
            "data modulo expert parallel gloo group with context parallel",
        )
    return _checked(
        _DATA_MODULO_EXPERT_PARALLEL_GROUP_GLOO, "data modulo expert parallel gloo group"
    )


# --------------------------------------------------------------------------------------------
# Sizes and ranks
# --------------------------------------------------------------------------------------------


def set_tensor_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the tensor model parallel size (None restores the group's size)."""
    global _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the pipeline model parallel size (None restores the group's size)."""
    global _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_expert_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Override the expert model parallel size (None restores the group's size)."""
    global _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE = world_size


def set_tensor_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the tensor model parallel rank (None restores the group rank)."""
    global _MPU_TENSOR_MODEL_PARALLEL_RANK
    _MPU_TENSOR_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the pipeline model parallel rank (None restores the group rank)."""
    global _MPU_PIPELINE_MODEL_PARALLEL_RANK
    _MPU_PIPELINE_MODEL_PARALLEL_RANK = rank


def set_expert_model_parallel_rank(rank: Optional[int]) -> None:
    """Override the expert model parallel rank (None restores the group rank)."""
    global _MPU_EXPERT_MODEL_PARALLEL_RANK
    _MPU_EXPERT_MODEL_PARALLEL_RANK = rank


def set_pipeline_model_parallel_split_rank(rank: Optional[int]) -> None:
    """Set the encoder/decoder pipeline split rank."""
    global _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    _PIPELINE_MODEL_PARALLEL_SPLIT_RANK = rank


def get_tensor_model_parallel_world_size() -> int:
    """Number of ranks in the tensor model parallel group."""
    if _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_WORLD_SIZE
    return torch.distributed.get_world_size(group=get_tensor_model_parallel_group())


def get_pipeline_model_parallel_world_size() -> int:
    """Number of pipeline stages."""
    if _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    return torch.distributed.get_world_size(group=get_pipeline_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    """Rank of the caller in its tensor model parallel group."""
    if _MPU_TENSOR_MODEL_PARALLEL_RANK is not None:
        return _MPU_TENSOR_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=get_tensor_model_parallel_group())


def get_pipeline_model_parallel_rank() -> int:
    """Pipeline stage of the caller."""
    if _MPU_PIPELINE_MODEL_PARALLEL_RANK is not None:
        return _MPU_PIPELINE_MODEL_PARALLEL_RANK
    return torch.distributed.get_rank(group=get_pipeline_model_parallel_group())


def get_pipeline_model_parallel_split_rank() -> Optional[int]:
    """The encoder/decoder pipeline split rank (None for single-stack models)."""
    return _PIPELINE_MODEL_PARALLEL_SPLIT_RANK


def get_virtual_pipeline_model_parallel_rank() -> Optional[int]:
    """Current model chunk index of the interleaved schedule (None without virtual pipeline)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK


def set_virtual_pipeline_model_parallel_rank(rank: Optional[int]) -> None:
    """Set the current model chunk index of the interleaved schedule."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_RANK = rank


def get_virtual_pipeline_model_parallel_world_size() -> Optional[int]:
    """Model chunks per pipeline stage (None without virtual pipeline)."""
    return _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE


def set_virtual_pipeline_model_parallel_world_size(world_size: Optional[int]) -> None:
    """Set the number of model chunks per pipeline stage."""
    global _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE
    _VIRTUAL_PIPELINE_MODEL_PARALLEL_WORLD_SIZE = world_size


def is_pipeline_first_stage(ignore_virtual: bool = False) -> bool:
    """True on pipeline stage 0 (and, unless ignore_virtual, on model chunk 0)."""
    interleaved = get_virtual_pipeline_model_parallel_world_size() is not None
    if interleaved and not ignore_virtual and get_virtual_pipeline_model_parallel_rank() != 0:
        return False  # a later model chunk of stage 0
    return get_pipeline_model_parallel_rank() == 0


def is_pipeline_last_stage(ignore_virtual: bool = False) -> bool:
    """True on the last pipeline stage (and, unless ignore_virtual, on its last model chunk)."""
    if not ignore_virtual:
        vp_size = get_virtual_pipeline_model_parallel_world_size()
        if vp_size is not None and get_virtual_pipeline_model_parallel_rank() != vp_size - 1:
            return False
    return get_pipeline_model_parallel_rank() == get_pipeline_model_parallel_world_size() - 1


def is_rank_in_embedding_group(ignore_virtual: bool = False) -> bool:
    """Whether the caller takes part in the embedding-gradient all-reduce.

    With ignore_virtual: plain membership. Otherwise the first member only while on the first
    (virtual) stage, the last member only on the last (virtual) stage, split ranks always.
    """
    rank = torch.distributed.get_rank()
    ranks = get_embedding_global_ranks()
    if ignore_virtual:
        return rank in ranks
    if rank in ranks:
        if rank == ranks[0]:
            return is_pipeline_first_stage(ignore_virtual=False)
        if rank == ranks[-1]:
            return is_pipeline_last_stage(ignore_virtual=False)
        return True
    return False


def is_rank_in_position_embedding_group() -> bool:
    """Whether the caller is in the position embedding group."""
    return torch.distributed.get_rank() in get_position_embedding_global_ranks()


def is_pipeline_stage_before_split(rank: Optional[int] = None) -> bool:
    """True if the stage (default: the caller's) runs the encoder of an encoder-decoder model."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    split = _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    return split is None or rank < split


def is_pipeline_stage_after_split(rank: Optional[int] = None) -> bool:
    """True if the stage (default: the caller's) runs the decoder of an encoder-decoder model."""
    if get_pipeline_model_parallel_world_size() == 1:
        return True
    if rank is None:
        rank = get_pipeline_model_parallel_rank()
    split = _PIPELINE_MODEL_PARALLEL_SPLIT_RANK
    return split is None or rank >= split


def is_pipeline_stage_at_split() -> bool:
    """True on the last encoder stage when the next stage is the first decoder stage."""
    rank = get_pipeline_model_parallel_rank()
    return is_pipeline_stage_before_split(rank) and is_pipeline_stage_after_split(rank + 1)


def is_inside_encoder(rank: Optional[int] = None) -> bool:
    """Alias of is_pipeline_stage_before_split for encoder-decoder models."""
    return is_pipeline_stage_before_split(rank)


def is_inside_decoder(rank: Optional[int] = None) -> bool:
    """Alias of is_pipeline_stage_after_split for encoder-decoder models."""
    return is_pipeline_stage_after_split(rank)


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of the first rank of the caller's tensor model parallel group."""
    global_rank = torch.distributed.get_rank()
    local_world_size = get_tensor_model_parallel_world_size()
    return (global_rank // local_world_size) * local_world_size


def get_data_parallel_src_rank(with_context_parallel: bool = False) -> int:
    """Global rank of the first rank of the caller's data parallel group."""
    ranks = (
        _DATA_PARALLEL_GLOBAL_RANKS_WITH_CP
        if with_context_parallel
        else _DATA_PARALLEL_GLOBAL_RANKS
    )
    return _checked(ranks, "data parallel group")[0]


def get_pipeline_model_parallel_first_rank() -> int:
    """Global rank of the first stage of the caller's pipeline."""
    return _checked(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")[0]


def get_pipeline_model_parallel_last_rank() -> int:
    """Global rank of the last stage of the caller's pipeline."""
    return _checked(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")[-1]


def get_pipeline_model_parallel_next_rank() -> int:
    """Global rank of the next stage (wraps around)."""
    ranks = _checked(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")
    return ranks[
        (get_pipeline_model_parallel_rank() + 1) % get_pipeline_model_parallel_world_size()
    ]


def get_pipeline_model_parallel_prev_rank() -> int:
    """Global rank of the previous stage (wraps around)."""
    ranks = _checked(_PIPELINE_GLOBAL_RANKS, "pipeline model parallel group")
    return ranks[
        (get_pipeline_model_parallel_rank() - 1) % get_pipeline_model_parallel_world_size()
    ]


def get_data_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Number of data parallel replicas (0 when torch.distributed is not initialized)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(
            group=get_data_parallel_group(with_context_parallel)
        )
    return 0


def get_data_parallel_rank(with_context_parallel: bool = False) -> int:
    """Rank of the caller in its data parallel group (0 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=get_data_parallel_group(with_context_parallel))
    return 0


def get_context_parallel_world_size() -> int:
    """Number of ranks in the context parallel group (0 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group=get_context_parallel_group())
    return 0


def get_context_parallel_rank() -> int:
    """Rank of the caller in its context parallel group (0 without torch.distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=get_context_parallel_group())
    return 0


def get_tensor_and_context_parallel_world_size() -> int:
    """Number of ranks in the tensor + context parallel group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group=get_tensor_and_context_parallel_group())
    return 0


def get_tensor_and_context_parallel_rank() -> int:
    """Rank of the caller in its tensor + context parallel group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=get_tensor_and_context_parallel_group())
    return 0


def get_tensor_and_expert_parallel_world_size() -> int:
    """Number of ranks in the caller's tensor + expert parallel group (0 without distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(group=get_tensor_and_expert_parallel_group())
    return 0


def get_tensor_and_expert_parallel_rank() -> int:
    """Rank of the caller in its tensor + expert parallel group (0 without distributed)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(group=get_tensor_and_expert_parallel_group())
    return 0


def get_expert_model_parallel_world_size() -> int:
    """Number of expert parallel ranks."""
    if _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_WORLD_SIZE
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        size = torch.distributed.get_world_size(group=get_tensor_and_expert_parallel_group())
        return size // get_tensor_model_parallel_world_size()
    return 0


def get_expert_model_parallel_rank() -> int:
    """Rank of the caller among the expert parallel ranks."""
    if _MPU_EXPERT_MODEL_PARALLEL_RANK is not None:
        return _MPU_EXPERT_MODEL_PARALLEL_RANK
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank = torch.distributed.get_rank(group=get_tensor_and_expert_parallel_group())
        return rank // get_tensor_model_parallel_world_size()
    return 0


def get_data_modulo_expert_parallel_rank(with_context_parallel: bool = False) -> int:
    """Rank of the caller in its data-modulo-expert parallel group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(
            group=get_data_modulo_expert_parallel_group(with_context_parallel)
        )
    return 0


def get_data_modulo_expert_parallel_world_size(with_context_parallel: bool = False) -> int:
    """Number of ranks in the caller's data-modulo-expert parallel group."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size(
            group=get_data_modulo_expert_parallel_group(with_context_parallel)
        )
    return 0


# --------------------------------------------------------------------------------------------
# Global memory buffer
# --------------------------------------------------------------------------------------------


def _set_global_memory_buffer():
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = GlobalMemoryBuffer()


def get_global_memory_buffer() -> GlobalMemoryBuffer:
    """The global scratch buffer (created by initialize_model_parallel)."""
    return _checked(_GLOBAL_MEMORY_BUFFER, "global memory buffer")


def destroy_global_memory_buffer() -> None:
    """Drop the global scratch buffer."""
    global _GLOBAL_MEMORY_BUFFER
    _GLOBAL_MEMORY_BUFFER = None


# --------------------------------------------------------------------------------------------
# Teardown
# --------------------------------------------------------------------------------------------


def destroy_model_parallel() -> None:
    """Reset every global of this module and release the groups initialize_model_parallel made.

    The default process group is left alone (torch.distributed.destroy_process_group() is the
    caller's business).
    """
    g = globals()
    for name in _RESET_TO_NONE:
        g[name] = None
    created = list(_CREATED_GROUPS)
    _CREATED_GROUPS.clear()
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        for group in created:
            try:
                torch.distributed.destroy_process_group(group)
            except (ValueError, RuntimeError, KeyError):
                # Already destroyed (e.g. by a caller that tore the groups down itself).
                pass
