"""RNG states in checkpoints: capture (python, numpy, torch, CUDA, the model-parallel tracker)
and restore. Re-exported by checkpointing.py; the torch_dist format wraps the captured list into
a ShardedObject (checkpointing_dist.py)."""

import random
from typing import Any, Dict, List

import numpy as np
import torch

from megatron.core import parallel_state as mpu
from megatron.core.utils import uses_cuda
from megatron.training.global_vars import get_args


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def _np_state_to_checkpoint(state: tuple) -> tuple:
    """numpy's MT19937 state with the key array as a tensor (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached_gaussian = state
    keys = torch.from_numpy(keys.astype(np.int64))
    return (name, keys, int(pos), int(has_gauss), float(cached_gaussian))


def _np_state_from_checkpoint(state: tuple) -> tuple:
    name, keys, pos, has_gauss, cached_gaussian = state
    if isinstance(keys, torch.Tensor):
        keys = keys.numpy().astype(np.uint32)
    return (name, keys, pos, has_gauss, cached_gaussian)


def get_rng_state(use_dist_ckpt: bool = False) -> List[Dict[str, Any]]:
    """This rank's RNG states (python, numpy, torch, CUDA, model-parallel tracker).

    Returns a one-element list, or with `--data-parallel-random-init` the states of every
    data-parallel rank (an all-gather over the data-parallel group; every rank must call it).
    `use_dist_ckpt` is accepted for Megatron signature parity: the torch_dist format wraps this
    list into a ShardedObject itself (checkpointing_dist.py).
    """
    from megatron.core import tensor_parallel

    args = get_args()
    rng_state = {
        'random_rng_state': random.getstate(),
        'np_rng_state': _np_state_to_checkpoint(np.random.get_state()),
        'torch_rng_state': torch.get_rng_state(),
        'rng_tracker_states': tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if uses_cuda():
        rng_state['cuda_rng_state'] = torch.cuda.get_rng_state()

    if (
        torch.distributed.is_initialized()
        and mpu.get_data_parallel_world_size() > 1
        and args.data_parallel_random_init
    ):
        rng_state_list = [None] * mpu.get_data_parallel_world_size()
        torch.distributed.all_gather_object(
            rng_state_list, rng_state, group=mpu.get_data_parallel_group()
        )
    else:
        rng_state_list = [rng_state]
    return rng_state_list


def _set_rng_state(rng_state: Dict[str, Any], checkpoint_name: str) -> None:
    """Restore the states `get_rng_state` captured."""
    from megatron.core import tensor_parallel

    random.setstate(rng_state['random_rng_state'])
    np.random.set_state(_np_state_from_checkpoint(rng_state['np_rng_state']))
    torch.set_rng_state(rng_state['torch_rng_state'])
    if uses_cuda():
        if 'cuda_rng_state' in rng_state:
            torch.cuda.set_rng_state(rng_state['cuda_rng_state'])
        else:
            print_rank_0(
                f'WARNING: {checkpoint_name} was saved without CUDA; CUDA RNG state not restored'
            )
    if not rng_state['rng_tracker_states']:
        raise KeyError('rng_tracker_states')
    tensor_parallel.get_cuda_rng_tracker().set_states(rng_state['rng_tracker_states'])


def restore_rng_state(args, rng_states, checkpoint_name: str) -> None:
    """Restore this rank's entry of the saved RNG-state list (per DP rank with
    --data-parallel-random-init)."""
    try:
        if args.data_parallel_random_init:
            dp_rank = mpu.get_data_parallel_rank()
            if dp_rank >= len(rng_states):
                raise KeyError(f'rng_state[{dp_rank}] (checkpoint has {len(rng_states)} entries)')
            rng_state = rng_states[dp_rank]
        else:
            rng_state = rng_states[0]
        _set_rng_state(rng_state, checkpoint_name)
    except KeyError as exc:
        raise ValueError(
            f'Unable to load rng state from checkpoint {checkpoint_name} (missing {exc}). '
            f'Specify --no-load-rng or --finetune to prevent attempting to load the rng state.'
        ) from exc
