"""Fine-tuning machinery shared by the tasks, as in Megatron's tasks/finetune_utils.py."""

import torch

from megatron.core import parallel_state as mpu


def build_data_loader(dataset, micro_batch_size, num_workers, drop_last, task_collate_fn=None):
    """A loader over this data-parallel rank's share of the dataset.

    The sampler is torch's DistributedSampler over the data-parallel group (shuffle on, seed 0,
    the index list padded to a multiple of the DP size), as in Megatron.
    """
    world_size = mpu.get_data_parallel_world_size()
    rank = mpu.get_data_parallel_rank()
    sampler = torch.utils.data.distributed.DistributedSampler(
        dataset, num_replicas=world_size, rank=rank
    )
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        shuffle=False,
        num_workers=num_workers,
        drop_last=drop_last,
        pin_memory=torch.cuda.is_available(),
        collate_fn=task_collate_fn,
    )


def _cross_entropy_loss_func(labels, output_tensor):
    """Mean cross-entropy over the batch (fp32 logits), logged as 'lm loss' averaged over DP."""
    from megatron.training.utils import average_losses_across_data_parallel_group

    logits = output_tensor.contiguous().float()
    loss = torch.nn.functional.cross_entropy(logits, labels)
    averaged_loss = average_losses_across_data_parallel_group([loss])
    return loss, {'lm loss': averaged_loss[0]}


def process_batch(batch):
    """(tokens, types, labels, padding_mask) of a loader batch, on the device."""
    from megatron.core.utils import get_current_device

    device = get_current_device()
    tokens = batch['text'].long().to(device)
    types = batch['types'].long().to(device)
    labels = batch['label'].long().to(device)
    padding_mask = batch['padding_mask'].long().to(device)
    return tokens, types, labels, padding_mask


def _forward_step(data_iterator, model):
    """Forward one batch (the iterator yields loader batches); returns (logits, loss function)."""
    from functools import partial

    batch = next(data_iterator)
    tokens, types, labels, padding_mask = process_batch(batch)
    output_tensor = model(tokens, padding_mask, tokentype_ids=types)
    return output_tensor, partial(_cross_entropy_loss_func, labels)


def _set_batch_sizes(args, micro_batch_size, global_batch_size):
    """Set the micro/global batch sizes and the microbatch calculator to match."""
    from megatron.core.num_microbatches_calculator import reconfigure_num_microbatches_calculator

    args.micro_batch_size = micro_batch_size
    args.global_batch_size = global_batch_size
    reconfigure_num_microbatches_calculator(
        args.rank, None, global_batch_size, micro_batch_size, args.data_parallel_size
    )


def _build_train_valid_dataloaders(train_dataset, valid_dataset):
    """Loaders; sets train_iters = epochs x batches per epoch, and multiplies the batch sizes by
    the dataset's sample_multiplier (RACE: 4 rows per question)."""
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    print_rank_0('building train and validation dataloaders ...')
    train_dataloader = build_data_loader(
        train_dataset, args.micro_batch_size, args.num_workers, not args.keep_last
    )
    args.train_iters_per_epoch = len(train_dataloader)
    args.train_iters = args.epochs * args.train_iters_per_epoch
    if args.train_iters_per_epoch == 0:
        raise ValueError(
            f'--train-data: {len(train_dataset)} samples make no batch of '
            f'--micro-batch-size {args.micro_batch_size} per data-parallel rank '
            f'(use --keep-last or a smaller batch)'
        )
    valid_dataloader_ = build_data_loader(
        valid_dataset, args.micro_batch_size, args.num_workers, not args.keep_last
    )
    valid_dataloader = _cyclic(valid_dataloader_)
    if hasattr(train_dataset, 'sample_multiplier'):
        m = train_dataset.sample_multiplier
        _set_batch_sizes(args, args.micro_batch_size * m, args.global_batch_size * m)
    return train_dataloader, valid_dataloader


def _cyclic(dataloader):
    while True:
        for x in dataloader:
            yield x


def _train(
    model,
    optimizer,
    opt_param_scheduler,
    forward_step,
    train_dataloader,
    valid_dataloader,
    end_of_epoch_callback,
):
    """Epoch loop on the core train_step; per epoch: save (with --save), then the callback."""
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.num_microbatches_calculator import get_num_microbatches
    from megatron.core.utils import get_model_config
    from megatron.training.checkpointing import save_checkpoint
    from megatron.training.global_vars import get_args, get_timers
    from megatron.training.training import evaluate_and_print_results, train_step, training_log
    from megatron.training.utils import calc_params_l2_norm, print_rank_0

    args = get_args()
    assert get_num_microbatches() == 1, 'fine-tuning does not support gradient accumulation'
    config = get_model_config(model[0])
    config.grad_scale_func = optimizer.scale_loss
    config.finalize_model_grads_func = finalize_model_grads
    for m in model:
        m.train()
    get_timers()('interval-time', log_level=0).start(barrier=True)
    losses_dict_sum = {}
    start_epoch = args.iteration // args.train_iters_per_epoch
    start_iteration = args.iteration % args.train_iters_per_epoch
    iteration = args.iteration
    report_memory_flag = True
    for epoch in range(start_epoch, args.epochs):
        print_rank_0('working on epoch {} ...'.format(epoch + 1))
        train_dataloader.sampler.set_epoch(args.seed + epoch)
        for iteration_, batch in enumerate(train_dataloader):
            if iteration_ < start_iteration:
                continue
            start_iteration = 0
            args.curr_iteration = iteration
            out = train_step(
                forward_step, iter([batch]), model, optimizer, opt_param_scheduler, config
            )
            losses_dict, skipped_iter, grad_norm, num_zeros_in_grad = out
            iteration += 1
            args.consumed_train_samples += args.global_batch_size
            params_norm = calc_params_l2_norm(model) if args.log_params_norm else None
            report_memory_flag = training_log(
                losses_dict,
                losses_dict_sum,
                optimizer.param_groups[0]['lr'],
                iteration,
                optimizer.get_loss_scale().item(),
                report_memory_flag,
                skipped_iter,
                grad_norm,
                params_norm,
                num_zeros_in_grad,
            )
            if args.save and args.save_interval and iteration % args.save_interval == 0:
                save_checkpoint(iteration, model, optimizer, opt_param_scheduler, 0)
            if args.eval_interval and iteration % args.eval_interval == 0:
                evaluate_and_print_results(
                    'iteration {}'.format(iteration),
                    forward_step,
                    valid_dataloader,
                    model,
                    iteration,
                    None,
                    config,
                    False,
                )
        if args.save:
            save_checkpoint(iteration, model, optimizer, opt_param_scheduler, 0)
        if end_of_epoch_callback is not None:
            end_of_epoch_callback(model, epoch)
    get_timers()('interval-time').stop()


def _load_pretrained(model, optimizer):
    """Model weights only from --pretrained-checkpoint (iteration, optimizer and LR schedule
    stay fresh); the task head keeps its random init when the checkpoint has none."""
    from megatron.training.checkpointing import load_checkpoint
    from megatron.training.global_vars import get_args
    from megatron.training.utils import print_rank_0

    args = get_args()
    module = model[0].module if hasattr(model[0], 'module') else model[0]
    head_name = getattr(module, 'head_name', None)
    head = getattr(module, head_name, None) if head_name else None
    before = head.weight.detach().clone() if head is not None else None
    saved = (args.finetune, args.no_load_rng)
    args.finetune, args.no_load_rng = True, True
    try:
        # strict=False: the pretrained BERT has LM / sentence-order heads and no task head.
        load_checkpoint(model, None, None, load_arg='pretrained_checkpoint', strict=False)
    finally:
        args.finetune, args.no_load_rng = saved
    if head is not None and torch.equal(before, head.weight.detach()):
        print_rank_0(
            f'***WARNING*** could not find "{head_name}" in the pretrained checkpoint, '
            'initializing it randomly'
        )
    optimizer.reload_model_params()


def finetune(
    train_valid_datasets_provider,
    model_provider,
    model_type,
    forward_step=_forward_step,
    end_of_epoch_callback_provider=None,
):
    """Fine-tune (epochs > 0) or only evaluate (--epochs 0) as Megatron's tasks do."""
    from megatron.training.global_vars import get_args, get_timers
    from megatron.training.training import setup_model_and_optimizer
    from megatron.training.utils import print_rank_0

    args = get_args()
    timers = get_timers()
    if args.rampup_batch_size is not None:
        raise ValueError('--rampup-batch-size is not supported for fine-tuning')
    if args.epochs is None or args.epochs < 0:
        raise ValueError(
            f'--epochs must be given for fine-tuning (>= 0; 0 = evaluation only), got {args.epochs}'
        )
    args.orig_micro_batch_size = args.micro_batch_size
    args.orig_global_batch_size = args.global_batch_size

    timers('train/valid/test dataset/dataloder', log_level=0).start()
    if args.epochs > 0:
        train_dataset, valid_dataset = train_valid_datasets_provider()
        train_dataloader, valid_dataloader = _build_train_valid_dataloaders(
            train_dataset, valid_dataset
        )
    else:
        args.train_iters = 0
    timers('train/valid/test dataset/dataloder').stop()

    end_of_epoch_callback = None
    if end_of_epoch_callback_provider is not None:
        end_of_epoch_callback = end_of_epoch_callback_provider()

    if args.lr is None and args.epochs == 0:
        args.lr = 0.0  # evaluation only: the optimizer is never stepped
    pretrained = args.pretrained_checkpoint
    args.pretrained_checkpoint = None  # loaded below, model weights only
    try:
        model, optimizer, opt_param_scheduler = setup_model_and_optimizer(
            model_provider, model_type
        )
    finally:
        args.pretrained_checkpoint = pretrained
    if args.iteration == 0 and pretrained is not None:
        _load_pretrained(model, optimizer)

    result = {}
    if args.train_iters > 0:
        _train(
            model,
            optimizer,
            opt_param_scheduler,
            forward_step,
            train_dataloader,
            valid_dataloader,
            lambda m, e: (
                result.update({e: end_of_epoch_callback(m, e)}) if end_of_epoch_callback else None
            ),
        )
    elif end_of_epoch_callback is not None:
        print_rank_0('evaluation only mode, setting epoch to -1')
        result[-1] = end_of_epoch_callback(model, epoch=-1)
    print_rank_0('done :-)')
    return result
