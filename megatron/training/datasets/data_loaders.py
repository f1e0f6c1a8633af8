"""Train/validation/test datasets, data loaders and iterators for pretrain().

The dataset provider is called with Megatron's sample counts (`get_train_valid_test_num_samples`);
the data loaders resume at the consumed-sample counters restored from a checkpoint, and the
do_train / do_valid / do_test flags are broadcast from rank 0 so every rank takes the same decision.
"""

import torch

from megatron.core import parallel_state as mpu
from megatron.core.utils import get_current_device
from megatron.training.global_vars import get_args
from megatron.training.utils import print_rank_0


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
