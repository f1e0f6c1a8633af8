"""`initialize_megatron`: args, globals, torch.distributed, model-parallel groups, seeds, helpers.

torch.distributed is initialized from torchrun's environment (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT) with `--distributed-backend` (nccl on GPUs; validate_args falls back to
gloo when no GPU exists). An already-initialized default process group (tests, notebooks) is reused,
and so are already-initialized model-parallel groups when their sizes match the args.
"""

import logging
import os
import random
import time
from datetime import timedelta

import numpy as np
import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.utils import uses_cuda
from megatron.training.arguments import parse_args, validate_args
from megatron.training.global_vars import get_args, set_global_variables, set_wandb_writer
from megatron.training.logging.scalar_writers import build_wandb_writer
from megatron.training.run_control.startup_checks import check_output_directories
from megatron.training.run_control.watchdog import exit_when_launcher_dies


def _hierarchical_cp_sizes():
    """Sizes of the existing hierarchical context parallel groups (None if there are none)."""
    groups = mpu.get_hierarchical_context_parallel_groups(check_initialized=False)
    return None if groups is None else [group.size() for group in groups]


def initialize_megatron(
    extra_args_provider=None,
    args_defaults={},
    ignore_unknown_args=False,
    allow_no_cuda=True,
    skip_mpu_initialization=False,
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    args_list=None,
):
    """Set global variables, initialize distributed, set seeds, compile the dataset helpers.

    Args:
        extra_args_provider: callable(parser) adding script flags.
        args_defaults: script defaults applied to args left None (e.g. the tokenizer type).
        ignore_unknown_args: drop unknown flags instead of failing.
        allow_no_cuda: kept for API parity; CPU runs are always allowed here.
        skip_mpu_initialization: only set up args and globals (no torch.distributed).
        get_embedding_ranks, get_position_embedding_ranks: callables mapping a pipeline group's
            ranks to its (position) embedding group's ranks, passed to initialize_model_parallel
            (None: first and last stage / first stage, plus the split stage).
        args_list: argument strings to parse instead of sys.argv (tests, notebooks).
    """
    exit_when_launcher_dies()
    args = parse_args(extra_args_provider, ignore_unknown_args, args_list=args_list)
    if args.use_checkpoint_args or args_defaults.get('use_checkpoint_args', False):
        if args.load is None:
            raise ValueError('--use-checkpoint-args requires --load')
        from megatron.training.checkpointing import load_args_from_checkpoint

        _, checkpoint_args = load_args_from_checkpoint(args)
        if checkpoint_args is None:
            _refuse_missing_checkpoint_args(args)
    validate_args(args, args_defaults)
    check_output_directories(args)

    set_global_variables(args)
    set_wandb_writer(build_wandb_writer(args))
    setup_logging()

    if skip_mpu_initialization:
        return None

    def finish_mpu_init():
        if args.lazy_mpu_init:  # the groups give the real sizes and ranks from here on
            from megatron.core import parallel_state as mpu

            mpu.set_tensor_model_parallel_world_size(None)
            mpu.set_tensor_model_parallel_rank(None)
        _initialize_distributed(get_embedding_ranks, get_position_embedding_ranks)
        if args.rank == 0:
            print('> setting random seeds to {} ...'.format(args.seed), flush=True)
        _set_random_seed(args.seed, args.data_parallel_random_init)

    if args.lazy_mpu_init:
        # Megatron's --lazy-mpu-init: an outside manager starts torch.distributed, then calls
        # the returned function; until then only the tensor-parallel size and rank are known
        # and weights are initialized on the CPU.
        from megatron.core import parallel_state as mpu

        args.use_cpu_initialization = True
        mpu.set_tensor_model_parallel_world_size(args.tensor_model_parallel_size)
        mpu.set_tensor_model_parallel_rank(args.rank)
        return finish_mpu_init
    finish_mpu_init()
    _compile_dependencies()
    return None


def _refuse_missing_checkpoint_args(args) -> None:
    """--use-checkpoint-args found no checkpoint to take the model's shape from: say so, rather
    than "--num-layers is required" for the first flag it did not give."""
    missing = [
        '--' + name.replace('_', '-')
        for name in ('num_layers', 'hidden_size', 'num_attention_heads', 'max_position_embeddings')
        if getattr(args, name, None) is None
    ]
    if missing:
        raise ValueError(
            f'--use-checkpoint-args: no checkpoint in --load {args.load} (no '
            f'latest_checkpointed_iteration.txt there) to take {", ".join(missing)} from; check '
            f'the --load path, or give those flags'
        )


def setup_logging() -> None:
    """Set the root logging level: --logging-level, else $MEGATRON_LOGGING_LEVEL, else unchanged."""
    args = get_args()
    logging_level = None
    env_logging_level = os.getenv('MEGATRON_LOGGING_LEVEL', None)
    if env_logging_level is not None:
        logging_level = int(env_logging_level)
    if args.logging_level is not None:
        logging_level = args.logging_level
    if logging_level is not None:
        logging.getLogger(__name__).info(f'Setting logging level to {logging_level}')
        logging.getLogger().setLevel(logging_level)


def _compile_dependencies():
    """Build the dataset helpers on rank 0 (other ranks wait), when the C++ module is missing."""
    args = get_args()
    if torch.distributed.get_rank() == 0:
        start_time = time.time()
        print('> compiling dataset index builder ...', flush=True)
        from megatron.core.datasets.utils import compile_helpers

        compile_helpers()
        print(
            '>>> done with dataset index builder. Compilation time: {:.3f} seconds'.format(
                time.time() - start_time
            ),
            flush=True,
        )
    torch.distributed.barrier()
    del args


def _initialize_distributed(get_embedding_ranks=None, get_position_embedding_ranks=None):
    """Initialize torch.distributed (unless already done) and the model-parallel groups."""
    args = get_args()
    device_count = torch.cuda.device_count() if uses_cuda(args.distributed_backend) else 0
    if torch.distributed.is_initialized():
        if args.rank == 0:
            print(
                'torch distributed is already initialized, skipping initialization ...', flush=True
            )
        args.rank = torch.distributed.get_rank()
        args.world_size = torch.distributed.get_world_size()
    else:
        if args.rank == 0:
            print('> initializing torch distributed ...', flush=True)
        if device_count > 0:
            torch.cuda.set_device(args.local_rank % device_count)
        timeout = timedelta(minutes=args.distributed_timeout_minutes)
        torch.distributed.init_process_group(
            backend=args.distributed_backend,
            world_size=args.world_size,
            rank=args.rank,
            timeout=timeout,
            store=_per_attempt_store(args.world_size, timeout),
        )

    if mpu.model_parallel_is_initialized():
        have = (
            mpu.get_tensor_model_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size(),
            mpu.get_virtual_pipeline_model_parallel_world_size(),
            mpu.get_context_parallel_world_size(),
            _hierarchical_cp_sizes(),
            mpu.get_expert_model_parallel_world_size(),
        )
        want = (
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            args.context_parallel_size,
            args.hierarchical_context_parallel_sizes,
            args.expert_model_parallel_size,
        )
        if have != want:
            # Groups from an earlier run in this process: rebuild them for this run's sizes.
            mpu.destroy_model_parallel()
    if mpu.model_parallel_is_initialized():
        if args.rank == 0:
            print('model parallel is already initialized', flush=True)
    else:
        mpu.initialize_model_parallel(
            args.tensor_model_parallel_size,
            args.pipeline_model_parallel_size,
            args.virtual_pipeline_model_parallel_size,
            args.pipeline_model_parallel_split_rank,
            context_parallel_size=args.context_parallel_size,
            expert_model_parallel_size=args.expert_model_parallel_size,
            distributed_timeout_minutes=args.distributed_timeout_minutes,
            nccl_communicator_config_path=args.nccl_communicator_config_path,
            order='tp-cp-ep-dp-pp' if not args.use_tp_pp_dp_mapping else 'tp-pp-dp',
            get_embedding_ranks=get_embedding_ranks,
            get_position_embedding_ranks=get_position_embedding_ranks,
            hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
            num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        )
        if args.rank == 0:
            print(
                f'> initialized tensor model parallel with size '
                f'{mpu.get_tensor_model_parallel_world_size()}',
                flush=True,
            )
            print(
                f'> initialized pipeline model parallel with size '
                f'{mpu.get_pipeline_model_parallel_world_size()}',
                flush=True,
            )


def _per_attempt_store(world_size, timeout):
    """Under torchrun, the launcher's store with a prefix per restart attempt (None otherwise).

    torchrun keeps one store for all `--max-restarts` attempts; the process group of a restarted
    job would read the previous attempt's keys (the dead ranks' addresses) and fail to connect.
    """
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    store = torch.distributed.TCPStore(
        os.environ['MASTER_ADDR'],
        int(os.environ['MASTER_PORT']),
        world_size,
        is_master=False,
        timeout=timeout,
    )
    attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    return torch.distributed.PrefixStore(f'megatron/attempt_{attempt}', store)


def _set_random_seed(seed_, data_parallel_random_init=False):
    """Seed python, numpy, torch and the model-parallel RNG tracker.

    Each pipeline stage gets seed + 100 * pp_rank (and + 10 * dp_rank with
    --data-parallel-random-init), as Megatron does.
    """
    if seed_ is None or seed_ <= 0:
        raise ValueError(f'--seed must be a positive integer, got {seed_}')
    seed = seed_ + (100 * mpu.get_pipeline_model_parallel_rank())
    if data_parallel_random_init:
        seed = seed + (10 * mpu.get_data_parallel_rank())
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def write_args_to_tensorboard():
    """Write the args as text to TensorBoard."""
    from megatron.training.global_vars import get_tensorboard_writer

    args = get_args()
    writer = get_tensorboard_writer()
    if writer:
        for arg in vars(args):
            writer.add_text(arg, str(getattr(args, arg)), global_step=args.iteration)


def set_jit_fusion_options():
    """Nothing to set on CPU; kept for API parity with Megatron's entry points."""
    return None
