"""Save and load training checkpoints in the distributed `torch_dist` format.

Layout (Megatron's; `--use-dist-ckpt` or `--ckpt-format torch_dist`)::

    latest_checkpointed_iteration.txt      the iteration (or "release"), as for the torch format
    iter_0000500/
        common.pt                          rank 0's non-sharded state: args, iteration,
                                           checkpoint_version, optimizer hyperparameters and
                                           loss scaler, opt_param_scheduler, ...
        __<rank>_<k>.distcp, .metadata     PyTorch DCP files of every sharded tensor / object
        metadata.json                      written last: the directory is complete

Every rank describes its model chunks, optimizer state and RNG states with global keys
(`sharded_state_dict`), so the checkpoint loads at any TP / PP / VP / DP / EP size and with or
without the distributed optimizer, no conversion step (an MoE model's dense + expert optimizer
chain is matched to a single optimizer and back: checkpointing_dist_optimizer.py). RNG states
load when (TP, PP, EP) is unchanged; otherwise the run keeps its start-up seeding and says so.

Crash safety: files go into `iter_XXXXXXX/` (a leftover of a killed save there is removed
first; the tracker never names it), `metadata.json` is written after every rank's files are
complete, the tracker after that. With `--async-save` the files are written by a background
thread; the tracker moves at the first iteration after every rank finished (or at the next
save / the end of training / a SIGTERM exit, which wait). That thread first copies the saved
tensors to CPU while the next forward and backward run; every optimizer step (a torch optimizer
step pre-hook) and every load wait for that copy before they change the parameters.
"""

import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from megatron.core import dist_checkpointing
from megatron.core import parallel_state as mpu
from megatron.core.dist_checkpointing.dict_utils import extract_matching_values, nested_values
from megatron.core.dist_checkpointing.dtensor import is_empty_shard, shard_dtensor_entries
from megatron.core.dist_checkpointing.mapping import (
    ShardedObject,
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.optimizer import (
    DP_ZERO_GATHER_SCATTER,
    FULLY_SHARDED_MODEL_SPACE,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
from megatron.core.dist_checkpointing.strategies.defaults import (
    get_default_load_sharded_strategy,
)
from megatron.core.dist_checkpointing.strategies.fully_parallel import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
)
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.core.dist_checkpointing.validation import StrictHandling, parse_strict_flag
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.utils import uses_cuda
from megatron.training.checkpoint.checkpoint_args import (
    CHECKPOINT_VERSION,
    args_for_checkpoint,
    record_checkpoint_version,
    restore_training_args,
)
from megatron.training.checkpoint.checkpoint_layout import (
    _parse_tracker,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
)
from megatron.training.checkpoint.checkpoint_rng import get_rng_state, restore_rng_state
from megatron.training.checkpoint.checkpoint_tracker import (
    check_tracker_moves_forward,
    write_tracker_atomically,
)
from megatron.training.checkpoint.checkpointing_dist_optimizer import (
    adapt_loaded_state,
    match_optimizer_keys,
    stored_sub_optimizer_count,
    sub_optimizers,
)

_ASYNC_QUEUE = AsyncCallsQueue()
_STEP_HOOK = []  # the handle of the optimizer-step hook that waits for async staging
_SAVE_STRATEGY = {}


def print_rank_0(message: str) -> None:
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        print(message, flush=True)


def _is_rank_0() -> bool:
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def _barrier() -> None:
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


def is_dist_checkpoint_format(args) -> bool:
    """Whether saves use the torch_dist format (`--use-dist-ckpt` / `--ckpt-format torch_dist`)."""
    return getattr(args, 'ckpt_format', 'torch') == 'torch_dist' or bool(
        getattr(args, 'use_dist_ckpt', False)
    )


# ---------------------------------------------------------------------------------------------
# the state dict


def _sharded_rng_state(rng_state_list, with_expert_axis: Optional[bool] = None) -> ShardedObject:
    """The RNG states as one cell of the (pp, tp) grid, written by DP rank 0 (Megatron's).

    With expert parallelism the grid is (pp, tp, ep), written by expert-data-parallel rank 0:
    the expert-parallel ranks of one (pp, tp) position hold different expert RNG streams
    ('expert-parallel-rng' is seeded per expert-parallel rank), which a (pp, tp) cell would
    lose (Megatron r0.8 keeps the data-parallel rank 0's for all of them).
    """
    if with_expert_axis is None:
        with_expert_axis = mpu.get_expert_model_parallel_world_size() > 1
    shape = (
        mpu.get_pipeline_model_parallel_world_size(),
        mpu.get_tensor_model_parallel_world_size(),
    )
    offset = (mpu.get_pipeline_model_parallel_rank(), mpu.get_tensor_model_parallel_rank())
    replica_id = mpu.get_data_parallel_rank(with_context_parallel=True)
    if with_expert_axis:
        shape += (mpu.get_expert_model_parallel_world_size(),)
        offset += (mpu.get_expert_model_parallel_rank(),)
        replica_id = mpu.get_data_modulo_expert_parallel_rank(with_context_parallel=True)
    # `get_rng_state` returns copies (tuples, new tensors, cloned tracker states), so an
    # asynchronous save pickles them in its background writer (`snapshot`).
    return ShardedObject(
        'rng_state', rng_state_list, shape, offset, replica_id=replica_id, snapshot=True
    )


def _model_sharded_state_dicts(model) -> Dict[str, Any]:
    if len(model) == 1:
        return {'model': model[0].sharded_state_dict()}
    out = {}
    saved_vp_rank = mpu.get_virtual_pipeline_model_parallel_rank()
    for i, chunk in enumerate(model):
        mpu.set_virtual_pipeline_model_parallel_rank(i)
        out[f'model{i}'] = chunk.sharded_state_dict()
    mpu.set_virtual_pipeline_model_parallel_rank(saved_vp_rank)
    return out


def generate_sharded_state_dict(
    args,
    model,
    optimizer,
    opt_param_scheduler,
    rng_state,
    iteration: Optional[int],
    is_loading: bool = False,
    with_optimizer: bool = True,
    sharding_type: str = FULLY_SHARDED_MODEL_SPACE,
) -> Dict[str, Any]:
    """The sharded state dict of the whole training state (Megatron's `generate_state_dict`
    with `use_dist_ckpt=True`)."""
    state_dict = {'args': args_for_checkpoint(args), 'checkpoint_version': CHECKPOINT_VERSION}
    if iteration is not None:
        state_dict['iteration'] = iteration
    state_dict.update(_model_sharded_state_dicts(model))
    if with_optimizer:
        if optimizer is not None:
            kwargs = {}
            if _has_distributed_optimizer(optimizer):
                kwargs['sharding_type'] = sharding_type
            state_dict['optimizer'] = optimizer.sharded_state_dict(
                state_dict_models(state_dict), is_loading, **kwargs
            )
        if opt_param_scheduler is not None:
            state_dict['opt_param_scheduler'] = opt_param_scheduler.state_dict()
    if rng_state is not None:
        state_dict['rng_state'] = rng_state
    # FSDP2 parameters and their optimizer state are DTensors: each rank writes its rows only,
    # under the keys and global shapes a DDP / distributed-optimizer run uses.
    shard_dtensor_entries(state_dict)
    return state_dict


def state_dict_models(state_dict) -> Dict[str, Any]:
    return {k: v for k, v in state_dict.items() if k == 'model' or k.startswith('model')}


def _has_distributed_optimizer(optimizer) -> bool:
    chained = getattr(optimizer, 'chained_optimizers', None)
    if chained is not None:
        return any(isinstance(o, DistributedOptimizer) for o in chained)
    return isinstance(optimizer, DistributedOptimizer)


# ---------------------------------------------------------------------------------------------
# save


def _save_strategy(args):
    """The save strategy of this run, kept for the run's later saves (it caches plans and the
    DP distribution); a new run (new args, new process groups) gets a new one."""
    if _SAVE_STRATEGY.get('args') is not args:
        strategy = TorchDistSaveShardedStrategy(
            'torch_dist', 1, cached_metadata=args.ckpt_assume_constant_structure
        )
        if args.ckpt_fully_parallel_save:
            strategy = FullyParallelSaveStrategyWrapper(
                strategy,
                _dp_group_for_objects(),
                do_cache_distribution=args.ckpt_assume_constant_structure,
            )
        _SAVE_STRATEGY.update(args=args, strategy=strategy)
    return _SAVE_STRATEGY['strategy']


def _dp_group_for_objects():
    """The data-parallel group (with CP) for object collectives (gloo when it exists)."""
    try:
        return mpu.get_data_parallel_group_gloo(with_context_parallel=True)
    except Exception:
        return mpu.get_data_parallel_group(with_context_parallel=True)


def _prepare_directory(save_dir: str, iteration: int, checkpoint_dir: str) -> bool:
    """Rank 0 clears a leftover of a killed save; False when this iteration is saved already."""
    verdict = [None]
    if _is_rank_0():
        try:
            check_tracker_moves_forward(save_dir, iteration)
            tracker = get_checkpoint_tracker_filename(save_dir)
            named = _parse_tracker(tracker) if os.path.isfile(tracker) else None
            if named == (iteration, False) and os.path.isdir(checkpoint_dir):
                verdict = ['already saved']
            else:
                if os.path.isdir(checkpoint_dir):
                    print_rank_0(f'removing {checkpoint_dir}, left by an interrupted save')
                    shutil.rmtree(checkpoint_dir)
                os.makedirs(checkpoint_dir)
                verdict = ['ok']
        except Exception as exc:  # every rank must still get the verdict
            verdict = [f'error: {exc}']
    if torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(verdict, src=0)
    if verdict[0].startswith('error: '):
        raise ValueError(verdict[0][len('error: ') :])
    return verdict[0] == 'ok'


def save_dist_checkpoint(
    args, iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far
) -> None:
    """Save in torch_dist format (every rank). With `--async-save` the files are written in the
    background and the tracker moves once all ranks finished (see the module docstring)."""
    maybe_finalize_async_save(blocking=True)  # one pending save at a time, in order
    print_rank_0(
        f'saving checkpoint at iteration {iteration:7d} to {args.save} in torch_dist format'
    )
    rng_state = None if args.no_save_rng else _sharded_rng_state(get_rng_state())
    checkpoint_dir = get_checkpoint_name(args.save, iteration, return_base_dir=True)
    if not _prepare_directory(args.save, iteration, checkpoint_dir):
        print_rank_0(f'NOTE: iteration {iteration} is already saved in {checkpoint_dir}')
        return
    sharding_type = (
        FULLY_SHARDED_MODEL_SPACE if args.ckpt_fully_parallel_save else DP_ZERO_GATHER_SCATTER
    )
    if optimizer is not None and _has_distributed_optimizer(optimizer) and not args.no_save_optim:
        print_rank_0(f'Storing distributed optimizer sharded state of type {sharding_type}')
    state_dict = generate_sharded_state_dict(
        args,
        model,
        optimizer,
        opt_param_scheduler,
        rng_state,
        iteration,
        with_optimizer=not args.no_save_optim,
        sharding_type=sharding_type,
    )
    state_dict['num_floating_point_operations_so_far'] = num_floating_point_operations_so_far
    request = dist_checkpointing.save(
        state_dict, checkpoint_dir, _save_strategy(args), async_sharded_save=bool(args.async_save)
    )

    def announce():
        print_rank_0(
            f'  successfully saved checkpoint from iteration {iteration:7d} to {args.save} '
            f'[ t {mpu.get_tensor_model_parallel_world_size()}, '
            f'p {mpu.get_pipeline_model_parallel_world_size()} ]'
        )

    def move_tracker():
        if _is_rank_0():
            write_tracker_atomically(args.save, iteration)
        announce()
        _barrier()

    if args.async_save:
        # Rank 0 moves the tracker inside the request's finalization, after metadata.json;
        # the verdict broadcast that ends it lets the other ranks go on.
        request.add_coordinator_fn(lambda _results: write_tracker_atomically(args.save, iteration))
        request.add_finalize_fn(announce)
        _wait_for_staging_before_optimizer_steps()
        _ASYNC_QUEUE.schedule_async_request(request)
        print_rank_0(
            f'  scheduled an async checkpoint save at iteration {iteration:7d} to {args.save}'
        )
    else:  # the files and metadata.json are complete on every rank (save ends in a barrier)
        move_tracker()


def maybe_finalize_async_save(blocking: bool = False, announce: bool = False) -> None:
    """Finalize finished background saves (collective while one is pending; see async_utils).

    Every rank schedules the same saves, so every rank sees the same pending count."""
    if _ASYNC_QUEUE.get_num_unfinalized_calls() == 0:
        return
    if blocking and announce:
        print_rank_0('Unfinalized async checkpoint saves. Finalizing them synchronously now.')
    _ASYNC_QUEUE.maybe_finalize_async_calls(blocking)


def wait_for_async_staging() -> None:
    """Block until every pending background save holds its CPU snapshot (local, no
    collective): after it the saved parameters and optimizer state may change."""
    _ASYNC_QUEUE.wait_for_staging()


def _wait_for_staging_before_optimizer_steps() -> None:
    """Make every torch optimizer step (a parameter update, whoever calls it) wait for the
    snapshot of a pending background save; registered once per process."""
    if _STEP_HOOK:
        return

    def hook(_optimizer, _args, _kwargs):
        _ASYNC_QUEUE.wait_for_staging()

    _STEP_HOOK.append(register_optimizer_step_pre_hook(hook))


def async_writers_finished() -> bool:
    """Whether this rank's background checkpoint writers are done (local, no collective)."""
    return _ASYNC_QUEUE.writers_finished()


# ---------------------------------------------------------------------------------------------
# load


def find_dist_checkpoint_dir(load_dir: str, iteration: int, release: bool) -> Optional[str]:
    """The iteration directory if it is a distributed checkpoint, else None."""
    checkpoint_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    if dist_checkpointing.check_is_distributed_checkpoint(checkpoint_dir):
        return checkpoint_dir
    return None


def _ckpt_layout(ckpt_args) -> Tuple[int, ...]:
    """(TP, PP, EP) of the run that saved (EP 1 for checkpoints without experts)."""
    return (
        getattr(ckpt_args, 'tensor_model_parallel_size', 1),
        getattr(ckpt_args, 'pipeline_model_parallel_size', 1),
        getattr(ckpt_args, 'expert_model_parallel_size', 1) or 1,
    )


def _layout_names(ckpt_layout, run_layout):
    """Megatron's '(TP, PP)' wording, with EP when either side has expert parallelism."""
    if ckpt_layout[2] == 1 and run_layout[2] == 1:
        return '(TP, PP)', ckpt_layout[:2], run_layout[:2]
    return '(TP, PP, EP)', ckpt_layout, run_layout


def _optimizer_sharding_type(common: Dict) -> Optional[str]:
    opt = common.get('optimizer')
    if not isinstance(opt, dict):
        return None
    if 'param_state_sharding_type' in opt:
        return opt['param_state_sharding_type']
    for sub in opt.values():  # chained optimizers: {0: {...}, 1: {...}}
        if isinstance(sub, dict) and 'param_state_sharding_type' in sub:
            return sub['param_state_sharding_type']
    return None


def _load_plan(args, common, checkpoint_dir, release, optimizer) -> Dict[str, Any]:
    """What to request (optimizer, RNG) and with which optimizer sharding; one-line refusals for
    what cannot be resharded."""
    ckpt_args = common.get('args')
    ckpt_layout = _ckpt_layout(ckpt_args)
    run_layout = (
        args.tensor_model_parallel_size,
        args.pipeline_model_parallel_size,
        getattr(args, 'expert_model_parallel_size', 1) or 1,
    )
    names, ckpt_shown, run_shown = _layout_names(ckpt_layout, run_layout)
    layout_changed = ckpt_layout != run_layout
    fresh = release or args.finetune
    load_optim = (
        not fresh and not args.no_load_optim and not getattr(ckpt_args, 'no_save_optim', False)
    )
    load_rng = not fresh and not args.no_load_rng and not getattr(ckpt_args, 'no_save_rng', False)
    if load_rng and args.data_parallel_random_init:
        ckpt_dp = getattr(ckpt_args, 'data_parallel_size', args.data_parallel_size)
        layout_changed = layout_changed or ckpt_dp != args.data_parallel_size
    if load_rng and layout_changed:
        print_rank_0(
            f'NOTE: {names} mismatch after resume ({run_shown} vs {ckpt_shown} from '
            f'checkpoint): RNG state will be ignored; the RNGs keep their start-up seeding from '
            f'--seed {args.seed}'
        )
        load_rng = False
    sharding_type = _optimizer_sharding_type(common) or FULLY_SHARDED_MODEL_SPACE
    if load_optim and optimizer is not None and sharding_type == DP_ZERO_GATHER_SCATTER:
        stored_count = stored_sub_optimizer_count(common.get('optimizer'))
        if ckpt_layout != run_layout or stored_count != len(sub_optimizers(optimizer)):
            # dp_zero reshards across DP only
            raise ValueError(
                f'{names} mismatch after resume ({run_shown} vs {ckpt_shown} from checkpoint): '
                f'not supported for DistributedOptimizer with sharding type '
                f'dp_zero_gather_scatter (saved with --no-ckpt-fully-parallel-save); load with '
                f'--no-load-optim or at the saved {names}'
            )
        if not _has_distributed_optimizer(optimizer):
            # FSDP2 refuses --use-distributed-optimizer: only --no-load-optim is left to it.
            fsdp2 = getattr(args, 'use_torch_fsdp2', False)
            fix = '' if fsdp2 else ' or --use-distributed-optimizer'
            raise ValueError(
                f'{checkpoint_dir} holds distributed-optimizer state of type '
                f'dp_zero_gather_scatter, which only --use-distributed-optimizer can load; load '
                f'with --no-load-optim{fix}'
            )
    return dict(load_optim=load_optim, load_rng=load_rng, sharding_type=sharding_type)


def _rng_request(stored: set) -> ShardedObject:
    """This rank's RNG cell; a checkpoint of an expert-parallel run written by Megatron (a
    (pp, tp) grid) is read from its (pp, tp) cell."""
    request = _sharded_rng_state(get_rng_state())
    if request.unique_key not in stored and len(request.global_shape) == 3:
        fallback = _sharded_rng_state(request.data, with_expert_axis=False)
        if fallback.unique_key in stored:
            return fallback
    return request


def _drop_optional_absent(state_dict, stored: set) -> bool:
    """Drop requests the checkpoint may lack: empty `_extra_state` objects and the optimizer's
    fp32 main copies (then taken from the loaded weights). Returns whether fp32 copies were
    dropped."""
    dropped_fp32 = []

    def absent(x):
        if isinstance(x, ShardedObject):
            return x.key.endswith('_extra_state') and x.unique_key not in stored
        fp32_copy = isinstance(x, (ShardedTensor, ShardedTensorFactory)) and '.fp32_param.' in x.key
        if fp32_copy and x.key not in stored:
            dropped_fp32.append(x.key)
            return True
        return False

    _, kept = extract_matching_values(state_dict, absent)
    state_dict.clear()
    state_dict.update(kept)
    return bool(dropped_fp32)


def _complete_model_state_dict(module, loaded: Dict) -> Dict:
    """The loaded model dict plus the names it lacks: a second name of the same parameter (T5's
    output layer), empty `_extra_state` entries, and FSDP2 parameters of which this rank holds
    no rows (it requested nothing for them)."""
    current = module.state_dict(keep_vars=True)
    by_id = {id(current[k]): v for k, v in loaded.items() if k in current}
    complete = dict(loaded)
    for name, value in current.items():
        if name in complete:
            continue
        if name.endswith('_extra_state') or is_empty_shard(value):
            complete[name] = value
        elif id(value) in by_id:
            complete[name] = by_id[id(value)]
    return complete


def _is_stored(sh, stored: set) -> bool:
    """Whether the checkpoint holds `sh`: its key, or for a factory (a Mamba mixer's fused
    in_proj / conv1d split into named parts) any of the part keys it writes under its own."""
    if sh.key in stored:
        return True
    return isinstance(sh, ShardedTensorFactory) and any(k.startswith(sh.key) for k in stored)


def _refuse_absent_model_keys(state_dict, stored: set, checkpoint_dir: str) -> None:
    """A model tensor the checkpoint lacks would keep its initial value (a lenient
    --dist-ckpt-strictness drops it silently): refuse, naming the keys (local check, so every
    rank that requests such a key raises before the collective load)."""
    absent = sorted(
        {
            sh.key
            for sh in nested_values(state_dict_models(state_dict))
            if isinstance(sh, (ShardedTensor, ShardedTensorFactory)) and not _is_stored(sh, stored)
        }
    )
    if absent:
        shown = ', '.join(absent[:8]) + (f' and {len(absent) - 8} more' if len(absent) > 8 else '')
        raise ValueError(
            f'{checkpoint_dir} lacks {len(absent)} model tensor(s) this run has ({shown}): they '
            'would keep their initial values; load a checkpoint of the same model'
        )


def _load_strategy(args, checkpoint_dir):
    strategy = get_default_load_sharded_strategy(checkpoint_dir)
    if args.ckpt_fully_parallel_load:
        group = (
            mpu.get_data_parallel_group(with_context_parallel=True)
            if uses_cuda()
            else _dp_group_for_objects()
        )
        strategy = FullyParallelLoadStrategyWrapper(strategy, group)
    return strategy


def _dist_load(args, state_dict, checkpoint_dir) -> Dict:
    """dist_checkpointing.load with the run's strictness; `return_*` mismatches are printed."""
    strict = parse_strict_flag(args.dist_ckpt_strictness)
    loaded = dist_checkpointing.load(
        state_dict, checkpoint_dir, _load_strategy(args, checkpoint_dir), strict=strict
    )
    if StrictHandling.requires_returning_mismatch_keys(strict):
        loaded, missing, unexpected = loaded
        if missing or unexpected:
            print_rank_0(
                f'distributed checkpoint key mismatch: missing {missing}, unexpected {unexpected}'
            )
    return loaded


def load_dist_checkpoint(
    args, model, optimizer, opt_param_scheduler, load_dir, checkpoint_dir, release, strict=True
):
    """Load a torch_dist checkpoint into this run's layout (every rank).

    Returns:
        (iteration, num_floating_point_operations_so_far).
    """
    iteration_name = 'release' if release else 'iteration'
    common = dist_checkpointing.load_common_state_dict(checkpoint_dir)
    it = common.get('iteration', 0)
    print_rank_0(
        f' loading distributed checkpoint from {load_dir} at {iteration_name}'
        + ('' if release else f' {it}')
    )
    record_checkpoint_version(common, checkpoint_dir)
    iteration = 0 if (release or args.finetune) else it
    restore_training_args(args, common, checkpoint_dir, dist_format=True)
    plan = _load_plan(args, common, checkpoint_dir, release, optimizer)

    stored = get_default_load_sharded_strategy(checkpoint_dir).stored_keys(checkpoint_dir)
    rng = _rng_request(stored) if plan['load_rng'] else None
    state_dict = generate_sharded_state_dict(
        args,
        model,
        optimizer,
        opt_param_scheduler,
        rng,
        None,
        is_loading=True,
        with_optimizer=plan['load_optim'],
        sharding_type=plan['sharding_type'],
    )
    if plan['load_optim'] and optimizer is not None:
        match_optimizer_keys(state_dict['optimizer'], stored)
    no_fp32_copies = _drop_optional_absent(state_dict, stored)
    if strict or getattr(args, 'use_torch_fsdp2', False):
        _refuse_absent_model_keys(state_dict, stored, checkpoint_dir)
    loaded = _dist_load(args, state_dict, checkpoint_dir)

    _load_model_chunks(model, loaded, strict)
    if plan['load_optim']:
        if optimizer is not None:
            stored_count = stored_sub_optimizer_count(common.get('optimizer'))
            optimizer.load_sharded_state_dict(
                adapt_loaded_state(optimizer, loaded['optimizer'], stored_count)
            )
            if no_fp32_copies:
                optimizer.reload_model_params()
        if opt_param_scheduler is not None:
            opt_param_scheduler.load_state_dict(loaded['opt_param_scheduler'])
    elif (args.fp16 or args.bf16) and optimizer is not None:
        optimizer.reload_model_params()
    if plan['load_rng']:
        restore_rng_state(args, loaded['rng_state'], checkpoint_dir)
    _barrier()
    print_rank_0(
        f'  successfully loaded checkpoint from {load_dir} '
        f'[ t {mpu.get_tensor_model_parallel_rank()}, p {mpu.get_pipeline_model_parallel_rank()} ] '
        f'at iteration {iteration}'
    )
    return iteration, common.get('num_floating_point_operations_so_far', 0)


def _load_model_chunks(model: List, loaded: Dict, strict: bool) -> None:
    keys = ['model'] if len(model) == 1 else [f'model{i}' for i in range(len(model))]
    saved_vp_rank = mpu.get_virtual_pipeline_model_parallel_rank()
    for i, (key, chunk) in enumerate(zip(keys, model)):
        if len(model) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(i)
        chunk.load_state_dict(_complete_model_state_dict(chunk, loaded[key]), strict=strict)
    if len(model) > 1:
        mpu.set_virtual_pipeline_model_parallel_rank(saved_vp_rank)
