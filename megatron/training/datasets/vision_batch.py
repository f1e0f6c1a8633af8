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


def check_class_count(args, classes: List[str]) -> None:
    """--num-classes must equal the class folders found in the data."""
    if len(classes) != args.num_classes:
        shown = ', '.join(classes[:10]) + (' ...' if len(classes) > 10 else '')
        raise ValueError(
            f"--num-classes {args.num_classes} does not match the data: the image folders hold "
            f"{len(classes)} classes ({shown})"
        )
