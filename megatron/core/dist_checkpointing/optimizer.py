"""Optimizer state as sharded state dicts, keyed by the model's parameter keys.

Every per-parameter state tensor `k` (Adam's `exp_avg`, `exp_avg_sq`, and the fp32 main copy
`fp32_param` of a 16-bit or distributed-optimizer parameter) is stored under
`optimizer.state.{k}.{model key}` with the model parameter's global shape, so the optimizer
state reshards exactly like the weights:

- non-distributed optimizers (fp32, fp16/bf16 with fp32 main params): each state tensor is the
  model parameter's chunk (same replica id as the parameter);
- the distributed optimizer, `fully_sharded_model_space`: each data-parallel rank writes only
  the flattened range of each parameter it owns (replica id (pp, tp, 0): every DP rank is a
  main replica of its own range); stored with the model's global shape (a range becomes the
  few rectangular boxes it covers), so the same checkpoint loads into a distributed or a
  non-distributed optimizer at any TP / PP / DP;
- the distributed optimizer, `dp_zero_gather_scatter` (`--no-ckpt-fully-parallel-save`): the
  state is gathered on DP rank 0 and stored as one object per model-parallel rank
  (`optimizer.distributed.dp_group_idx_{i}.param_state`); it reloads only at the same TP / PP.

Non-tensor state (param-group hyperparameters, the shared step, the loss scaler) is common
state (rank 0's copy in common.pt).
"""

import copy
import dataclasses
import itertools
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)

FULLY_SHARDED_MODEL_SPACE = 'fully_sharded_model_space'
DP_ZERO_GATHER_SCATTER = 'dp_zero_gather_scatter'
SHARDING_TYPES = (FULLY_SHARDED_MODEL_SPACE, DP_ZERO_GATHER_SCATTER)


def get_param_id_to_sharded_param_map(model_sharded_state_dict) -> Dict[int, Any]:
    """{id(parameter): its ShardedTensor / ShardedTensorFactory} of a model sharded state dict."""
    out = {}
    for sh in nested_values(model_sharded_state_dict):
        if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and sh.data is not None:
            out[id(sh.data)] = sh
    return out


def make_sharded_optimizer_tensor(model_param, optim_param: torch.Tensor, prefix: str):
    """The model parameter's ShardedTensor (or factory) for a state tensor, key `prefix.key`."""
    key = f'{prefix}.{model_param.key}'
    if isinstance(model_param, ShardedTensorFactory):
        return dataclasses.replace(model_param, key=key, data=optim_param)
    if tuple(optim_param.shape) != tuple(model_param.local_shape):
        raise ValueError(
            f'optimizer state {key} has shape {tuple(optim_param.shape)}, the parameter '
            f'{model_param.local_shape}'
        )
    return dataclasses.replace(model_param, key=key, data=optim_param, dtype=optim_param.dtype)


def make_flattened_optimizer_tensor(
    model_param, flat: torch.Tensor, prefix: str, start: int, stop: int
):
    """A distributed-optimizer slice [start, stop) of the flattened parameter's state."""
    rid = model_param.replica_id
    if not (isinstance(rid, tuple) and len(rid) == 3):
        raise ValueError(
            f'Expected replica_id format (PP, TP, DP), got {rid} for {model_param.key}'
        )
    return dataclasses.replace(
        model_param,
        key=f'{prefix}.{model_param.key}',
        data=flat,
        flattened_range=slice(start, stop),
        replica_id=(rid[0], rid[1], 0),
        **({} if isinstance(model_param, ShardedTensorFactory) else {'dtype': flat.dtype}),
    )


def _shared_step(state: Dict) -> Optional[torch.Tensor]:
    steps = {float(s['step']) for s in state.values() if 'step' in s}
    if len(steps) > 1:
        raise ValueError(
            'The optimizer step differs per parameter. Mcore only supports optimizers whose step '
            'is shared across all parameters.'
        )
    return torch.tensor(steps.pop(), dtype=torch.float32) if steps else None


def optim_state_to_sharding_state(
    optim_state_dict: Dict,
    param_index_to_sharded: Dict[int, Any],
    exclude_keys: Iterable = ('step',),
) -> None:
    """A torch optimizer's `state_dict()` -> sharded, in place (Megatron's layout).

    `state[i][k]` become ShardedTensors `optimizer.state.{k}.{model key}`; the shared step goes
    to `state['common_step']`; the param ids of the groups are not persisted (the loading run's
    own ids are put back).
    """
    sharded_state = {}
    for param_id, param_state in optim_state_dict['state'].items():
        if param_id not in param_index_to_sharded:
            raise ValueError(f'Param id {param_id} does not match any model sharded param')
        sharded_state[param_id] = {
            k: make_sharded_optimizer_tensor(
                param_index_to_sharded[param_id], v, prefix=f'optimizer.state.{k}'
            )
            for k, v in param_state.items()
            if k not in exclude_keys
        }
    step = _shared_step(optim_state_dict['state'])
    if step is not None:
        sharded_state['common_step'] = step
    optim_state_dict['param_groups'] = copy.deepcopy(optim_state_dict['param_groups'])
    for group in optim_state_dict['param_groups']:
        group['params'] = LocalNonpersistentObject(group['params'])
    optim_state_dict['state'] = sharded_state


def inner_param_index_map(optimizer: torch.optim.Optimizer, model_params_of) -> Dict[int, Any]:
    """{index in optimizer.state_dict(): model parameter} (main params mapped to theirs)."""
    out = {}
    params = itertools.chain.from_iterable(g['params'] for g in optimizer.param_groups)
    for index, param in enumerate(params):
        out[index] = model_params_of.get(id(param), param)
    return out


def non_distributed_sharded_state_dict(
    megatron_optimizer, model_sharded_state_dict, is_loading: bool = False
) -> Dict:
    """FP32Optimizer / Float16OptimizerWithFloat16Params state as a sharded state dict."""
    inner = megatron_optimizer.optimizer
    if is_loading and megatron_optimizer.init_state_fn is not None:
        megatron_optimizer.init_state_fn(inner)
    by_param = get_param_id_to_sharded_param_map(model_sharded_state_dict)
    main_to_model = {}
    for model_group, main_group in zip(
        getattr(megatron_optimizer, 'float16_groups', []),
        getattr(megatron_optimizer, 'fp32_from_float16_groups', []),
    ):
        for model_param, main_param in zip(model_group, main_group):
            main_to_model[id(main_param)] = model_param
    index_to_sharded = {}
    for index, model_param in inner_param_index_map(inner, main_to_model).items():
        if id(model_param) not in by_param:
            raise ValueError(
                f'optimizer parameter {index} (shape {tuple(model_param.shape)}) is not in the '
                f'model sharded state dict'
            )
        index_to_sharded[index] = by_param[id(model_param)]
    state_dict = megatron_optimizer.state_dict()
    inner_sd = state_dict['optimizer'] if 'optimizer' in state_dict else state_dict
    if 'fp32_from_fp16_params' in state_dict:
        state_dict['fp32_from_fp16_params'] = [
            [
                make_sharded_optimizer_tensor(
                    by_param[id(model_param)], main_param, 'optimizer.state.fp32_param'
                )
                for model_param, main_param in zip(model_group, main_group)
            ]
            for model_group, main_group in zip(
                megatron_optimizer.float16_groups, megatron_optimizer.fp32_from_float16_groups
            )
        ]
    optim_state_to_sharding_state(inner_sd, index_to_sharded)
    return state_dict


# ---------------------------------------------------------------------------------------------
# distributed optimizer


def distributed_sharded_state_dict(
    dist_optimizer,
    model_sharded_state_dict,
    is_loading: bool = False,
    sharding_type: str = FULLY_SHARDED_MODEL_SPACE,
) -> Dict:
    """DistributedOptimizer state as a sharded state dict (see the module docstring)."""
    if sharding_type not in SHARDING_TYPES:
        raise ValueError(f'unknown distributed optimizer sharding type {sharding_type!r}')
    dist_optimizer._finish_param_syncs()
    dist_optimizer._ensure_state()
    state_dict = dist_optimizer.state_dict()
    if sharding_type == FULLY_SHARDED_MODEL_SPACE:
        param_state = _fs_model_space_state(dist_optimizer, model_sharded_state_dict)
    else:
        param_state = _dp_zero_state(dist_optimizer, is_loading)
    state_dict['param_state'] = param_state
    state_dict['param_state_sharding_type'] = sharding_type
    return state_dict


def optimizer_state_keys(optimizer: torch.optim.Optimizer) -> List[str]:
    """Per-element optimizer state tensors saved in parameter-state files."""
    if isinstance(optimizer, torch.optim.Adam) or isinstance(optimizer, torch.optim.AdamW):
        return ['exp_avg', 'exp_avg_sq']
    if isinstance(optimizer, torch.optim.SGD):
        momentum = optimizer.defaults.get('momentum', 0.0)
        return ['momentum_buffer'] if momentum else []
    raise TypeError(
        f'the distributed optimizer does not know the state of {type(optimizer).__name__}'
    )


def distributed_state_keys(dist_optimizer) -> List[str]:
    return ['fp32_param'] + optimizer_state_keys(dist_optimizer.optimizer)


def _fs_model_space_state(dist_optimizer, model_sharded_state_dict) -> Dict[int, Dict]:
    by_param = get_param_id_to_sharded_param_map(model_sharded_state_dict)
    keys = distributed_state_keys(dist_optimizer)
    param_state = {}
    for index, (model_param, main_param) in enumerate(
        dist_optimizer._shard_main_params_with_model_params()
    ):
        if id(model_param) not in by_param:
            raise ValueError(
                f'a distributed-optimizer parameter (shape {tuple(model_param.shape)}) is not in '
                f'the model sharded state dict'
            )
        sh = by_param[id(model_param)]
        rng = dist_optimizer.param_range_map[model_param]['param']
        tensors = {'fp32_param': main_param}
        tensors.update(dist_optimizer.optimizer.state[main_param])
        param_state[index] = {
            k: make_flattened_optimizer_tensor(
                sh, tensors[k].detach().view(-1), f'optimizer.state.{k}', rng.start, rng.end
            )
            for k in keys
        }
    return param_state


def _dp_group_index(dist_optimizer) -> int:
    """Which data-parallel group the optimizer is sharded over: the model-parallel rank, or for
    the expert optimizer (sharded over the expert-data-parallel group, one per expert-parallel
    rank too) ep_rank x model-parallel size + model-parallel rank (Megatron's numbering)."""
    group = parallel_state.get_model_parallel_group()
    index = torch.distributed.get_rank(group)
    if getattr(dist_optimizer, 'is_expert_optimizer', False):
        ep_rank = parallel_state.get_expert_model_parallel_rank()
        index += ep_rank * torch.distributed.get_world_size(group)
    return index


def _dp_zero_state(dist_optimizer, is_loading: bool):
    key = f'optimizer.distributed.dp_group_idx_{_dp_group_index(dist_optimizer)}.param_state'
    state = None if is_loading else dist_optimizer.get_parameter_state_dp_zero()
    if dist_optimizer.is_dp_zero():
        # A fresh gathered copy: an async save pickles it in the background.
        return ShardedObject(key, state, (1,), (0,), replica_id=0, snapshot=True)
    return LocalNonpersistentObject(None)


# ---------------------------------------------------------------------------------------------
# after loading


def _find(d: Any, path: Tuple) -> Any:
    for p in path:
        if not isinstance(d, dict) or p not in d:
            return None
        d = d[p]
    return d


def loaded_common_state(loaded: Dict) -> Tuple[Optional[List[Dict]], Optional[float], Any]:
    """(param groups, shared step, grad-scaler state) of a loaded optimizer state dict,
    whichever optimizer kind wrote it (distributed: `optimizer.param_groups`; fp32:
    `param_groups` + `state.common_step`; fp16/bf16: `optimizer.param_groups` +
    `optimizer.state.common_step`)."""
    groups = _find(loaded, ('optimizer', 'param_groups')) or _find(loaded, ('param_groups',))
    step = _find(loaded, ('optimizer', 'state', 'common_step'))
    if step is None:
        step = _find(loaded, ('state', 'common_step'))
    if step is None and groups and 'step' in groups[0]:
        step = groups[0]['step']
    return groups, (None if step is None else float(step)), loaded.get('grad_scaler')


def restore_after_sharded_load(megatron_optimizer, loaded: Dict) -> None:
    """Apply the non-tensor state of a loaded optimizer state dict (tensors are in place).

    Works across optimizer kinds (distributed or not, fp32 or 16-bit): the state tensors were
    loaded into this optimizer's own tensors; here the param-group hyperparameters, the shared
    step (torch Adam's per-parameter `step`, the group counter) and the loss scaler follow.
    """
    groups, step, scaler = loaded_common_state(loaded)
    param_groups = megatron_optimizer.param_groups
    if groups is not None:
        if len(groups) != len(param_groups):
            raise ValueError(
                f'checkpoint has {len(groups)} optimizer param groups, the model has '
                f'{len(param_groups)}'
            )
        for group, saved in zip(param_groups, groups):
            group.update({k: v for k, v in saved.items() if k not in ('params', 'step')})
    if step is not None:
        for group in param_groups:
            group['step'] = int(step)
            for param in group['params']:
                state = megatron_optimizer.optimizer.state.get(param)
                if state and 'step' in state:
                    state['step'] = torch.tensor(
                        step, dtype=torch.float32, device=state['step'].device
                    )
    grad_scaler = getattr(megatron_optimizer, 'grad_scaler', None)
    if scaler is not None and grad_scaler is not None:
        grad_scaler.load_state_dict(scaler)
