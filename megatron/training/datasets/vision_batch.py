"""Batch and dataset helpers shared by the vision entry scripts (pretrain_vision_*.py)."""

from typing import List, Tuple

import torch

from megatron.core.utils import get_current_device


def image_batch(data_iterator, second_dtype=torch.int64) -> Tuple[torch.Tensor, torch.Tensor]:
    """The next (images [b, c, h, w] float, labels [b] int64 or masks [b, 1, h, w]) on this
    rank's device."""
    images, second = next(data_iterator)
    device = get_current_device()
    return images.to(device, non_blocking=True), second.to(device, second_dtype)


def vision_datasets(args, pretraining_type: str):
    """(train, valid, None) of --data-path for one vision script, built from the vision flags
    (megatron.legacy.data.vit_dataset); prints Megatron's progress lines."""
    from megatron.legacy.data.vit_dataset import build_train_valid_datasets
    from megatron.training.utils import print_rank_0

    print_rank_0('> building train, validation, and test datasets for VIT ...')
    train_ds, valid_ds = build_train_valid_datasets(
        data_path=args.data_path,
        image_size=(args.img_h, args.img_w),
        num_channels=args.num_channels,
        classes_fraction=args.classes_fraction,
        data_per_class_fraction=args.data_per_class_fraction,
        seed=args.seed,
        augment=args.image_augmentation,
        pretraining_type=pretraining_type,
        patch_dim=args.patch_dim,
        mask_factor=args.mask_factor,
        mask_type=args.mask_type,
        local_img_size=args.dino_local_img_size,
        local_crops_number=args.dino_local_crops_number,
    )
    if pretraining_type == 'classify':
        check_class_count(args, train_ds.classes)
    print_rank_0('> finished creating VIT datasets ...')
    return train_ds, valid_ds, None


def check_class_count(args, classes: List[str]) -> None:
    """--num-classes must equal the class folders found in the data."""
    if len(classes) != args.num_classes:
        shown = ', '.join(classes[:10]) + (' ...' if len(classes) > 10 else '')
        raise ValueError(
            f"--num-classes {args.num_classes} does not match the data: the image folders hold "
            f"{len(classes)} classes ({shown})"
        )
