"""Pretraining driver: `pretrain()` and the pieces it orchestrates.

pretrain
  initialize_megatron -> setup_model_and_optimizer (get_model, optimizer, scheduler, load)
  -> build_train_valid_test_data_iterators -> train (train_step via get_forward_backward_func,
  training_log, evaluate_and_print_results, save/exit) -> final validation and test evaluation.

Checkpoint I/O lives in `checkpointing.py` and is imported only when --save/--load ask for it.
"""

import dataclasses
import gc
import math
import time
from datetime import datetime

import torch

from megatron.core import parallel_state as mpu
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.num_microbatches_calculator import (
    get_current_global_batch_size,
    get_num_microbatches,
    update_num_microbatches,
)
from megatron.core.utils import StragglerDetector, get_current_device, get_model_config, uses_cuda
from megatron.training.argument_validation import validate_encoder_decoder_args
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
from megatron.training.theoretical_memory_usage import report_theoretical_memory
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
    report_memory,
    unwrap_model,
)
from megatron.training.watchdog import progress, start_watchdog, stop_watchdog, watch

_TRAIN_START_TIME = time.time()

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
    start_watchdog(args.watchdog_timeout)

    # Adjust the startup time so it reflects the largest value across ranks.
    global _TRAIN_START_TIME, _LAST_SAVED_ITERATION
    _LAST_SAVED_ITERATION = None  # a process may run pretrain() more than once (tests)
    start_time_tensor = torch.tensor(
        [_TRAIN_START_TIME], dtype=torch.double, device=get_current_device()
    )
    torch.distributed.all_reduce(start_time_tensor, op=torch.distributed.ReduceOp.MIN)
    _TRAIN_START_TIME = start_time_tensor.item()
    print_rank_0(
        'time to initialize megatron (seconds): {:.3f}'.format(time.time() - _TRAIN_START_TIME)
    )
    print_datetime('after megatron is initialized')

    # Model, optimizer, and learning rate.
    timers('model-and-optimizer-setup', log_level=0).start(barrier=True)
    model, optimizer, opt_param_scheduler = setup_model_and_optimizer(model_provider, model_type)
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
    else:
        print_rank_0('skipping training (--skip-train is on) ...')
        iteration = args.iteration
    result['iteration'] = iteration

    if args.do_valid:
        prefix = (
            f'iteration {iteration} on {args.eval_iters * args.global_batch_size}'
            '-sample draw from validation set'
        )
        result['valid_losses'] = evaluate_and_print_results(
            prefix,
            forward_step_func,
            valid_data_iterator,
            model,
            iteration,
            process_non_loss_data_func,
            config,
            verbose=True,
            write_to_tensorboard=not args.skip_train,
        )
    if args.do_test:
        prefix = (
            f'iteration {iteration} on {args.eval_iters * args.global_batch_size}'
            '-sample draw from test set'
        )
        result['test_losses'] = evaluate_and_print_results(
            prefix,
            forward_step_func,
            test_data_iterator,
            model,
            iteration,
            process_non_loss_data_func,
            config,
            verbose=True,
            write_to_tensorboard=not args.skip_train,
        )

    writer = get_tensorboard_writer()
    if writer:
        writer.flush()
    if args.tensorboard_dir:
        print_rank_last(f'TensorBoard logs written to {args.tensorboard_dir}')
    stop_watchdog()
    return result


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

    if args.fp16 or args.bf16:
        from megatron.core.transformer.module import Float16Module

        model = [
            Float16Module(get_model_config(model_module), model_module) for model_module in model
        ]

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

    for model_chunk in model:
        if hasattr(model_chunk, 'zero_grad_buffer'):
            model_chunk.zero_grad_buffer()
    optimizer.zero_grad()

    forward_backward_func = get_forward_backward_func()
    losses_reduced = forward_backward_func(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model,
        num_microbatches=get_num_microbatches(),
        seq_length=args.seq_length,
        micro_batch_size=args.micro_batch_size,
        decoder_seq_length=args.decoder_seq_length,
        forward_only=False,
    )
    empty_unused_memory(args, level=1)

    timers('optimizer', log_level=1).start(barrier=args.barrier_with_L1_time)
    update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    timers('optimizer').stop()

    if update_successful:
        increment = get_num_microbatches() * args.micro_batch_size * args.data_parallel_size
        opt_param_scheduler.step(increment=increment)
        skipped_iter = 0
    else:
        skipped_iter = 1
    empty_unused_memory(args, level=2)

    if mpu.is_pipeline_last_stage(ignore_virtual=True):
        loss_reduced = {}
        for key in losses_reduced[0].keys():
            numerator = 0
            denominator = 0
            for x in losses_reduced:
                val = x[key]
                if isinstance(val, (tuple, list)):
                    numerator += val[0]
                    denominator += val[1]
                else:
                    numerator += val
                    denominator += 1
            loss_reduced[key] = numerator / denominator
        return loss_reduced, skipped_iter, grad_norm, num_zeros_in_grad
    return {}, skipped_iter, grad_norm, num_zeros_in_grad


_TIMERS_TO_LOG = [
    'forward-backward',
    'forward-compute',
    'backward-compute',
    'batch-generator',
    'forward-recv',
    'forward-send',
    'backward-recv',
    'backward-send',
    'forward-send-forward-recv',
    'forward-send-backward-recv',
    'backward-send-forward-recv',
    'backward-send-backward-recv',
    'forward-backward-send-forward-backward-recv',
    'layernorm-grads-all-reduce',
    'embedding-grads-all-reduce',
    'all-grads-sync',
    'params-all-gather',
    'optimizer-copy-to-main-grad',
    'optimizer-unscale-and-check-inf',
    'optimizer-clip-main-grad',
    'optimizer-count-zeros',
    'optimizer-inner-step',
    'optimizer-copy-main-to-model-params',
    'optimizer',
]


def _format_tflops(tflops: float) -> str:
    """Megatron's one decimal from 10 TFLOP/s up; below, enough decimals for three significant
    digits, so that a CPU run (a fraction of a TFLOP/s) still reads as a figure, not 0.0."""
    if not math.isfinite(tflops) or tflops >= 10.0 or tflops <= 0.0:
        return f'{tflops:.1f}'
    decimals = min(9, max(1, 2 - math.floor(math.log10(tflops))))
    return f'{tflops:.{decimals}f}'


def format_log_line(
    iteration,
    train_iters,
    consumed_samples,
    elapsed_ms,
    learning_rate,
    batch_size,
    losses,
    loss_scale,
    grad_norm=None,
    num_zeros_in_grad=None,
    params_norm=None,
    skipped=0,
    nan=0,
    throughput=None,
    timestamp=None,
):
    """Megatron's per-interval training log line (core_v0.8.0 format).

    Args:
        losses: {key: average loss}; entries <= 0 are left out, as in Megatron.
        throughput: TFLOP/s per device, or None without --log-throughput.
        timestamp: datetime of the line (default now).
    """
    timestamp = timestamp or datetime.now()
    log_string = f" [{timestamp.strftime('%Y-%m-%d %H:%M:%S')}]"
    log_string += ' iteration {:8d}/{:8d} |'.format(iteration, train_iters)
    log_string += ' consumed samples: {:12d} |'.format(consumed_samples)
    log_string += ' elapsed time per iteration (ms): {:.1f} |'.format(elapsed_ms)
    if throughput is not None:
        log_string += f' throughput per GPU (TFLOP/s/GPU): {_format_tflops(throughput)} |'
    log_string += ' learning rate: {:.6E} |'.format(learning_rate)
    log_string += ' global batch size: {:5d} |'.format(batch_size)
    for key, avg in losses.items():
        if avg > 0.0:
            log_string += ' {}: {:.6E} |'.format(key, avg)
    log_string += ' loss scale: {:.1f} |'.format(loss_scale)
    if grad_norm is not None:
        log_string += ' grad norm: {:.3f} |'.format(grad_norm)
    if num_zeros_in_grad is not None:
        log_string += ' num zeros: {:.1f} |'.format(num_zeros_in_grad)
    if params_norm is not None:
        log_string += ' params norm: {:.3f} |'.format(params_norm)
    log_string += ' number of skipped iterations: {:3d} |'.format(skipped)
    log_string += ' number of nan iterations: {:3d} |'.format(nan)
    return log_string


def training_log(
    loss_dict,
    total_loss_dict,
    learning_rate,
    iteration,
    loss_scale,
    report_memory_flag,
    skipped_iter,
    grad_norm,
    params_norm,
    num_zeros_in_grad,
):
    """Accumulate losses and, every --log-interval iterations, print the log line and TB scalars."""
    args = get_args()
    timers = get_timers()
    writer = get_tensorboard_writer()

    advanced_iters_key = 'advanced iterations'
    skipped_iters_key = 'skipped iterations'
    nan_iters_key = 'nan iterations'
    if not skipped_iter:
        total_loss_dict[advanced_iters_key] = total_loss_dict.get(advanced_iters_key, 0) + 1
    else:
        if advanced_iters_key not in total_loss_dict:
            total_loss_dict[advanced_iters_key] = 0
    total_loss_dict[skipped_iters_key] = total_loss_dict.get(skipped_iters_key, 0) + skipped_iter
    got_nan = False
    for key in loss_dict:
        if not skipped_iter:
            total_loss_dict[key] = total_loss_dict.get(key, 0.0) + float(loss_dict[key])
        else:
            value = float(loss_dict[key])
            is_nan = value == float('inf') or value == -float('inf') or value != value
            got_nan = got_nan or is_nan
    total_loss_dict[nan_iters_key] = total_loss_dict.get(nan_iters_key, 0) + int(got_nan)

    timers_to_log = _TIMERS_TO_LOG
    batch_size = args.micro_batch_size * args.data_parallel_size * get_num_microbatches()
    total_iterations = total_loss_dict[advanced_iters_key] + total_loss_dict[skipped_iters_key]

    # TensorBoard values.
    if writer and (iteration % args.tensorboard_log_interval == 0):
        if args.log_learning_rate_to_tensorboard:
            writer.add_scalar('learning-rate', learning_rate, iteration)
            writer.add_scalar(
                'learning-rate vs samples', learning_rate, args.consumed_train_samples
            )
        if args.log_batch_size_to_tensorboard:
            writer.add_scalar('batch-size', batch_size, iteration)
            writer.add_scalar('batch-size vs samples', batch_size, args.consumed_train_samples)
        for key in loss_dict:
            writer.add_scalar(key, float(loss_dict[key]), iteration)
            writer.add_scalar(
                key + ' vs samples', float(loss_dict[key]), args.consumed_train_samples
            )
        if args.log_loss_scale_to_tensorboard:
            writer.add_scalar('loss-scale', loss_scale, iteration)
            writer.add_scalar('loss-scale vs samples', loss_scale, args.consumed_train_samples)
        if args.log_world_size_to_tensorboard:
            writer.add_scalar('world-size', args.world_size, iteration)
            writer.add_scalar('world-size vs samples', args.world_size, args.consumed_train_samples)
        if grad_norm is not None:
            writer.add_scalar('grad-norm', grad_norm, iteration)
            writer.add_scalar('grad-norm vs samples', grad_norm, args.consumed_train_samples)
        if num_zeros_in_grad is not None:
            writer.add_scalar('num-zeros', num_zeros_in_grad, iteration)
            writer.add_scalar(
                'num-zeros vs samples', num_zeros_in_grad, args.consumed_train_samples
            )
        if params_norm is not None:
            writer.add_scalar('params-norm', params_norm, iteration)
            writer.add_scalar('params-norm vs samples', params_norm, args.consumed_train_samples)
        if args.log_memory_to_tensorboard and uses_cuda():
            mem_stats = torch.cuda.memory_stats()
            writer.add_scalar(
                'mem-reserved-bytes', mem_stats['reserved_bytes.all.current'], iteration
            )
            writer.add_scalar(
                'mem-allocated-bytes', mem_stats['allocated_bytes.all.current'], iteration
            )
            writer.add_scalar('mem-allocated-count', mem_stats['allocation.all.current'], iteration)
    if args.log_timers_to_tensorboard and (iteration % args.tensorboard_log_interval == 0):
        # reset=False: the log line below still reports these timers (Megatron resets here, so
        # its log line shows zeros with --log-timers-to-tensorboard).
        timers.write(timers_to_log, writer, iteration, normalizer=total_iterations, reset=False)

    if iteration % args.log_interval == 0:
        elapsed_time = timers('interval-time').elapsed(barrier=True)
        elapsed_time_per_iteration = elapsed_time / max(total_iterations, 1)
        throughput = num_floating_point_operations(args, batch_size) / (
            elapsed_time_per_iteration * 10**12 * args.world_size
        )
        if writer and args.log_timers_to_tensorboard:
            writer.add_scalar('iteration-time', elapsed_time_per_iteration, iteration)
            if args.log_throughput:
                writer.add_scalar('throughput', throughput, iteration)
        losses = {}
        for key in list(total_loss_dict.keys()):
            if key not in (advanced_iters_key, skipped_iters_key, nan_iters_key):
                losses[key] = total_loss_dict[key] / float(
                    max(1, total_loss_dict[advanced_iters_key])
                )
                total_loss_dict[key] = 0.0
        log_string = format_log_line(
            iteration,
            args.train_iters,
            args.consumed_train_samples,
            elapsed_time_per_iteration * 1000.0,
            learning_rate,
            batch_size,
            losses,
            loss_scale,
            grad_norm=grad_norm,
            num_zeros_in_grad=num_zeros_in_grad,
            params_norm=params_norm,
            skipped=total_loss_dict[skipped_iters_key],
            nan=total_loss_dict[nan_iters_key],
            throughput=throughput if args.log_throughput else None,
        )
        total_loss_dict[advanced_iters_key] = 0
        total_loss_dict[skipped_iters_key] = 0
        total_loss_dict[nan_iters_key] = 0
        print_rank_last(log_string)
        if report_memory_flag and learning_rate > 0.0:
            # After the first step the optimizer state exists; compare with the theory.
            if torch.distributed.get_rank() == 0:
                report_theoretical_memory(
                    args, num_microbatches=get_num_microbatches(), verbose=True
                )
            report_memory('(after {} iterations)'.format(iteration))
            report_memory_flag = False
        timers.log(timers_to_log, normalizer=args.log_interval)
    return report_memory_flag


# Iteration of the last checkpoint this process saved (None: none yet).
_LAST_SAVED_ITERATION = None


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
        append_to_progress_log(f'Saved checkpoint\tIteration: {iteration}', barrier=False)


def _exit_flag(value):
    """All-reduce a local bool so every rank takes the same exit decision."""
    flag = torch.tensor([int(value)], dtype=torch.int, device=get_current_device())
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


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

    Args:
        train_losses: optional dict filled with {iteration: {key: loss}} (last pipeline stage).
    """
    from megatron.core.distributed import finalize_model_grads

    args = get_args()
    timers = get_timers()

    for model_module in model:
        model_module.train()

    total_loss_dict = {}
    iteration = args.iteration
    num_floating_point_operations_so_far = args.num_floating_point_operations_so_far

    # Hooks the schedules use.
    config.grad_scale_func = optimizer.scale_loss
    config.timers = timers
    if args.overlap_grad_reduce and hasattr(model[0], 'no_sync'):
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

    if args.log_straggler:
        configure_straggler_detector(args)
    total_flops = 0.0

    timers('interval-time', log_level=0).start(barrier=True)
    print_datetime('before the start of training step')
    report_memory_flag = True
    exit = False

    if args.manual_gc:
        gc.disable()
        gc.collect()

    while iteration < args.train_iters:
        update_num_microbatches(args.consumed_train_samples, consistency_check=True)
        args.curr_iteration = iteration
        # The iteration's deadline covers the step and what follows it (logging, saving).
        progress('training iteration', iteration + 1)
        scale_before_step = optimizer.get_loss_scale().item()
        loss_dict, skipped_iter, grad_norm, num_zeros_in_grad = train_step(
            forward_step_func, train_data_iterator, model, optimizer, opt_param_scheduler, config
        )
        _check_overflow_is_not_a_real_nan(args, iteration + 1, skipped_iter, scale_before_step)
        iteration += 1
        batch_size = (
            mpu.get_data_parallel_world_size() * args.micro_batch_size * get_num_microbatches()
        )
        args.consumed_train_samples += batch_size
        num_fp_ops = num_floating_point_operations(args, batch_size)
        num_floating_point_operations_so_far += num_fp_ops
        total_flops += num_fp_ops
        if train_losses is not None and loss_dict:
            train_losses[iteration] = {k: float(v) for k, v in loss_dict.items()}
        check_weight_hashes(args, iteration, model)

        loss_scale = optimizer.get_loss_scale().item()
        params_norm = None
        if args.log_params_norm:
            params_norm = calc_params_l2_norm(model)
        learning_rate = None
        for param_group in optimizer.param_groups:
            if not param_group.get('is_decoupled_lr', False):
                learning_rate = param_group['lr']
        report_memory_flag = training_log(
            loss_dict,
            total_loss_dict,
            learning_rate,
            iteration,
            loss_scale,
            report_memory_flag,
            skipped_iter,
            grad_norm,
            params_norm,
            num_zeros_in_grad,
        )
        if args.log_straggler and iteration % args.log_interval == 0:
            stimer.report(total_flops, args.log_interval)
            total_flops = 0.0

        if args.eval_interval and iteration % args.eval_interval == 0 and args.do_valid:
            if args.manual_gc and args.manual_gc_eval:
                gc.collect()  # everything, before evaluation
            prefix = 'iteration {}'.format(iteration)
            evaluate_and_print_results(
                prefix,
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

        # Checkpointing and exiting.
        saved_checkpoint = False
        if args.exit_signal_handler:
            signal_handler = get_signal_handler()
            if any(signal_handler.signals_received()):
                save_checkpoint_and_time(
                    iteration,
                    model,
                    optimizer,
                    opt_param_scheduler,
                    num_floating_point_operations_so_far,
                )
                print_datetime('exiting program after receiving SIGTERM.')
                exit = True
                break
        if args.save and args.save_interval and iteration % args.save_interval == 0:
            save_checkpoint_and_time(
                iteration,
                model,
                optimizer,
                opt_param_scheduler,
                num_floating_point_operations_so_far,
            )
            saved_checkpoint = True
        if args.exit_duration_in_mins:
            train_time = (time.time() - _TRAIN_START_TIME) / 60.0
            if _exit_flag(train_time > args.exit_duration_in_mins):
                if args.save and not saved_checkpoint:
                    save_checkpoint_and_time(
                        iteration,
                        model,
                        optimizer,
                        opt_param_scheduler,
                        num_floating_point_operations_so_far,
                    )
                print_datetime('exiting program after {} minutes'.format(train_time))
                exit = True
                break
        if args.exit_interval and iteration % args.exit_interval == 0:
            if args.save and not saved_checkpoint:
                save_checkpoint_and_time(
                    iteration,
                    model,
                    optimizer,
                    opt_param_scheduler,
                    num_floating_point_operations_so_far,
                )
            torch.distributed.barrier()
            print_datetime('exiting program at iteration {}'.format(iteration))
            exit = True
            break
        if (
            args.manual_gc
            and args.manual_gc_interval != 0
            and iteration % args.manual_gc_interval == 0
        ):
            gc.collect()

    progress('after training', iteration, deadline=False)
    timers('interval-time').stop()
    if args.manual_gc:
        gc.enable()
    if exit:
        args.do_valid = False
        args.do_test = False
    return iteration, num_floating_point_operations_so_far


def evaluate(
    forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose=False
):
    """Average each loss over --eval-iters global batches (forward only).

    Returns:
        (total_loss_dict, collected_non_loss_data, timelimit_hit); losses are tensors on the last
        pipeline stage.
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    args = get_args()
    timers = get_timers()
    timers('evaluate', log_level=0).start(barrier=True)

    for model_module in model:
        model_module.eval()

    total_loss_dict = {}
    eval_batch_size = args.global_batch_size
    eval_num_microbatches = eval_batch_size // (args.micro_batch_size * args.data_parallel_size)
    device = get_current_device()

    with torch.no_grad():
        iteration = 0
        if verbose:
            print_rank_0(f'Evaluating on {args.eval_iters * eval_batch_size} samples')
        while iteration < args.eval_iters:
            iteration += 1
            if verbose:
                print_rank_0(f'Evaluating iter {iteration}/{args.eval_iters}')
            forward_backward_func = get_forward_backward_func()
            # Don't care about timing during evaluation.
            config.timers = None
            loss_dicts = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=eval_num_microbatches,
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
            )
            config.timers = get_timers()
            empty_unused_memory(args, level=1)
            if mpu.is_pipeline_last_stage(ignore_virtual=True):
                for loss_dict in loss_dicts:
                    for key in loss_dict:
                        if key not in total_loss_dict:
                            total_loss_dict[key] = torch.tensor(
                                [0.0, 0.0], dtype=torch.float, device=device
                            )
                        val = loss_dict[key]
                        if isinstance(val, (tuple, list)):
                            total_loss_dict[key][0] += val[0]
                            total_loss_dict[key][1] += val[1]
                        else:
                            total_loss_dict[key][0] += val
                            total_loss_dict[key][1] += 1
            args.consumed_valid_samples += eval_batch_size

            if args.exit_duration_in_mins:
                train_time = (time.time() - _TRAIN_START_TIME) / 60.0
                if _exit_flag(train_time > args.exit_duration_in_mins):
                    print_rank_0('Exiting during evaluation, timelimit reached')
                    return None, None, True

        collected_non_loss_data = None
        if process_non_loss_data_func is not None and mpu.is_pipeline_last_stage(
            ignore_virtual=True
        ):
            collected_non_loss_data = forward_backward_func(
                forward_step_func=forward_step_func,
                data_iterator=data_iterator,
                model=model,
                num_microbatches=get_num_microbatches(),
                seq_length=args.seq_length,
                micro_batch_size=args.micro_batch_size,
                decoder_seq_length=args.decoder_seq_length,
                forward_only=True,
                collect_non_loss_data=True,
            )

    for model_module in model:
        model_module.train()

    for key in total_loss_dict:
        numerator, denominator = total_loss_dict[key]
        total_loss_dict[key] = numerator / denominator

    timers('evaluate').stop()
    timers.log(['evaluate'])
    return total_loss_dict, collected_non_loss_data, False


def format_validation_line(prefix, losses):
    """The ' validation loss at ... | lm loss value: ... | lm loss PPL: ... | ' string."""
    string = ' validation loss at {} | '.format(prefix)
    for key, value in losses.items():
        string += '{} value: {:.6E} | '.format(key, value)
        string += '{} PPL: {:.6E} | '.format(key, math.exp(min(20, value)))
    return string


def evaluate_and_print_results(
    prefix,
    forward_step_func,
    data_iterator,
    model,
    iteration,
    process_non_loss_data_func,
    config,
    verbose=False,
    write_to_tensorboard=True,
):
    """Evaluate, print Megatron's validation block and write TensorBoard scalars.

    Returns:
        {key: float} on the last pipeline stage, {} elsewhere, None if the time limit was hit.
    """
    args = get_args()
    writer = get_tensorboard_writer() if write_to_tensorboard else None

    with watch('evaluation', iteration):
        total_loss_dict, collected_non_loss_data, timelimit = evaluate(
            forward_step_func, data_iterator, model, process_non_loss_data_func, config, verbose
        )
    if timelimit:
        return None
    losses = {key: float(value) for key, value in total_loss_dict.items()}
    string = format_validation_line(prefix, losses)
    for key, value in losses.items():
        ppl = math.exp(min(20, value))
        if writer:
            writer.add_scalar('{} validation'.format(key), value, iteration)
            writer.add_scalar(
                '{} validation vs samples'.format(key), value, args.consumed_train_samples
            )
            if args.log_validation_ppl_to_tensorboard:
                writer.add_scalar('{} validation ppl'.format(key), ppl, iteration)
                writer.add_scalar(
                    '{} validation ppl vs samples'.format(key), ppl, args.consumed_train_samples
                )
    if process_non_loss_data_func is not None and writer and collected_non_loss_data is not None:
        process_non_loss_data_func(collected_non_loss_data, iteration, writer)

    length = len(string) + 1
    print_rank_last('-' * length)
    print_rank_last(string)
    print_rank_last('-' * length)
    return losses


def cyclic_iter(iter):
    """Iterate over `iter` forever."""
    while True:
        for x in iter:
            yield x


def get_train_valid_test_num_samples():
    """[train, valid, test] sample counts to build (Megatron's formulas)."""
    args = get_args()
    if args.train_samples:
        train_samples = args.train_samples
    else:
        train_samples = args.train_iters * args.global_batch_size
    eval_iters = (args.train_iters // args.eval_interval + 1) * args.eval_iters
    test_iters = args.eval_iters
    return (
        train_samples,
        eval_iters * args.global_batch_size,
        test_iters * args.global_batch_size,
    )


def build_train_valid_test_datasets(build_train_valid_test_datasets_provider):
    """Call the provider with the sample counts (printed as Megatron does)."""
    train_valid_test_num_samples = get_train_valid_test_num_samples()
    print_rank_0(' > datasets target sizes (minimum size):')
    print_rank_0('    train:      {}'.format(train_valid_test_num_samples[0]))
    print_rank_0('    validation: {}'.format(train_valid_test_num_samples[1]))
    print_rank_0('    test:       {}'.format(train_valid_test_num_samples[2]))
    return build_train_valid_test_datasets_provider(train_valid_test_num_samples)


def build_train_valid_test_data_loaders(build_train_valid_test_datasets_provider):
    """Datasets -> data loaders (on TP rank 0, or every rank for distributed-aware providers)."""
    from megatron.training.datasets.data_samplers import build_pretraining_data_loader

    args = get_args()
    train_dataloader, valid_dataloader, test_dataloader = None, None, None
    print_rank_0('> building train, validation, and test datasets ...')

    # Backward compatibility: assume fixed batch size.
    if args.iteration > 0 and args.consumed_train_samples == 0:
        if args.train_samples is not None:
            raise ValueError(
                'checkpoint without consumed_train_samples cannot resume --train-samples runs'
            )
        args.consumed_train_samples = args.iteration * args.global_batch_size
    if args.iteration > 0 and args.consumed_valid_samples == 0:
        if args.train_samples is None:
            args.consumed_valid_samples = (
                (args.iteration // args.eval_interval) * args.eval_iters * args.global_batch_size
            )

    is_distributed = getattr(build_train_valid_test_datasets_provider, 'is_distributed', False)
    device = get_current_device()
    if is_distributed or mpu.get_tensor_model_parallel_rank() == 0:
        train_ds, valid_ds, test_ds = build_train_valid_test_datasets(
            build_train_valid_test_datasets_provider
        )
        train_dataloader = build_pretraining_data_loader(train_ds, args.consumed_train_samples)
        if args.eval_iters == 0:
            # No evaluation: validation/test sets were asked for 0 samples (a mock set then has
            # none), and a loader over them would never be read.
            valid_dataloader = test_dataloader = None
        else:
            if args.skip_train:
                valid_dataloader = build_pretraining_data_loader(valid_ds, 0)
            else:
                valid_dataloader = build_pretraining_data_loader(
                    valid_ds, args.consumed_valid_samples
                )
            test_dataloader = build_pretraining_data_loader(test_ds, 0)
        do_train = train_dataloader is not None and args.train_iters > 0
        do_valid = valid_dataloader is not None and args.eval_iters > 0
        do_test = test_dataloader is not None and args.eval_iters > 0
        flags = torch.tensor(
            [int(do_train), int(do_valid), int(do_test)], dtype=torch.long, device=device
        )
    else:
        flags = torch.tensor([0, 0, 0], dtype=torch.long, device=device)

    torch.distributed.broadcast(flags, 0)
    # With virtual pipelines this runs once per model chunk and a chunk's provider may build no
    # dataset on global rank 0 (Megatron's is_dataset_built_on_rank), so the flags accumulate.
    args.do_train = getattr(args, 'do_train', False) or bool(flags[0].item())
    _check_training_data(args, do_train=args.do_train)
    args.do_valid = getattr(args, 'do_valid', False) or bool(flags[1].item())
    args.do_test = getattr(args, 'do_test', False) or bool(flags[2].item())
    return train_dataloader, valid_dataloader, test_dataloader


def _check_training_data(args, do_train):
    """Refuse a run that asks for training iterations but whose data yields no training samples
    (Megatron would run zero iterations and exit 0). Same decision on every rank (broadcast)."""
    if do_train or args.skip_train or not args.train_iters:
        return
    if args.iteration >= args.train_iters:
        return  # resumed at or past the end: nothing left to train
    split = '' if args.train_data_path else f' (--split {args.split})'
    raise ValueError(
        f'the training data yields no samples{split}, but --train-iters {args.train_iters} asks '
        f'for training; give the training split a share of the data, or use --skip-train to only '
        f'evaluate'
    )


def build_train_valid_test_data_iterators(build_train_valid_test_datasets_provider):
    """Data iterators for train/valid/test ('single': one pass; 'cyclic': repeat; 'external': as
    is)."""
    args = get_args()
    train_dataloader, valid_dataloader, test_dataloader = build_train_valid_test_data_loaders(
        build_train_valid_test_datasets_provider
    )
    dl_type = args.dataloader_type
    if dl_type not in ('single', 'cyclic', 'external'):
        raise ValueError(f'--dataloader-type must be single, cyclic or external, got {dl_type}')

    def _get_iterator(dataloader_type, dataloader):
        if dataloader_type == 'single':
            return iter(dataloader)
        if dataloader_type == 'cyclic':
            return iter(cyclic_iter(dataloader))
        # External dataloader is passed through. User is expected to define how to iterate.
        return dataloader

    train_data_iterator = (
        _get_iterator(dl_type, train_dataloader) if train_dataloader is not None else None
    )
    valid_data_iterator = (
        _get_iterator(dl_type, valid_dataloader) if valid_dataloader is not None else None
    )
    test_data_iterator = (
        _get_iterator(dl_type, test_dataloader) if test_dataloader is not None else None
    )
    return train_data_iterator, valid_data_iterator, test_data_iterator
