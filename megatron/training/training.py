"""Pretraining driver: `pretrain()` and the pieces it orchestrates.

pretrain
  initialize_megatron -> setup_model_and_optimizer (get_model, optimizer, scheduler, load)
  -> build_train_valid_test_data_iterators -> train (train_step via get_forward_backward_func,
  training_log, evaluate_and_print_results, save/exit) -> final validation and test evaluation.

The log line lives in `training_log.py`, evaluation in `evaluation.py`, the data loaders and
iterators in `data_loaders.py` and the run's wall clock (--exit-duration-in-mins) in
`time_limit.py`; their names stay importable from this module. Checkpoint I/O lives in
`checkpointing.py` and is imported only when --save/--load ask for it.
"""

import dataclasses
import gc
import sys
import time

import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.utils import StragglerDetector, get_current_device, get_model_config
from megatron.training.checkpoint import checkpointing_non_persistent
from megatron.training.datasets.data_loaders import build_train_valid_test_data_iterators
from megatron.training.global_vars import (
    get_args,
    get_signal_handler,
    get_tensorboard_writer,
    get_timers,
)
from megatron.training.initialize import (
    initialize_megatron,
    set_jit_fusion_options,
    write_args_to_tensorboard,
)
from megatron.training.logging.profiling import IterationProfiler
from megatron.training.logging.progress_log import compute_throughputs_and_append_to_progress_log
from megatron.training.logging.scalar_writers import finish_wandb
from megatron.training.logging.training_log import training_log
from megatron.training.loop.evaluation import evaluate, evaluate_and_print_results
from megatron.training.run_control import rerun_training
from megatron.training.run_control.time_limit import (
    _exit_flag,
    get_train_start_time,
    set_train_start_time,
)
from megatron.training.run_control.watchdog import progress, start_watchdog, stop_watchdog, watch
from megatron.training.utils import (
    append_to_progress_log,
    calc_params_l2_norm,
    check_weight_hashes,
    configure_straggler_detector,
    empty_unused_memory,
    num_floating_point_operations,
    print_datetime,
    print_rank_0,
    print_rank_last,
    unwrap_model,
)
from megatron.training.validation.argument_validation import validate_encoder_decoder_args

# isort: split
# Names this module defined or imported before the log line, evaluation and data loading moved
# out; re-exported so that `from megatron.training.training import ...` keeps working.
import math  # noqa: F401
from datetime import datetime  # noqa: F401

from megatron.core.utils import uses_cuda  # noqa: F401
from megatron.training.datasets.data_loaders import (  # noqa: F401
    _check_training_data,
    build_train_valid_test_data_loaders,
    build_train_valid_test_datasets,
    cyclic_iter,
    get_train_valid_test_num_samples,
)
from megatron.training.logging.training_log import (  # noqa: F401
    _TIMERS_TO_LOG,
    _format_tflops,
    format_log_line,
)
from megatron.training.loop.evaluation import format_validation_line  # noqa: F401
from megatron.training.loop.step_results import (  # noqa: F401
    _call_model_hook,
    reduce_losses_over_microbatches,
)
from megatron.training.theoretical_memory_usage import report_theoretical_memory  # noqa: F401
from megatron.training.utils import report_memory  # noqa: F401

# The process-wide straggler detector (a singleton: the script's `stimer` is this object).
stimer = StragglerDetector()

__all__ = [
    'pretrain',
    'get_model',
    'setup_model_and_optimizer',
    'train_step',
    'train',
    'evaluate',
    'evaluate_and_print_results',
    'training_log',
    'build_train_valid_test_data_iterators',
    'get_optimizer_param_scheduler',
    'num_floating_point_operations',
]


def __getattr__(name):
    """`_TRAIN_START_TIME` now lives in time_limit.py; read from here, it is the current value."""
    if name == '_TRAIN_START_TIME':
        return get_train_start_time()
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


def _checkpointing():
    """The checkpointing module (H7); imported on first use so training runs without it."""
    try:
        from megatron.training import checkpointing
    except ImportError as exc:
        raise RuntimeError(
            '--save/--load need megatron/training/checkpointing.py, which failed to import: '
            + str(exc)
        ) from exc
    return checkpointing


def pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    args_list=None,
):
    """Main training program.

    Args:
        train_valid_test_dataset_provider: callable([train, valid, test] sample counts) -> datasets.
        model_provider: callable(pre_process=True, post_process=True) -> the model of this stage.
        model_type: ModelType of the model.
        forward_step_func: callable(data_iterator, model) -> (output_tensor, loss_func).
        process_non_loss_data_func: optional hook for non-loss evaluation outputs.
        extra_args_provider: callable(parser) adding script flags.
        args_defaults: defaults for args left None (e.g. {'tokenizer_type': 'GPT2BPETokenizer'}).
        args_list: argument strings to parse instead of sys.argv (tests, notebooks).

    Returns:
        dict with 'iteration', 'train_losses' ({iteration: {key: float}} on the last rank),
        'valid_losses' and 'test_losses' (final evaluation; {key: float} on the last rank).
    """
    try:
        return _pretrain(
            train_valid_test_dataset_provider,
            model_provider,
            model_type,
            forward_step_func,
            process_non_loss_data_func,
            extra_args_provider,
            args_defaults,
            get_embedding_ranks,
            get_position_embedding_ranks,
            args_list,
        )
    finally:
        # Also when training raised: a watchdog left running would later stop this process.
        stop_watchdog()


def _pretrain(
    train_valid_test_dataset_provider,
    model_provider,
    model_type,
    forward_step_func,
    process_non_loss_data_func=None,
    extra_args_provider=None,
    args_defaults={},
    get_embedding_ranks=None,
    get_position_embedding_ranks=None,
    args_list=None,
):
    """pretrain() itself; the wrapper stops the watchdog however this returns."""
    initialize_megatron(
        extra_args_provider=extra_args_provider,
        args_defaults=args_defaults,
        get_embedding_ranks=get_embedding_ranks,
        get_position_embedding_ranks=get_position_embedding_ranks,
        args_list=args_list,
    )
    args = get_args()
    if model_type == ModelType.encoder_and_decoder:
        validate_encoder_decoder_args(args)
    timers = get_timers()
    set_jit_fusion_options()
    rerun_training.initialize_rerun_state_machine_from_args(args)
    start_watchdog(args.watchdog_timeout)

    # Adjust the startup time so it reflects the largest value across ranks.
    global _LAST_SAVED_ITERATION
    _LAST_SAVED_ITERATION = None  # a process may run pretrain() more than once (tests)
    start_time_tensor = torch.tensor(
        [get_train_start_time()], dtype=torch.double, device=get_current_device()
    )
    torch.distributed.all_reduce(start_time_tensor, op=torch.distributed.ReduceOp.MIN)
    set_train_start_time(start_time_tensor.item())
    if args.log_progress:
        append_to_progress_log('Starting job')
    print_rank_0(
        'time to initialize megatron (seconds): {:.3f}'.format(time.time() - get_train_start_time())
    )
    print_datetime('after megatron is initialized')

    # Model, optimizer, and learning rate.
    timers('model-and-optimizer-setup', log_level=0).start(barrier=True)
    scale_lr_cond, lr_mult = head_lr_scaling(args)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
        model_provider, model_type, scale_lr_cond=scale_lr_cond, lr_mult=lr_mult
    )
    timers('model-and-optimizer-setup').stop()
    print_datetime('after model, optimizer, and learning rate scheduler are built')
    write_args_to_tensorboard()
    config = get_model_config(model[0])

    # Data stuff.
    timers('train/valid/test-data-iterators-setup', log_level=0).start(barrier=True)
    if args.virtual_pipeline_model_parallel_size is not None:
        train_data_iterator, valid_data_iterator, test_data_iterator = [], [], []
        for i in range(len(model)):
            mpu.set_virtual_pipeline_model_parallel_rank(i)
            iterators = build_train_valid_test_data_iterators(train_valid_test_dataset_provider)
            train_data_iterator.append(iterators[0])
            valid_data_iterator.append(iterators[1])
            test_data_iterator.append(iterators[2])
        mpu.set_virtual_pipeline_model_parallel_rank(0)
    else:
        train_data_iterator, valid_data_iterator, test_data_iterator = (
            build_train_valid_test_data_iterators(train_valid_test_dataset_provider)
        )
    timers('train/valid/test-data-iterators-setup').stop()
    if rerun_training.rerun_mode(args) != rerun_training.RerunMode.DISABLED:
        train_data_iterator = rerun_training.wrap_train_data_iterators(train_data_iterator)
    print_datetime('after dataloaders are built')

    print_rank_0('done with setup ...')
    timers.log(['model-and-optimizer-setup', 'train/valid/test-data-iterators-setup'], barrier=True)

    result = {
        'iteration': args.iteration,
        'train_losses': {},
        'valid_losses': None,
        'test_losses': None,
    }
    if not args.skip_train:
        print_rank_0('training ...')
        iteration = 0
        if args.do_train and args.train_iters > 0:
            iteration, num_floating_point_operations_so_far = train(
                forward_step_func,
                model,
                optimizer,
                opt_param_scheduler,
                train_data_iterator,
                valid_data_iterator,
                process_non_loss_data_func,
                config,
                train_losses=result['train_losses'],
            )
        else:
            num_floating_point_operations_so_far = args.num_floating_point_operations_so_far
        print_datetime('after training is done')

        # An exit by signal, --exit-interval or --exit-duration-in-mins has just saved this
        # iteration; saving it again would only double the cost.
        already_saved = _LAST_SAVED_ITERATION == iteration
        if (
            args.save
            and iteration != 0
            and iteration % args.save_interval != 0
            and not already_saved
        ):
            save_checkpoint_and_time(
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                num_floating_point_operations_so_far,
            )
        if args.async_save:
            _checkpointing().maybe_finalize_async_save(blocking=True, announce=True)
    else:
        print_rank_0('skipping training (--skip-train is on) ...')
        iteration = args.iteration
    result['iteration'] = iteration

    result['valid_losses'], result['test_losses'] = _final_evaluation(
        forward_step_func,
        (valid_data_iterator, test_data_iterator),
        model,
        iteration,
        process_non_loss_data_func,
        config,
    )
    writer = get_tensorboard_writer()
    if writer:
        writer.flush()
    if args.tensorboard_dir:
        print_rank_last(f'TensorBoard logs written to {args.tensorboard_dir}')
    finish_wandb()
    stop_watchdog()
    return result


def _final_evaluation(
    forward_step_func, iterators, model, iteration, process_non_loss_data_func, config
):
    """Validation and test after training (--eval-iters batches each); returns their losses
    ({key: float} on the last rank, None when the split is not evaluated)."""
    args = get_args()
    losses = []
    for name, enabled, iterator in (
        ('validation', args.do_valid, iterators[0]),
        ('test', args.do_test, iterators[1]),
    ):
        if not enabled:
            losses.append(None)
            continue
        prefix = (
            f'iteration {iteration} on {args.eval_iters * args.global_batch_size}'
            f'-sample draw from {name} set'
        )
        losses.append(
            evaluate_and_print_results(
                prefix,
                forward_step_func,
                iterator,
                model,
                iteration,
                process_non_loss_data_func,
                config,
                verbose=True,
                write_to_tensorboard=not args.skip_train,
            )
        )
    return tuple(losses)


def update_train_iters(args):
    """Derive args.train_iters for sample-based training (--train-samples), ramp-up included."""
    if args.rampup_batch_size is None:
        args.train_iters = args.train_samples // args.global_batch_size
    else:
        # Count the iterations of the ramp-up, then the constant-batch iterations.
        iterations = 0
        consumed_samples = 0
        while (
            consumed_samples <= int(args.rampup_batch_size[2])
            and consumed_samples <= args.train_samples
        ):
            update_num_microbatches(consumed_samples, consistency_check=False)
            consumed_samples += get_current_global_batch_size()
            iterations += 1
        update_num_microbatches(0, consistency_check=False)
        iterations += (args.train_samples - consumed_samples) // args.global_batch_size
        args.train_iters = iterations
    print_rank_0('setting training iterations to {}'.format(args.train_iters))


def get_model(model_provider_func, model_type=ModelType.encoder_or_decoder, wrap_with_ddp=True):
    """Build the model chunks of this rank, move them to the device, cast and wrap them in DDP.

    With virtual pipeline parallelism the provider is called once per virtual stage, with
    pre_process/post_process set for that chunk. Returns a list of model chunks.
    """
    args = get_args()
    args.model_type = model_type

    if (
        mpu.get_pipeline_model_parallel_world_size() > 1
        and args.virtual_pipeline_model_parallel_size is not None
    ):
        if model_type == ModelType.encoder_and_decoder:
            raise ValueError(
                'interleaved schedule (--num-layers-per-virtual-pipeline-stage) '
                'is not supported for encoder-decoder models'
            )
        model = []
        for i in range(args.virtual_pipeline_model_parallel_size):
            mpu.set_virtual_pipeline_model_parallel_rank(i)
            pre_process = mpu.is_pipeline_first_stage()
            post_process = mpu.is_pipeline_last_stage()
            this_model = model_provider_func(pre_process=pre_process, post_process=post_process)
            this_model.model_type = model_type
            model.append(this_model)
        mpu.set_virtual_pipeline_model_parallel_rank(0)
    else:
        pre_process = mpu.is_pipeline_first_stage()
        post_process = mpu.is_pipeline_last_stage()
        if (
            model_type == ModelType.encoder_and_decoder
            and mpu.get_pipeline_model_parallel_world_size() > 1
        ):
            rank = mpu.get_pipeline_model_parallel_rank()
            split_rank = args.pipeline_model_parallel_split_rank
            world_size = mpu.get_pipeline_model_parallel_world_size()
            pre_process = rank == 0 or rank == split_rank
            post_process = (rank == (split_rank - 1)) or (rank == (world_size - 1))
            add_encoder = mpu.is_pipeline_stage_before_split()
            add_decoder = mpu.is_pipeline_stage_after_split()
            model = model_provider_func(
                pre_process=pre_process,
                post_process=post_process,
                add_encoder=add_encoder,
                add_decoder=add_decoder,
            )
        else:
            model = model_provider_func(pre_process=pre_process, post_process=post_process)
        model.model_type = model_type

    if not isinstance(model, list):
        model = [model]

    for model_module in model:
        for param in model_module.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    if mpu.get_data_parallel_rank() == 0:
        print(
            ' > number of parameters on (tensor, pipeline) model parallel rank ({}, {}): {}'.format(
                mpu.get_tensor_model_parallel_rank(),
                mpu.get_pipeline_model_parallel_rank(),
                sum(
                    [
                        sum([p.nelement() for p in model_module.parameters()])
                        for model_module in model
                    ]
                ),
            ),
            flush=True,
        )

    device = get_current_device()
    for model_module in model:
        model_module.to(device)
    if getattr(args, 'torch_compile', False):
        _compile_transformer_layers(model)

    from megatron.training.loop.fsdp_wrapping import keeps_fp32_params, uses_torch_fsdp2

    if (args.fp16 or args.bf16) and not keeps_fp32_params(args):
        from megatron.core.transformer.module import Float16Module

        model = [
            Float16Module(get_model_config(model_module), model_module) for model_module in model
        ]

    if wrap_with_ddp and uses_torch_fsdp2(args):
        from megatron.training.loop.fsdp_wrapping import wrap_with_torch_fsdp2

        return wrap_with_torch_fsdp2(args, model)
    if wrap_with_ddp:
        from megatron.core.distributed import DistributedDataParallel as DDP
        from megatron.core.distributed import DistributedDataParallelConfig

        config = get_model_config(model[0])
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=args.accumulate_allreduce_grads_in_fp32,
            overlap_grad_reduce=args.overlap_grad_reduce,
            use_distributed_optimizer=args.use_distributed_optimizer,
            # fp16: inf/NaN gradients are an overflow of the loss scale, which the optimizer
            # detects after the reduction and answers by skipping the step and lowering the
            # scale. A real NaN still stops the run: the forward loss is checked in the loss
            # function, and overflow at the minimum loss scale stops training.
            check_for_nan_in_grad=args.check_for_nan_in_loss_and_grad and not args.fp16,
            check_for_large_grads=args.check_for_large_grads,
            bucket_size=args.ddp_bucket_size,
            average_in_collective=args.ddp_average_in_collective,
        )
        model = [
            DDP(
                config,
                ddp_config,
                model_chunk,
                # Turn off bucketing for model_chunk 2 onwards, since communication for these
                # model chunks is overlapped with compute anyway.
                disable_bucketing=(model_chunk_idx > 0),
            )
            for (model_chunk_idx, model_chunk) in enumerate(model)
        ]
        if args.data_parallel_random_init:
            for model_module in model:
                model_module.broadcast_params()
    return model


def _compile_transformer_layers(model):
    """--torch-compile: compile each TransformerLayer's forward in place (`nn.Module.compile`).

    Parameter names, state dicts and DDP's gradient hooks are unchanged; only the layer bodies run
    as compiled graphs, so checkpoints stay interchangeable with uncompiled runs.
    """
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for model_module in model:
        for module in model_module.modules():
            if isinstance(module, TransformerLayer):
                for linear in module.modules():
                    # Fused accumulation marks the weight (`grad_added_to_main_grad`) inside the
                    # autograd function's backward, a side effect dynamo cannot trace: it would
                    # break the graph at every linear layer. Compiled layers hand their weight
                    # gradients to DDP's hook instead, which adds them to main_grad.
                    if hasattr(linear, 'gradient_accumulation_fusion'):
                        linear.gradient_accumulation_fusion = False
                module.compile()


def get_optimizer_param_scheduler(optimizer):
    """Build the OptimizerParamScheduler; its steps are samples (iterations x global batch size)."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    args = get_args()
    if args.train_iters is not None:
        if args.lr_decay_iters is None:
            # --train-iters 0 runs evaluation only; the schedule is never stepped but must exist.
            args.lr_decay_iters = args.train_iters or 1
        lr_decay_steps = args.lr_decay_iters * args.global_batch_size
        wd_incr_steps = args.train_iters * args.global_batch_size
        wsd_decay_steps = None
        if args.lr_wsd_decay_iters is not None:
            wsd_decay_steps = args.lr_wsd_decay_iters * args.global_batch_size
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_iters * args.global_batch_size
    elif args.train_samples:
        update_train_iters(args)
        if args.lr_decay_samples is None:
            args.lr_decay_samples = args.train_samples
        lr_decay_steps = args.lr_decay_samples
        wd_incr_steps = args.train_samples
        wsd_decay_steps = args.lr_wsd_decay_samples
        if args.lr_warmup_fraction is not None:
            lr_warmup_steps = args.lr_warmup_fraction * lr_decay_steps
        else:
            lr_warmup_steps = args.lr_warmup_samples
    else:
        raise ValueError('either --train-iters or --train-samples must be given')

    return OptimizerParamScheduler(
        optimizer,
        init_lr=args.lr_warmup_init,
        max_lr=args.lr,
        min_lr=args.min_lr,
        lr_warmup_steps=lr_warmup_steps,
        lr_decay_steps=lr_decay_steps,
        lr_decay_style=args.lr_decay_style,
        start_wd=args.start_weight_decay,
        end_wd=args.end_weight_decay,
        wd_incr_steps=wd_incr_steps,
        wd_incr_style=args.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        wsd_decay_steps=wsd_decay_steps,
        lr_wsd_decay_style=args.lr_wsd_decay_style,
    )


def is_head_parameter(name: str, param) -> bool:
    """A parameter of a vision model's head (`head.` in its name: the classifier of
    VitClassificationModel, the DINO projection head)."""
    return 'head' in name.split('.')


def head_lr_scaling(args):
    """(scale_lr_cond, lr_mult) for the optimizer: --head-lr-mult multiplies the head's learning
    rate, as Megatron's vision finetuning does (`tasks/vision/finetune_utils.py`)."""
    if getattr(args, 'head_lr_mult', 1.0) == 1.0:
        return None, 1.0
    return is_head_parameter, args.head_lr_mult


def setup_model_and_optimizer(
    model_provider_func, model_type, no_wd_decay_cond=None, scale_lr_cond=None, lr_mult=1.0
):
    """Model chunks, the Megatron optimizer and the scheduler; loads a checkpoint with --load."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    args = get_args()
    timers = get_timers()
    if args.lr is None:
        raise ValueError('--lr is required for training')

    model = get_model(model_provider_func, model_type)
    unwrapped_model = unwrap_model(model)

    kwargs = {}
    for f in dataclasses.fields(OptimizerConfig):
        if hasattr(args, f.name):
            kwargs[f.name] = getattr(args, f.name)
    config = OptimizerConfig(**kwargs)
    config.timers = timers
    optimizer = get_megatron_optimizer(config, model, no_wd_decay_cond, scale_lr_cond, lr_mult)
    opt_param_scheduler = get_optimizer_param_scheduler(optimizer)

    if args.load is not None or getattr(args, 'pretrained_checkpoint', None) is not None:
        timers('load-checkpoint', log_level=0).start(barrier=True)
        args.iteration, args.num_floating_point_operations_so_far = (
            _checkpointing().load_checkpoint(model, optimizer, opt_param_scheduler)
        )
        if args.load is not None and args.iteration and not args.finetune:
            rerun_training.load_rerun_state(args.load, args.iteration)
        timers('load-checkpoint').stop(barrier=True)
        timers.log(['load-checkpoint'])
    else:
        args.iteration = 0
        args.num_floating_point_operations_so_far = 0

    del unwrapped_model
    return model, optimizer, opt_param_scheduler


def train_step(forward_step_func, data_iterator, model, optimizer, opt_param_scheduler, config):
    """One iteration: forward/backward over all micro-batches, optimizer step, scheduler step.

    Returns:
        (loss_dict, skipped_iter, grad_norm, num_zeros_in_grad). loss_dict is non-empty on the last
        pipeline stage: each key averaged over the global batch (token-weighted for (sum, count)
        pairs, else over micro-batches).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = get_args()
    timers = get_timers()

    forward_backward_func = get_forward_backward_func()

    def run_once():
        for model_chunk in model:
            if hasattr(model_chunk, 'zero_grad_buffer'):
                model_chunk.zero_grad_buffer()
        optimizer.zero_grad()
        return forward_backward_func(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=get_num_microbatches(),
            seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size,
            decoder_seq_length=args.decoder_seq_length,
            forward_only=False,
        )

    # The rerun state machine may run the step again (same data and RNG) before deciding.
    losses_reduced, should_checkpoint, should_exit, exit_code = rerun_training.run_forward_backward(
        run_once, data_iterator
    )
    if should_exit:
        raise rerun_training.RerunExit(should_checkpoint, exit_code)
    empty_unused_memory(args, level=1)

    _call_model_hook(model, 'cancel_gradients_last_layer', args.curr_iteration)
    timers('optimizer', log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if getattr(args, 'qk_clip', False) and update_successful:
        from megatron.core.optimizer.qk_clip import clip_qk

        dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
        clip_qk(model, args.qk_clip_threshold, args.qk_clip_alpha, dp_cp)
    timers('optimizer').stop()
    _call_model_hook(model, 'update_momentum', args.curr_iteration)

    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    empty_unused_memory(args, level=2)

    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        loss_reduced = reduce_losses_over_microbatches(losses_reduced)
        return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad
    return {}, skipped_iter, grad_norm, num_zeros_in_grad


def save_checkpoint_and_time(
    iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far
):
    """save_checkpoint with a 'save-checkpoint' timer."""
    args = get_args()
    timers = get_timers()
    # No deadline: a large checkpoint on a slow file system may legitimately take long; a frozen
    # peer is still found through its heartbeat.
    with watch('checkpoint save', iteration, deadline=False):
        timers('save-checkpoint', log_level=0).start(barrier=True)
        _checkpointing().save_checkpoint(
            iteration, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far
        )
    global _LAST_SAVED_ITERATION
    _LAST_SAVED_ITERATION = iteration
    timers('save-checkpoint').stop(barrier=True)
    timers.log(['save-checkpoint'])
    if args.log_progress:
        compute_throughputs_and_append_to_progress_log(
            iteration, num_floating_point_operations_so_far
        )


def _check_overflow_is_not_a_real_nan(args, iteration, skipped_iter, scale_before_step):
    """An fp16 overflow is skipped and the dynamic loss scale lowered; an overflow that happens
    at the minimum scale cannot be cured that way: the gradients hold a real NaN/inf."""
    if not (skipped_iter and args.fp16 and args.loss_scale is None):
        return
    if scale_before_step <= args.min_loss_scale:
        raise RuntimeError(
            f'iteration {iteration}: inf/NaN gradients at the minimum loss scale '
            f'({args.min_loss_scale}, --min-loss-scale): not an fp16 overflow but a real NaN/inf '
            f'in the backward pass'
        )


def _install_schedule_hooks(config, model, optimizer, args):
    """The hooks the schedules call: loss scaling, timers, grad/param sync, grad finalization."""
    from megatron.core.distributed import finalize_model_grads

    config.grad_scale_func = optimizer.scale_loss
    config.timers = get_timers()
    # FSDP2 wrappers reduce in backward unless told not to, whatever --overlap-grad-reduce.
    reduces_in_backward = getattr(model[0], 'needs_no_sync_between_microbatches', False)
    if (args.overlap_grad_reduce or reduces_in_backward) and hasattr(model[0], 'no_sync'):
        # Grad all-reduces are launched by DDP's hooks during the last micro-batch's backward;
        # the schedules disable them for the other micro-batches.
        config.no_sync_func = [model_chunk.no_sync for model_chunk in model]
        if len(model) == 1:
            config.no_sync_func = config.no_sync_func[0]
        if args.delay_grad_reduce:
            config.grad_sync_func = [model_chunk.start_grad_sync for model_chunk in model]
            if len(model) == 1:
                config.grad_sync_func = config.grad_sync_func[0]
    if (
        args.overlap_param_gather
        and args.delay_param_gather
        and hasattr(optimizer, 'finish_param_sync')
    ):
        config.param_sync_func = [
            (lambda x, model_index=model_index: optimizer.finish_param_sync(model_index, x))
            for model_index in range(len(model))
        ]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]
    config.finalize_model_grads_func = finalize_model_grads


def _current_learning_rate(optimizer):
    """The learning rate of the last param group that is not a decoupled one."""
    learning_rate = None
    for param_group in optimizer.param_groups:
        if not param_group.get('is_decoupled_lr', False):
            learning_rate = param_group['lr']
    return learning_rate


def _save_and_check_exit(iteration, model, optimizer, opt_param_scheduler, flops_so_far):
    """Save on --save-interval, on a received signal, on --exit-duration-in-mins and on
    --exit-interval (once per iteration); returns True when training must stop now."""
    args = get_args()

    def save():
        save_checkpoint_and_time(iteration, model, optimizer, opt_param_scheduler, flops_so_far)

    if args.exit_signal_handler and any(get_signal_handler().signals_received()):
        save()
        print_datetime('exiting program after receiving SIGTERM.')
        return True
    saved_checkpoint = False
    if args.save and args.save_interval and iteration % args.save_interval == 0:
        save()
        saved_checkpoint = True
    elif checkpointing_non_persistent.is_due(args, iteration):
        with watch('checkpoint save', iteration, deadline=False):
            checkpointing_non_persistent.save_non_persistent_checkpoint(
                _checkpointing().save_checkpoint,
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                flops_so_far,
            )
    if args.exit_duration_in_mins:
        train_time = (time.time() - get_train_start_time()) / 60.0
        if _exit_flag(train_time > args.exit_duration_in_mins):
            if args.save and not saved_checkpoint:
                save()
            print_datetime('exiting program after {} minutes'.format(train_time))
            return True
    if args.exit_interval and iteration % args.exit_interval == 0:
        if args.save and not saved_checkpoint:
            save()
        torch.distributed.barrier()
        print_datetime('exiting program at iteration {}'.format(iteration))
        return True
    return False


def _exit_for_rerun(stop, state, model, optimizer, opt_param_scheduler):
    """The rerun state machine ends the job: save the checkpoint it asks for (of the iteration
    before the failed step, with the machine's state), then exit with its code (16 or 17)."""
    args = get_args()
    if stop.should_checkpoint and args.save:
        save_checkpoint_and_time(
            state.iteration, model, optimizer, opt_param_scheduler, state.flops_so_far
        )
        if args.async_save:
            _checkpointing().maybe_finalize_async_save(blocking=True, announce=True)
        rerun_training.save_rerun_state(args.save, state.iteration)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    stop_watchdog()
    sys.exit(stop.exit_code)


def _evaluate_during_training(
    iteration, forward_step_func, valid_data_iterator, model, process_non_loss_data_func, config
):
    """Validation every --eval-interval iterations (with --manual-gc-eval collections)."""
    args = get_args()
    if not (args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid):
        return
    if args.manual_gc and args.manual_gc_eval:
        gc.collect()  # everything, before evaluation
    evaluate_and_print_results(
        'iteration {}'.format(iteration),
        forward_step_func,
        valid_data_iterator,
        model,
        iteration,
        process_non_loss_data_func,
        config,
        False,
    )
    if args.manual_gc and args.manual_gc_eval:
        gc.collect(generation=0)  # only the objects evaluation created


class _LoopState:
    """What the training loop carries from one iteration to the next."""

    def __init__(self, args):
        self.iteration = args.iteration
        self.flops_so_far = args.num_floating_point_operations_so_far
        self.flops_since_report = 0.0  # straggler report
        self.total_loss_dict = {}
        self.report_memory_flag = True


def _run_iteration(
    state, forward_step_func, model, optimizer, opt_param_scheduler, iterator, config
):
    """One training iteration and its bookkeeping: step, samples and FLOPs, weight-hash check,
    the log line. Returns the iteration's loss dict."""
    args = get_args()
    update_num_microbatches(args.consumed_train_samples, consistency_check=True)
    args.curr_iteration = state.iteration
    # The iteration's deadline covers the step and what follows it (logging, saving).
    progress('training iteration', state.iteration + 1)
    scale_before_step = optimizer.get_loss_scale().item()
    loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
        forward_step_func, iterator, model, optimizer, opt_param_scheduler, config
    )
    _check_overflow_is_not_a_real_nan(args, state.iteration + 1, skipped_iter, scale_before_step)
    state.iteration += 1
    batch_size = mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
    args.consumed_train_samples += batch_size
    num_fp_ops = num_floating_point_operations(args, batch_size)
    state.flops_so_far += num_fp_ops
    state.flops_since_report += num_fp_ops
    check_weight_hashes(args, state.iteration, model)

    params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
    state.report_memory_flag = training_log(
        loss_dict,
        state.total_loss_dict,
        _current_learning_rate(optimizer),
        state.iteration,
        optimizer.get_loss_scale().item(),
        state.report_memory_flag,
        skipped_iter,
        grad_norm,
        params_norm,
        num_zeros_in_grad,
    )
    if args.log_straggler and state.iteration % args.log_interval == 0:
        stimer.report(state.flops_since_report, args.log_interval)
        state.flops_since_report = 0.0
    return loss_dict


def train(
    forward_step_func,
    model,
    optimizer,
    opt_param_scheduler,
    train_data_iterator,
    valid_data_iterator,
    process_non_loss_data_func,
    config,
    train_losses=None,
):
    """The training loop. Returns (iteration, num_floating_point_operations_so_far).

    Each iteration: `_run_iteration` (step and log line), validation every --eval-interval,
    then `_save_and_check_exit` (checkpoints and the exit conditions); --profile brackets the
    iterations of its window.

    Args:
        train_losses: optional dict filled with {iteration: {key: loss}} (last pipeline stage).
    """
    args = get_args()
    timers = get_timers()
    for model_module in model:
        model_module.train()
    state = _LoopState(args)
    rerun_training.start_training_loop(state.iteration)
    _install_schedule_hooks(config, model, optimizer, args)
    if args.log_straggler:
        configure_straggler_detector(args)
    profiler = IterationProfiler(args, torch.distributed.get_rank())

    timers('interval-time', log_level=0).start(barrier=True)
    print_datetime('before the start of training step')
    exit = False
    if args.manual_gc:
        gc.disable()
        gc.collect()
    try:
        while state.iteration < args.train_iters:
            if args.async_save:  # a finished background save moves the tracker now
                _checkpointing().maybe_finalize_async_save(blocking=False)
            profiler.begin_iteration(state.iteration)
            try:
                loss_dict = _run_iteration(
                    state,
                    forward_step_func,
                    model,
                    optimizer,
                    opt_param_scheduler,
                    train_data_iterator,
                    config,
                )
            except rerun_training.RerunExit as stop:
                _exit_for_rerun(stop, state, model, optimizer, opt_param_scheduler)
            profiler.end_iteration(state.iteration - 1)
            if train_losses is not None and loss_dict:
                train_losses[state.iteration] = {k: float(v) for k, v in loss_dict.items()}
            _evaluate_during_training(
                state.iteration,
                forward_step_func,
                valid_data_iterator,
                model,
                process_non_loss_data_func,
                config,
            )
            exit = _save_and_check_exit(
                state.iteration, model, optimizer, opt_param_scheduler, state.flops_so_far
            )
            if exit:
                break
            if args.manual_gc and args.manual_gc_interval != 0:
                if state.iteration % args.manual_gc_interval == 0:
                    gc.collect()
    finally:
        profiler.close()
        if args.log_straggler:  # close the on/off controller's port (rank 0)
            StragglerDetector().stop_controller()

    progress('after training', state.iteration, deadline=False)
    if args.async_save:  # exits (SIGTERM, --exit-interval) wait for the pending save
        _checkpointing().maybe_finalize_async_save(blocking=True, announce=True)
    timers('interval-time').stop()
    if args.manual_gc:
        gc.enable()
    if exit:
        args.do_valid = False
        args.do_test = False
    return state.iteration, state.flops_so_far
