"""The process groups a model communicates over, passed explicitly from the model down.

`ProcessGroupCollection` is the name later Megatron-core versions use (megatron/core/
process_groups_config.py) for the same purpose. Models and layers take an optional
`pg_collection`; each field left None falls back to the global group of `parallel_state`, through
that group's one fallback helper (`get_<group>_group_if_none`). Modules resolve the groups once in
their constructor, store the result and use only it in forward, so a model can run on groups other
than the global ones (e.g. two models side by side on different TP groups).
"""

import dataclasses
from dataclasses import dataclass
from typing import Iterable, List, Optional

import torch

from megatron.core import group_fallbacks

#: Field -> fallback helper of parallel_state returning the global group for None.
_FALLBACKS = {
    "tp": group_fallbacks.get_tensor_model_parallel_group_if_none,
    "pp": group_fallbacks.get_pipeline_model_parallel_group_if_none,
    "cp": group_fallbacks.get_context_parallel_group_if_none,
    "embd": group_fallbacks.get_embedding_group_if_none,
    "pos_embd": group_fallbacks.get_position_embedding_group_if_none,
    "dp": group_fallbacks.get_data_parallel_group_if_none,
    "ep": group_fallbacks.get_expert_model_parallel_group_if_none,
    "tp_ep": group_fallbacks.get_tensor_and_expert_parallel_group_if_none,
    "tp_cp": group_fallbacks.get_tensor_and_context_parallel_group_if_none,
    "expt_dp": group_fallbacks.get_data_modulo_expert_parallel_group_if_none,
    "dp_cp": group_fallbacks.get_data_parallel_group_with_cp_if_none,
    "hcp": group_fallbacks.get_hierarchical_context_parallel_groups_if_none,
}


@dataclass
class ProcessGroupCollection:
    """Process groups of one model replica; None means "the global group of parallel_state".

    The embedding groups are None on ranks that are not members, as parallel_state's are.
    """

    tp: Optional[torch.distributed.ProcessGroup] = None
    """Tensor model parallel group (splits of every layer)."""

    pp: Optional[torch.distributed.ProcessGroup] = None
    """Pipeline model parallel group (stage-to-stage p2p)."""

    cp: Optional[torch.distributed.ProcessGroup] = None
    """Context parallel group."""

    embd: Optional[torch.distributed.ProcessGroup] = None
    """Word-embedding group (first and last stage: tied embedding / output weight)."""

    pos_embd: Optional[torch.distributed.ProcessGroup] = None
    """Position-embedding group (first stage, plus the encoder/decoder split stage)."""

    dp: Optional[torch.distributed.ProcessGroup] = None
    """Data parallel group."""

    ep: Optional[torch.distributed.ProcessGroup] = None
    """Expert model parallel group (ranks holding different experts of one MoE layer)."""

    tp_ep: Optional[torch.distributed.ProcessGroup] = None
    """Tensor + expert parallel group (the allgather token dispatcher's group)."""

    tp_cp: Optional[torch.distributed.ProcessGroup] = None
    """Tensor + context parallel group (ranks splitting one sequence)."""

    expt_dp: Optional[torch.distributed.ProcessGroup] = None
    """Data parallel group of expert parameters (data-modulo-expert, with context parallel)."""

    dp_cp: Optional[torch.distributed.ProcessGroup] = None
    """Data parallel group including the context parallel ranks (gradient reduction: CP ranks
    hold replicas of every weight)."""

    hcp: Optional[List[torch.distributed.ProcessGroup]] = None
    """Hierarchical context parallel groups, level 0 (all-to-all) then level 1 (ring), for
    cp_comm_type 'a2a+p2p'."""

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: Optional[Iterable[str]] = None):
        """A collection of the global groups (all fields but the optional `hcp`, or only
        `required_pgs`)."""
        default = tuple(name for name in _FALLBACKS if name != "hcp")
        return resolve_process_groups(None, required_pgs or default)


def resolve_process_groups(
    pg_collection: Optional[ProcessGroupCollection], required: Iterable[str]
) -> ProcessGroupCollection:
    """A copy of `pg_collection` (never modified) whose `required` fields that are None hold the
    global groups. Embedding groups of non-member ranks stay None."""
    base = pg_collection if pg_collection is not None else ProcessGroupCollection()
    resolved = {name: _FALLBACKS[name](getattr(base, name)) for name in required}
    return dataclasses.replace(base, **resolved)
