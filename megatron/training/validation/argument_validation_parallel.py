"""Rules of the parallel-layout flags (`_add_distributed_args` in `arguments_run.py`).

Model-parallel sizes against the world size, expert parallelism, the encoder-decoder pipeline split,
the communication backend, the interleaved (virtual) pipeline, the distributed optimizer's overlap
flags and sequence parallelism. Each step is called by `validate_args` in its order (the first
failing rule is the one reported) and derives what it checks (`data_parallel_size`,
`virtual_pipeline_model_parallel_size`, ...).
"""

from megatron.core.utils import uses_cuda
from megatron.training.run_control.errors import note
from megatron.training.validation.argument_validation_moe import validate_expert_parallel_size


def validate_parallel_sizes(args):
    """Check TP x PP x CP x EP against the world size; derive `data_parallel_size`."""
    _check_model_parallel_sizes(args)
    validate_expert_parallel_size(args)
    if args.rank == 0:
        print(
            'using world size: {}, data-parallel size: {}, context-parallel size: {} '
            'tensor-model-parallel size: {}, pipeline-model-parallel size: {} '.format(
                args.world_size,
                args.data_parallel_size,
                args.context_parallel_size,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
            ),
            flush=True,
        )
    _check_pipeline_split_rank(args)


def _check_model_parallel_sizes(args):
    if args.tensor_model_parallel_size < 1 or args.pipeline_model_parallel_size < 1:
        raise ValueError(
            f'--tensor-model-parallel-size ({args.tensor_model_parallel_size}) and '
            f'--pipeline-model-parallel-size ({args.pipeline_model_parallel_size}) must be >= 1'
        )
    if args.context_parallel_size < 1:
        raise ValueError(f'--context-parallel-size ({args.context_parallel_size}) must be >= 1')
    model_parallel_size = (
        args.tensor_model_parallel_size
        * args.pipeline_model_parallel_size
        * args.context_parallel_size
    )
    if args.world_size % model_parallel_size != 0:
        raise ValueError(
            f'world size ({args.world_size}) is not divisible by --tensor-model-parallel-size '
            f'({args.tensor_model_parallel_size}) x --pipeline-model-parallel-size '
            f'({args.pipeline_model_parallel_size}) x --context-parallel-size '
            f'({args.context_parallel_size}) = {model_parallel_size}'
        )
    args.data_parallel_size = args.world_size // model_parallel_size


def _check_pipeline_split_rank(args):
    if args.pipeline_model_parallel_split_rank is not None:
        if args.pipeline_model_parallel_size == 1:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) '
                'needs --pipeline-model-parallel-size > 1 (got 1)'
            )
        if args.pipeline_model_parallel_split_rank < 1:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) '
                'must be >= 1 (the stages before it hold the encoder)'
            )
        if args.pipeline_model_parallel_split_rank >= args.pipeline_model_parallel_size:
            raise ValueError(
                f'--pipeline-model-parallel-split-rank ({args.pipeline_model_parallel_split_rank}) '
                f'must be < --pipeline-model-parallel-size ({args.pipeline_model_parallel_size})'
            )


def select_distributed_backend(args):
    """nccl needs CUDA: without a GPU fall back to gloo (and say so)."""
    if args.distributed_backend == 'nccl' and not uses_cuda('nccl'):
        note(args, 'no CUDA device found: --distributed-backend nccl -> gloo')
        args.distributed_backend = 'gloo'


def validate_virtual_pipeline(args):
    """The interleaved schedule's layer split; derive `virtual_pipeline_model_parallel_size`."""
    if args.num_layers_per_virtual_pipeline_stage is not None:
        if args.pipeline_model_parallel_split_rank is not None:
            raise ValueError(
                '--num-layers-per-virtual-pipeline-stage: interleaved (virtual) pipelines are not '
                'supported for encoder-decoder models (--pipeline-model-parallel-split-rank '
                f'{args.pipeline_model_parallel_split_rank})'
            )
        if args.pipeline_model_parallel_size <= 1:
            raise ValueError(
                '--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1, '
                f'got {args.pipeline_model_parallel_size}'
            )
        if args.num_layers is None or args.num_layers % args.pipeline_model_parallel_size != 0:
            raise ValueError(
                f'--num-layers ({args.num_layers}) must be divisible by '
                f'--pipeline-model-parallel-size ({args.pipeline_model_parallel_size}) '
                'with the interleaved schedule'
            )
        layers_per_stage = args.num_layers // args.pipeline_model_parallel_size
        if layers_per_stage % args.num_layers_per_virtual_pipeline_stage != 0:
            raise ValueError(
                f'--num-layers ({args.num_layers}) / --pipeline-model-parallel-size '
                f'({args.pipeline_model_parallel_size}) = {layers_per_stage} layers per stage is '
                'not divisible by --num-layers-per-virtual-pipeline-stage '
                f'({args.num_layers_per_virtual_pipeline_stage})'
            )
        args.virtual_pipeline_model_parallel_size = (
            layers_per_stage // args.num_layers_per_virtual_pipeline_stage
        )
    else:
        args.virtual_pipeline_model_parallel_size = None
        # Overlapping p2p communication needs the interleaved schedule.
        args.overlap_p2p_comm = False


def validate_distributed_optimizer(args):
    """The distributed optimizer and its overlap flags."""
    if args.overlap_param_gather and not args.use_distributed_optimizer:
        raise ValueError('--overlap-param-gather requires --use-distributed-optimizer')
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        raise ValueError('--overlap-param-gather requires --overlap-grad-reduce')
    if args.use_distributed_optimizer and args.optimizer != 'adam' and args.optimizer != 'sgd':
        raise ValueError(f'--use-distributed-optimizer: unknown --optimizer {args.optimizer}')


def validate_sequence_parallel(args):
    """Sequence parallelism is only meaningful with tensor parallelism."""
    if args.tensor_model_parallel_size == 1 and args.sequence_parallel:
        note(
            args, '--sequence-parallel has no effect with --tensor-model-parallel-size 1; disabled'
        )
        args.sequence_parallel = False
    if args.tp_comm_overlap and not args.sequence_parallel:
        raise ValueError(
            '--tp-comm-overlap: tensor parallel communication/GEMM overlap can happen only when '
            'sequence parallelism is enabled (add --sequence-parallel, with '
            f'--tensor-model-parallel-size > 1; got {args.tensor_model_parallel_size})'
        )
    load_tp_comm_overlap_cfg(args)
    if args.sequence_parallel:
        args.async_tensor_model_parallel_allreduce = False


def load_tp_comm_overlap_cfg(args):
    """Read --tp-comm-overlap-cfg (YAML, Transformer Engine's ub_cfgs) into
    `args.tp_comm_overlap_ub_cfgs`, checked before any work starts."""
    path = args.tp_comm_overlap_cfg
    args.tp_comm_overlap_ub_cfgs = None
    if path is None:
        return
    if not args.tp_comm_overlap:
        raise ValueError(f'--tp-comm-overlap-cfg {path} needs --tp-comm-overlap')
    import yaml

    from megatron.core.tensor_parallel.comm_overlap_cfg import check_ub_cfgs

    try:
        with open(path) as stream:
            ub_cfgs = yaml.safe_load(stream)
    except OSError as error:
        raise ValueError(f'--tp-comm-overlap-cfg: cannot read {path}: {error.strerror}') from None
    except yaml.YAMLError as error:
        raise ValueError(f'--tp-comm-overlap-cfg: {path} is not valid YAML: {error}') from None
    check_ub_cfgs(ub_cfgs or {}, source=f'--tp-comm-overlap-cfg {path}')
    args.tp_comm_overlap_ub_cfgs = dict(ub_cfgs or {})
