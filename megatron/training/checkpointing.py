"""Save and load training checkpoints in Megatron's "torch" (legacy) layout.

Layout under `--save` / `--load`::

    latest_checkpointed_iteration.txt       the iteration number (or "release"), no newline
    iter_0000500/
        mp_rank_00/model_optim_rng.pt        tensor-parallel rank 00, no pipeline parallelism
        mp_rank_01_003/model_optim_rng.pt    tp rank 01, pp rank 003 (pipeline size > 1)
        mp_rank_01_003_002/...               + expert-parallel rank 002 (expert parallel size > 1)
        .../distrib_optim_dp000.pt ...       --use-distributed-optimizer parameter state, one
                                             file per data-parallel rank (distrib_optim_shards.py;
                                             Megatron's single distrib_optim.pt still loads)

`model_optim_rng.pt` holds a dict with the keys `args` (an argparse.Namespace of plain values),
`checkpoint_version` (3.0), `iteration`, `model` (or `model0`, `model1`, ... with a virtual
pipeline), `optimizer`, `opt_param_scheduler`, `rng_state` and
`num_floating_point_operations_so_far`. Data-parallel rank 0 of each (tp, pp[, ep]) position writes
it; every rank restores the RNG states and, through the saved args, the consumed-sample counters the
data loader resumes from.

Crash safety: every file is written to a temporary name, flushed to disk and renamed into place;
all ranks then agree (a collective) that their files are complete, and only then does rank 0 replace
the tracker file (again temp + rename). A process killed at any point of a save therefore leaves the
tracker pointing at the previous, complete checkpoint.

Loading uses `torch.load(weights_only=True, mmap=True)`: tensors are memory-mapped, so a rank
reads only the pages it copies (only tensors, containers, numbers, strings, dtypes and
argparse.Namespace can be unpickled), checks the checkpoint's parallel layout and model shape
against the run, and names both values of every difference.

Directory and file names and the tracker file are in `checkpoint_layout.py`; its names are
re-exported here.
"""

import argparse
import glob
import os
import sys
import zipfile
from typing import Any, Dict, List, Optional

import torch

from megatron.core import parallel_state as mpu
from megatron.core.enums import ModelType
from megatron.core.utils import get_current_device, unwrap_model
from megatron.training.checkpoint import checkpointing_non_persistent, distrib_optim_shards
from megatron.training.cli.arguments_mamba import MAMBA_CHECKPOINT_ARGS
from megatron.training.cli.arguments_mla import ARCHITECTURE_CHECKPOINT_ARGS
from megatron.training.cli.arguments_vision import VLM_CHECKPOINT_ARGS
from megatron.training.global_vars import get_args
from megatron.training.validation.argument_validation_mamba import is_mamba_run

# isort: split
# Directory/file names live in checkpoint_layout.py, the tracker writes in checkpoint_tracker.py,
# the saved args and version in checkpoint_args.py, RNG states in checkpoint_rng.py; every name
# this module defined or imported before those splits stays importable from here (re-exported).
from typing import Tuple  # noqa: F401

from megatron.training.checkpoint.checkpoint_args import (  # noqa: F401
    CHECKPOINT_VERSION,
    _args_for_checkpoint,
    _is_plain,
    _layout_mismatch_message,
    args_for_checkpoint,
    check_checkpoint_args,
    get_checkpoint_version,
    record_checkpoint_version,
    restore_training_args,
    set_checkpoint_version,
)
from megatron.training.checkpoint.checkpoint_layout import (  # noqa: F401
    DISTRIB_OPTIM_BASENAME,
    MODEL_CHECKPOINT_BASENAME,
    TRACKER_FILENAME,
    _parse_tracker,
    check_single_layout,
    checkpoint_exists,
    ensure_directory_exists,
    find_checkpoint_rank_0,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
    get_distributed_optimizer_checkpoint_name,
    read_metadata,
)
from megatron.training.checkpoint.checkpoint_rng import (  # noqa: F401
    _np_state_from_checkpoint,
    _np_state_to_checkpoint,
    _set_rng_state,
    get_rng_state,
    restore_rng_state,
)
from megatron.training.checkpoint.checkpoint_tracker import (  # noqa: F401
    _check_tracker_moves_forward,
    _fsync_path,
    _write_tracker_atomically,
    check_tracker_moves_forward,
    fsync_path,
    write_tracker_atomically,
)
from megatron.training.checkpoint.checkpointing_dist import (  # noqa: F401
    maybe_finalize_async_save,
    wait_for_async_staging,
)

#: Classes `torch.load(weights_only=True)` may build besides tensors and plain containers.
SAFE_GLOBALS = [argparse.Namespace, ModelType]


def print_rank_0(message: str) -> None:
    """Print on global rank 0 only (on every process when torch.distributed is not initialized)."""
    if torch.distributed.is_initialized():
        if torch.distributed.get_rank() == 0:
            print(message, flush=True)
    else:
        print(message, flush=True)


# ---------------------------------------------------------------------------------------------
# saving


def generate_state_dict(
    args,
    model: List[torch.nn.Module],
    optimizer,
    opt_param_scheduler,
    rng_state: Optional[List[Dict[str, Any]]],
    use_dist_ckpt: bool = False,
    iteration: Optional[int] = None,
    optim_sd_kwargs: Optional[dict] = None,
) -> Dict[str, Any]:
    """The dict written to `model_optim_rng.pt` (model chunks already unwrapped)."""
    state_dict = {
        'args': _args_for_checkpoint(args),
        'checkpoint_version': CHECKPOINT_VERSION,
    }
    if iteration is not None:
        state_dict['iteration'] = iteration

    if len(model) == 1:
        state_dict['model'] = model[0].state_dict_for_save_checkpoint()
    else:
        saved_vp_rank = mpu.get_virtual_pipeline_model_parallel_rank()
        for i in range(len(model)):
            mpu.set_virtual_pipeline_model_parallel_rank(i)
            state_dict['model%d' % i] = model[i].state_dict_for_save_checkpoint()
        mpu.set_virtual_pipeline_model_parallel_rank(saved_vp_rank)

    if not args.no_save_optim:
        if optimizer is not None:
            state_dict['optimizer'] = optimizer.state_dict(**(optim_sd_kwargs or {}))
        if opt_param_scheduler is not None:
            state_dict['opt_param_scheduler'] = opt_param_scheduler.state_dict()

    if not args.no_save_rng and rng_state is not None:
        state_dict['rng_state'] = rng_state
    return state_dict


def _atomic_torch_save(obj: Any, filename: str) -> None:
    """torch.save to `<filename>.tmp.<pid>`, flush to disk, then rename onto `filename`.

    Readers see either the previous file or the complete new one, never a partial file.
    """
    tmp = f'{filename}.tmp.{os.getpid()}'
    try:
        with open(tmp, 'wb') as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, filename)
        _fsync_path(os.path.dirname(filename) or '.')
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def _remove_stale_temp_files(checkpoints_path: str, checkpoint_name: str) -> None:
    """Delete the temporary files a killed save left in this rank's folders (any iteration).

    Each writer cleans the `mp_rank_*` folder name it writes, so ranks never delete each other's
    files in flight; rank 0 also cleans the tracker's temporary files.
    """
    rank_folder = os.path.basename(os.path.dirname(checkpoint_name))
    patterns = [os.path.join(checkpoints_path, '*', rank_folder, '*.tmp*')]
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        patterns.append(get_checkpoint_tracker_filename(checkpoints_path) + '.tmp.*')
    for pattern in patterns:
        for path in glob.glob(pattern):
            print_rank_0(f'removing {path}, left by an interrupted save')
            os.remove(path)


def _agree_all_ranks_succeeded(ok: bool) -> List[int]:
    """A barrier that also tells every rank which ranks failed (empty list: none)."""
    if not torch.distributed.is_initialized():
        return [] if ok else [0]
    world_size = torch.distributed.get_world_size()
    flags = torch.zeros(world_size, dtype=torch.int32, device=get_current_device())
    flags[torch.distributed.get_rank()] = 0 if ok else 1
    torch.distributed.all_reduce(flags)
    return [rank for rank, failed in enumerate(flags.tolist()) if failed]


def _raise_if_any_rank_failed(
    error: Optional[BaseException], iteration: int, save_dir: str
) -> None:
    """Collective: raise on every rank if any rank failed its part of the save."""
    failed = _agree_all_ranks_succeeded(error is None)
    if not failed:
        return
    message = (
        f'saving checkpoint at iteration {iteration} to {save_dir} failed on rank(s) {failed}; '
        f'{TRACKER_FILENAME} was not updated'
    )
    if isinstance(error, ValueError):  # the user's to fix: keep it a one-line error
        raise ValueError(f'{message}: {error}') from error
    if error is not None:
        raise RuntimeError(f'{message}: {error!r}') from error
    raise RuntimeError(message)


def save_checkpoint(
    iteration: int,
    model,
    optimizer,
    opt_param_scheduler,
    num_floating_point_operations_so_far: float,
    checkpointing_context: Optional[dict] = None,
) -> None:
    """Save a checkpoint of iteration `iteration` into `args.save` (every rank must call it).

    Args:
        iteration: the number of completed training iterations.
        model: list of model chunks (possibly wrapped in DDP / Float16Module).
        optimizer: MegatronOptimizer or None. With `--use-distributed-optimizer` every
            data-parallel rank writes its own `distrib_optim_dp<rank>.pt` (no collective).
        opt_param_scheduler: OptimizerParamScheduler or None.
        num_floating_point_operations_so_far: stored for throughput accounting across restarts.
        checkpointing_context: accepted for Megatron signature parity (the torch_dist save
            strategy is kept per process instead).

    With `--use-dist-ckpt` / `--ckpt-format torch_dist` the torch_dist format is written
    (checkpointing_dist.py; `--async-save` writes it in the background).

    Raises:
        RuntimeError: on every rank if writing failed on any rank; the tracker file then still
            names the previous checkpoint.
    """
    args = get_args()
    model = unwrap_model(model if isinstance(model, list) else [model])
    from megatron.training.checkpoint import checkpointing_dist

    if checkpointing_dist.is_dist_checkpoint_format(args):
        checkpointing_dist.save_dist_checkpoint(
            args,
            iteration,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
        )
        return

    print_rank_0(f'saving checkpoint at iteration {iteration:7d} to {args.save} in torch format')

    # Collective (with --data-parallel-random-init): every rank takes part.
    rng_state = get_rng_state()
    checkpoint_name = get_checkpoint_name(args.save, iteration)
    is_writer = (
        not torch.distributed.is_initialized()
        or mpu.get_data_modulo_expert_parallel_rank(with_context_parallel=True) == 0
    )

    save_optim_state = (
        args.use_distributed_optimizer and not args.no_save_optim and optimizer is not None
    )
    dp_rank = mpu.get_data_parallel_rank(with_context_parallel=True)
    optim_checkpoint_name = distrib_optim_shards.shard_name(checkpoint_name, dp_rank)
    tmp_optim_name = optim_checkpoint_name + '.tmp'

    error = None
    try:
        _check_tracker_moves_forward(args.save, iteration)
        if is_writer:
            _remove_stale_temp_files(args.save, checkpoint_name)
    except Exception as exc:  # every rank must still reach the agreement below
        error = exc
    # Also a barrier: no rank writes its files before the stale ones are gone.
    _raise_if_any_rank_failed(error, iteration, args.save)
    try:
        if save_optim_state:
            ensure_directory_exists(optim_checkpoint_name)
            # Every DP rank writes its own shard (temporary name), in parallel, no gather.
            distrib_optim_shards.write_shard(
                optimizer,
                tmp_optim_name,
                dp_rank,
                mpu.get_data_parallel_world_size(with_context_parallel=True),
            )
        if is_writer:
            state_dict = generate_state_dict(
                args, model, optimizer, opt_param_scheduler, rng_state, iteration=iteration
            )
            state_dict['num_floating_point_operations_so_far'] = (
                num_floating_point_operations_so_far
            )
            ensure_directory_exists(checkpoint_name)
            _atomic_torch_save(state_dict, checkpoint_name)
    except Exception as exc:  # every rank must still reach the agreement below
        error = exc
    _raise_if_any_rank_failed(error, iteration, args.save)

    if save_optim_state:
        # The agreement above is also a barrier: every shard is complete on disk now. Each rank
        # moves its own into place.
        try:
            if os.path.exists(tmp_optim_name):
                os.replace(tmp_optim_name, optim_checkpoint_name)
                _fsync_path(os.path.dirname(optim_checkpoint_name))
        except Exception as exc:
            error = exc
        _raise_if_any_rank_failed(error, iteration, args.save)

    print_rank_0(
        f'  successfully saved checkpoint from iteration {iteration:7d} to {args.save} '
        f'[ t {mpu.get_tensor_model_parallel_world_size()}, '
        f'p {mpu.get_pipeline_model_parallel_world_size()} ]'
    )

    # All rank files are complete and on disk: only now does the new iteration become visible.
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        _write_tracker_atomically(args.save, iteration)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---------------------------------------------------------------------------------------------
# loading


def _torch_load(filename: str) -> Dict[str, Any]:
    """torch.load with weights_only=True (plus argparse.Namespace for the saved args).

    The file is memory-mapped (copy-on-write): tensors are read from the page cache as they are
    copied into the model, so the data-parallel replicas that load the same file share one read
    and a caller that needs only the args touches only the pickle.
    """
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        if not zipfile.is_zipfile(filename):  # legacy (pre-1.6) format: cannot be mapped
            return torch.load(filename, map_location='cpu', weights_only=True)
        return torch.load(filename, map_location='cpu', weights_only=True, mmap=True)


def _load_base_checkpoint(
    load_dir: str,
    rank0: bool = False,
    sharded_state_dict=None,
    exit_on_missing_checkpoint: bool = False,
    checkpoint_step: Optional[int] = None,
):
    """Read this rank's checkpoint file: (state_dict, checkpoint_name, release).

    Returns (None, "", False) when `load_dir` has no tracker file (unless
    `exit_on_missing_checkpoint`, which exits with an error message).

    Args:
        rank0: read the rank-0 file whatever the layout, without collectives (before
            torch.distributed is initialized: `--use-checkpoint-args`).
        checkpoint_step: load this iteration instead of the tracker's (`--ckpt-step`).
    """
    tracker_filename = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker_filename):
        if not rank0:
            print_rank_0(f'WARNING: could not find the metadata file {tracker_filename}')
            print_rank_0('    will not load any checkpoints and will start from random')
        if exit_on_missing_checkpoint:
            message = (
                f">> '--exit-on-missing-checkpoint' set and no checkpoint found in {load_dir} "
                f"(no {TRACKER_FILENAME}); exiting. <<"
            )
            print_rank_0(message)
            if torch.distributed.is_initialized() and not rank0:
                torch.distributed.barrier()
            sys.exit(message)
        return None, "", False

    if checkpoint_step is not None:
        iteration, release = checkpoint_step, False
    elif rank0:
        # No collective here: only some ranks (or none yet initialized) call with rank0=True.
        iteration, release = _parse_tracker(tracker_filename)
    else:
        iteration, release = read_metadata(tracker_filename)

    if rank0:
        from megatron.core import dist_checkpointing

        base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
        if dist_checkpointing.check_is_distributed_checkpoint(base_dir):
            return dist_checkpointing.load_common_state_dict(base_dir), base_dir, release
        checkpoint_name = find_checkpoint_rank_0(load_dir, iteration, release)
        if checkpoint_name is None:
            base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
            raise FileNotFoundError(f'no rank-0 checkpoint file under {base_dir}')
    else:
        checkpoint_name = get_checkpoint_name(load_dir, iteration, release)
        if not os.path.isfile(checkpoint_name):
            _raise_missing_rank_file(load_dir, iteration, release, checkpoint_name)

    if not rank0:
        print_rank_0(f' loading checkpoint from {load_dir} at iteration {iteration}')
    try:
        state_dict = _torch_load(checkpoint_name)
    except Exception as exc:
        # Truncated, corrupt, or holding objects other than tensors and plain data (a planted
        # pickle would run code on a plain torch.load): the file is refused, never executed.
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reason = next(
            (line for line in lines if 'GLOBAL' in line or 'global' in line),
            lines[0] if lines else type(exc).__name__,
        )
        raise ValueError(
            f'checkpoint file {checkpoint_name} cannot be loaded as weights only (tensors and '
            f'plain data): {reason}'
        ) from exc
    # Rank folders of two layouts in one iteration: the files of this rank may be another model's.
    check_single_layout(os.path.dirname(os.path.dirname(checkpoint_name)), state_dict.get('args'))
    return state_dict, checkpoint_name, release


def _raise_missing_rank_file(load_dir, iteration, release, checkpoint_name):
    """This rank's file is absent: explain with the layout the checkpoint does have."""
    base_dir = get_checkpoint_name(load_dir, iteration, release, return_base_dir=True)
    rank0_name = find_checkpoint_rank_0(load_dir, iteration, release)
    if rank0_name is not None:
        checkpoint_args = _torch_load(rank0_name).get('args')
        if checkpoint_args is not None:
            message = _layout_mismatch_message(checkpoint_args, base_dir)
            if message is not None:
                raise ValueError(message)
    present = sorted(os.listdir(base_dir)) if os.path.isdir(base_dir) else []
    raise FileNotFoundError(
        f'checkpoint file {checkpoint_name} not found (the checkpoint directory holds {present}); '
        f'the iteration directory is incomplete or was written with a different parallel layout'
    )


def _check_model_state_dict(module, model_state_dict, key: str, checkpoint_name: str, strict: bool):
    """Compare parameter names and shapes before copying, naming both sides of every difference."""
    expected = module.state_dict_for_save_checkpoint()
    lines = []
    for name, tensor in expected.items():
        if name not in model_state_dict:
            if strict and isinstance(tensor, torch.Tensor):
                lines.append(
                    f'{name}: missing from the checkpoint (model shape {list(tensor.shape)})'
                )
            continue
        saved = model_state_dict[name]
        if isinstance(tensor, torch.Tensor) and isinstance(saved, torch.Tensor):
            if tuple(saved.shape) != tuple(tensor.shape):
                lines.append(
                    f'{name}: shape in checkpoint {list(saved.shape)} != '
                    f'shape in model {list(tensor.shape)}'
                )
    if strict:
        for name in model_state_dict:
            if name not in expected:
                lines.append(f'{name}: in the checkpoint but not in the model')
    if lines:
        raise ValueError(
            f"checkpoint {checkpoint_name} ['{key}'] does not match the model "
            f"(tensor-parallel rank {mpu.get_tensor_model_parallel_rank()}, pipeline rank "
            f"{mpu.get_pipeline_model_parallel_rank()}):\n  " + '\n  '.join(lines)
        )


def _take_recorded_tokenizer_files(args, checkpoint_args) -> None:
    """The tokenizer files a converted checkpoint records (tokenizer_model, vocab_file,
    merge_file) for flags the user left unset, when the run uses the checkpoint's tokenizer type
    and the files still exist."""
    if getattr(args, 'tokenizer_type', None) != getattr(checkpoint_args, 'tokenizer_type', None):
        return
    for name in ('tokenizer_model', 'vocab_file', 'merge_file'):
        recorded = getattr(checkpoint_args, name, None)
        if getattr(args, name, None) is None and recorded and os.path.exists(recorded):
            print_rank_0(f'Setting {name} to {recorded} from checkpoint')
            setattr(args, name, recorded)


def load_args_from_checkpoint(
    args, load_arg: str = 'load', exit_on_missing_checkpoint: bool = False
):
    """Copy the model-defining args of the checkpoint in `args.<load_arg>` into `args`.

    Used by `--use-checkpoint-args` before the model is built (no collectives). Args that are
    still None take the checkpoint's value; those marked force=True always do.

    Returns:
        (args, checkpoint_args) with checkpoint_args None when there was nothing to read.
    """
    load_dir = getattr(args, load_arg)
    if load_dir is None:
        print_rank_0('No load directory specified, using provided arguments.')
        return args, None

    state_dict, checkpoint_name, release = _load_base_checkpoint(
        load_dir,
        rank0=True,
        exit_on_missing_checkpoint=exit_on_missing_checkpoint,
        checkpoint_step=getattr(args, 'ckpt_step', None),
    )
    if not state_dict:
        print_rank_0('Checkpoint not found to provide arguments, using provided arguments.')
        return args, None
    if 'args' not in state_dict:
        print_rank_0('Checkpoint provided does not have arguments saved, using provided arguments.')
        return args, state_dict

    checkpoint_args = state_dict['args']
    checkpoint_version = state_dict.get('checkpoint_version', 0)
    args.iteration = state_dict.get('iteration', state_dict.get('total_iters', 0))

    # One-off conversion for foundation models.
    if hasattr(checkpoint_args, 'disable_bias_linear'):
        checkpoint_args.add_bias_linear = not checkpoint_args.disable_bias_linear

    def _set_arg(arg_name, old_arg_name=None, force=False):
        if not force and getattr(args, arg_name, None) is not None:
            return
        checkpoint_value = getattr(checkpoint_args, old_arg_name or arg_name, None)
        if checkpoint_value is not None:
            print_rank_0(f'Setting {arg_name} to {checkpoint_value} from checkpoint')
            setattr(args, arg_name, checkpoint_value)
        else:
            print_rank_0(f'Checkpoint did not provide arguments {arg_name}')

    for name in (
        'num_layers',
        'hidden_size',
        'ffn_hidden_size',
        'seq_length',
        'num_attention_heads',
    ):
        _set_arg(name)
    for name in ('num_query_groups', 'group_query_attention'):
        _set_arg(name, force=True)
    _set_arg('kv_channels')
    _set_arg('max_position_embeddings')
    if getattr(checkpoint_args, 'decoder_seq_length', None) is not None:
        # A T5's decoder (Megatron does not carry these: a T5 needed them on the command line).
        _set_arg('decoder_num_layers')
        _set_arg('decoder_seq_length')
    for name in (
        'position_embedding_type',
        'add_position_embedding',
        'use_rotary_position_embeddings',
        'rotary_percent',
        'rotary_interleaved',
        'add_bias_linear',
        'add_qkv_bias',
        'swiglu',
        'untie_embeddings_and_output_weights',
        'apply_layernorm_1p',
        'normalization',
        # Not carried by Megatron: without them a converted Llama-3 (RoPE base 500000), an
        # RMSNorm eps other than 1e-5 or GPT-2's tanh GeLU would silently change the model.
        'rotary_base',
        'norm_epsilon',
        'openai_gelu',
        *ARCHITECTURE_CHECKPOINT_ARGS,
    ):
        _set_arg(name, force=True)
    if getattr(checkpoint_args, 'num_experts', None):
        from megatron.training.validation.argument_validation_moe import MOE_CHECKPOINT_ARGS

        for name in MOE_CHECKPOINT_ARGS:
            _set_arg(name, force=True)
    if is_mamba_run(checkpoint_args):
        args.is_hybrid_model = True
        for name in MAMBA_CHECKPOINT_ARGS[1:]:
            _set_arg(name, force=True)
    if hasattr(checkpoint_args, 'drop_vision_class_token'):
        for name in VLM_CHECKPOINT_ARGS:
            _set_arg(name, force=True)
    _set_arg('tokenizer_type')
    _take_recorded_tokenizer_files(args, checkpoint_args)
    _set_arg('padded_vocab_size')
    _set_arg('apply_query_key_layer_scaling', force=True)
    if checkpoint_version < 3.0:
        _set_arg('tensor_model_parallel_size', 'model_parallel_size')
    else:
        _set_arg('tensor_model_parallel_size', force=True)
        _set_arg('pipeline_model_parallel_size', force=True)
        _set_arg('virtual_pipeline_model_parallel_size', force=True)
        _set_arg('num_layers_per_virtual_pipeline_stage')
        if getattr(checkpoint_args, 'pipeline_model_parallel_split_rank', None) is not None:
            # A T5's pipeline split goes with its pipeline size (which stage holds which stack).
            _set_arg('pipeline_model_parallel_split_rank', force=True)
    return args, checkpoint_args


def _resolve_load_dir(args, load_arg: str) -> str:
    """`args.<load_arg>`, or `--pretrained-checkpoint` (then finetuning) when it has none yet."""
    load_dir = getattr(args, load_arg)
    pretrained_dir = getattr(args, 'pretrained_checkpoint', None)
    if pretrained_dir is None or checkpoint_exists(load_dir):
        return load_dir
    print_rank_0(
        f'Checkpoint file not found in load directory {load_dir}; attempting to finetune with '
        f'the checkpoint in {pretrained_dir}'
    )
    if not checkpoint_exists(pretrained_dir):
        raise FileNotFoundError(
            f'no checkpoint ({TRACKER_FILENAME}) in --load ({load_dir}) or '
            f'--pretrained-checkpoint ({pretrained_dir})'
        )
    args.finetune = True
    return pretrained_dir


def _find_dist_checkpoint(args, load_dir: str):
    """(directory, release) of a torch_dist checkpoint the tracker names, else (None, False).

    Collective when a tracker file exists (the iteration is agreed over all ranks).
    """
    from megatron.training.checkpoint import checkpointing_dist

    tracker = get_checkpoint_tracker_filename(load_dir) if load_dir else None
    if tracker is None or not os.path.isfile(tracker):
        return None, False
    if args.ckpt_step is not None:
        iteration, release = args.ckpt_step, False
    else:
        iteration, release = read_metadata(tracker)
    return checkpointing_dist.find_dist_checkpoint_dir(load_dir, iteration, release), release


def _read_iteration(args, state_dict, checkpoint_name: str, release: bool):
    """(iteration, num_floating_point_operations_so_far); iteration 0 for finetune / release."""
    if args.finetune or release:
        iteration = 0
    else:
        iteration = state_dict.get('iteration', state_dict.get('total_iters'))
        if iteration is None:
            raise ValueError(f'{checkpoint_name} holds neither "iteration" nor "total_iters"')
    return iteration, state_dict.get('num_floating_point_operations_so_far', 0)


def _load_model_chunks(model, state_dict, checkpoint_name: str, strict: bool) -> None:
    """Check names and shapes of every chunk (naming both sides), then copy them in."""
    keys = ['model'] if len(model) == 1 else ['model%d' % i for i in range(len(model))]
    saved_chunks = sorted(
        k for k in state_dict if k == 'model' or (k.startswith('model') and k[5:].isdigit())
    )
    if saved_chunks != sorted(keys):
        raise ValueError(
            f'{checkpoint_name} holds model chunks {saved_chunks} but this run has {len(model)} '
            f'chunk(s) per rank (expects {keys}): --virtual-pipeline-model-parallel-size differs'
        )
    for key, module in zip(keys, model):
        _check_model_state_dict(module, state_dict[key], key, checkpoint_name, strict)
    saved_vp_rank = mpu.get_virtual_pipeline_model_parallel_rank()
    for i, (key, module) in enumerate(zip(keys, model)):
        if len(model) > 1:
            mpu.set_virtual_pipeline_model_parallel_rank(i)
        module.load_state_dict(state_dict[key], strict=strict)
    if len(model) > 1:
        mpu.set_virtual_pipeline_model_parallel_rank(saved_vp_rank)
    print_rank_0(f' checkpoint version {get_checkpoint_version()}')


def _load_optimizer_and_scheduler(
    args, optimizer, opt_param_scheduler, state_dict, checkpoint_name: str, release: bool
) -> None:
    """Optimizer (with the distributed optimizer's per-rank files) and scheduler state."""
    if release or args.finetune or args.no_load_optim:
        if (args.fp16 or args.bf16) and optimizer is not None:
            optimizer.reload_model_params()
        return
    try:
        if optimizer is not None:
            optimizer.load_state_dict(state_dict['optimizer'])
            if args.use_distributed_optimizer and mpu.get_expert_model_parallel_world_size() > 1:
                shards = distrib_optim_shards.load_expert_parallel_shards(
                    checkpoint_name,
                    _torch_load,
                    mpu.get_expert_model_parallel_world_size(),
                    mpu.get_expert_model_parallel_rank(),
                )
                if shards is None:
                    raise KeyError(distrib_optim_shards.shard_name(checkpoint_name, 0))
                optimizer.load_parameter_state_from_shards(shards[0], shards)
            elif args.use_distributed_optimizer:
                shards = distrib_optim_shards.load_shards(checkpoint_name, _torch_load)
                if shards is not None:
                    optimizer.load_parameter_state_from_shards(shards)
                else:  # Megatron's legacy single file
                    optim_name = get_distributed_optimizer_checkpoint_name(checkpoint_name)
                    if not os.path.isfile(optim_name):
                        raise KeyError(optim_name)
                    optimizer.load_parameter_state(optim_name)
        if opt_param_scheduler is not None:
            if 'lr_scheduler' in state_dict:  # backward compatibility
                opt_param_scheduler.load_state_dict(state_dict['lr_scheduler'])
            else:
                opt_param_scheduler.load_state_dict(state_dict['opt_param_scheduler'])
    except KeyError as exc:
        raise ValueError(
            f'Unable to load optimizer from checkpoint {checkpoint_name} (missing {exc}). '
            f'Specify --no-load-optim or --finetune to prevent attempting to load the '
            f'optimizer state.'
        ) from exc


def load_checkpoint(
    model, optimizer, opt_param_scheduler, load_arg: str = 'load', strict: bool = True
):
    """Load the latest (or `--ckpt-step`) checkpoint of `args.<load_arg>` into model, optimizer,
    scheduler and RNGs (every rank must call it). The format (torch or torch_dist) is detected
    from what the directory holds; a torch_dist checkpoint loads at any parallel layout.

    Unless `--finetune` (or a release checkpoint), also restores `args.consumed_train_samples` /
    `args.consumed_valid_samples` so the data loader continues with the next sample.

    Returns:
        (iteration, num_floating_point_operations_so_far); (0, 0) when there is no checkpoint.

    Raises:
        ValueError: the checkpoint's parallel layout (torch format), model args or tensor shapes
            differ from the run (every difference named with both values), or optimizer / RNG
            state requested but absent from the checkpoint.
    """
    args = get_args()
    wait_for_async_staging()  # loading overwrites what a pending save may still be copying
    model = unwrap_model(model if isinstance(model, list) else [model])
    load_dir = _resolve_load_dir(args, load_arg)
    if load_arg == 'load':  # the newest valid of the persistent and non-persistent checkpoints
        load_dir = checkpointing_non_persistent.choose_load_dir(args, load_dir)

    dist_dir, release = _find_dist_checkpoint(args, load_dir)
    if dist_dir is not None:
        from megatron.training.checkpoint import checkpointing_dist

        return checkpointing_dist.load_dist_checkpoint(
            args, model, optimizer, opt_param_scheduler, load_dir, dist_dir, release, strict
        )

    state_dict, checkpoint_name, release = _load_base_checkpoint(
        load_dir,
        rank0=False,
        exit_on_missing_checkpoint=args.exit_on_missing_checkpoint,
        checkpoint_step=args.ckpt_step,
    )
    if state_dict is None:
        return 0, 0
    if getattr(args, 'use_torch_fsdp2', False):
        raise ValueError(
            f'--use-torch-fsdp2: {checkpoint_name} is a legacy torch-format checkpoint, which '
            'FSDP2-sharded models cannot load; save it with --ckpt-format torch_dist'
        )
    record_checkpoint_version(state_dict, checkpoint_name)
    iteration, num_floating_point_operations_so_far = _read_iteration(
        args, state_dict, checkpoint_name, release
    )
    restore_training_args(args, state_dict, checkpoint_name)
    _load_model_chunks(model, state_dict, checkpoint_name, strict)
    _load_optimizer_and_scheduler(
        args, optimizer, opt_param_scheduler, state_dict, checkpoint_name, release
    )
    if not release and not args.finetune and not args.no_load_rng:
        if 'rng_state' not in state_dict:
            raise ValueError(
                f'Unable to load rng state from checkpoint {checkpoint_name} (missing '
                f"'rng_state'). Specify --no-load-rng or --finetune to prevent attempting to "
                f'load the rng state.'
            )
        restore_rng_state(args, state_dict['rng_state'], checkpoint_name)

    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    print_rank_0(
        f'  successfully loaded checkpoint from {load_dir} '
        f'[ t {mpu.get_tensor_model_parallel_rank()}, p {mpu.get_pipeline_model_parallel_rank()} ] '
        f'at iteration {iteration}'
    )
    return iteration, num_floating_point_operations_so_far
