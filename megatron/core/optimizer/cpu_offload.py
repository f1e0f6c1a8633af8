"""Host-resident optimizer state for the distributed optimizer (`optimizer_cpu_offload`).

Later Megatron's hybrid CPU-offload optimizer keeps a fraction of the optimizer's parameters on
the host and steps them there. Here the distributed optimizer's own machinery does it: a chosen
shard main param gets an fp32 copy on the host (pinned when CUDA exists), the inner torch
optimizer holds that copy (so its Adam state and step are created on the host and the host
steps it), its gradient is copied to the host before the step and the updated values are copied
back into the model's parameter buffer after it, exactly as for a half-precision parameter's fp32
master copy. An fp32 model parameter chosen for offload is therefore moved from the distributed
optimizer's "fp32" groups (whose shards are views of the parameter buffer) to its
"half-precision" groups (a model-side view plus a separate fp32 master).

The arithmetic is unchanged (the same fp32 Adam update on the same values), so results equal the
plain distributed optimizer's; on a machine without a GPU every tensor is already on the host and
only the fp32 views become copies.
"""

from typing import List

import torch

from .. import tensor_parallel
from ..device import uses_cuda


def _host_copy(shard: torch.Tensor, model_param: torch.nn.Parameter) -> torch.Tensor:
    host = torch.empty(shard.shape, dtype=torch.float32, device='cpu', pin_memory=uses_cuda())
    host.copy_(shard)
    tensor_parallel.copy_tensor_model_parallel_attributes(host, model_param)
    if hasattr(model_param, 'shared'):
        host.shared = model_param.shared
    return host


def offload_main_params(dist_opt, fraction: float) -> int:
    """Move the first `fraction` of `dist_opt`'s main-param elements to the host.

    Args:
        dist_opt: a DistributedOptimizer whose shard groups are built and whose inner optimizer
            has no state yet.
        fraction: in [0, 1]; params are taken greedily, in param-group order, while fewer than
            fraction x all elements are offloaded.

    Returns:
        The number of offloaded elements.
    """
    total = sum(p.numel() for g in dist_opt.optimizer.param_groups for p in g['params'])
    budget = fraction * total
    offloaded = 0
    for index, param_group in enumerate(dist_opt.optimizer.param_groups):
        kept_models: List[torch.nn.Parameter] = []
        kept_shards: List[torch.Tensor] = []
        half_models = dist_opt.model_float16_groups[index]
        half_shards = dist_opt.shard_float16_groups[index]
        masters = dist_opt.shard_fp32_from_float16_groups[index]
        for i, master in enumerate(masters):
            if offloaded >= budget:
                break
            if master.device.type != 'cpu':
                masters[i] = _host_copy(master, half_models[i])
            offloaded += master.numel()
        moved_models, moved_shards, moved_masters = [], [], []
        for model_param, shard in zip(
            dist_opt.model_fp32_groups[index], dist_opt.shard_fp32_groups[index]
        ):
            if offloaded < budget:
                moved_models.append(model_param)
                moved_shards.append(shard)
                moved_masters.append(_host_copy(shard, model_param))
                offloaded += shard.numel()
            else:
                kept_models.append(model_param)
                kept_shards.append(shard)
        dist_opt.model_fp32_groups[index] = kept_models
        dist_opt.shard_fp32_groups[index] = kept_shards
        half_models.extend(moved_models)
        half_shards.extend(moved_shards)
        masters.extend(moved_masters)
        param_group['params'] = [*kept_shards, *masters]
    return offloaded
