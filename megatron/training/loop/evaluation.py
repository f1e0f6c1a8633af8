"""Evaluation on the validation and test sets: losses averaged over --eval-iters global batches.

`evaluate` runs the forward passes; `evaluate_and_print_results` prints Megatron's validation block
(`format_validation_line`) and writes the TensorBoard scalars. The training loop calls it every
--eval-interval iterations, and pretrain() once more for the final validation and test evaluation.
"""

import math
import time

import torch

from megatron.core import parallel_state as mpu
from megatron.core.num_microbatches_calculator import get_num_microbatches
from megatron.core.utils import get_current_device
from megatron.training.global_vars import get_args, get_tensorboard_writer, get_timers
from megatron.training.logging.scalar_writers import get_scalar_writer
from megatron.training.run_control.rerun_training import evaluation_without_reruns
from megatron.training.run_control.time_limit import _exit_flag, get_train_start_time
from megatron.training.run_control.watchdog import watch
from megatron.training.utils import empty_unused_memory, print_rank_0, print_rank_last


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

    with torch.no_grad(), evaluation_without_reruns():
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
                train_time = (time.time() - get_train_start_time()) / 60.0
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
    writer = get_scalar_writer() if write_to_tensorboard else None

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
    tensorboard = get_tensorboard_writer() if write_to_tensorboard else None
    collected = collected_non_loss_data is not None
    if process_non_loss_data_func is not None and tensorboard and collected:
        process_non_loss_data_func(collected_non_loss_data, iteration, tensorboard)

    length = len(string) + 1
    print_rank_last('-' * length)
    print_rank_last(string)
    print_rank_last('-' * length)
    return losses
