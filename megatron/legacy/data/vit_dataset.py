"""Datasets of the vision scripts (Megatron's `megatron/legacy/data/vit_dataset.py` entry point).

`build_train_valid_datasets(data_path, image_size, ...)` reads Megatron's `--data-path` layout:
the training folder is `data_path[0]` (`data_path[2]` when more than two are given) and the
validation folder `data_path[1]`, each an ImageFolder. Samples are `(image [c, h, w] float32
tensor, label)`; for inpainting `(image in [0, 1], mask [1, h, w])` (1 = masked pixel).

Randomness: the datasets subclass `RandomSeedDataset`, so the cyclic sampler hands them the
epoch; each item draws its augmentation from a `numpy.random.Generator` seeded by (seed, epoch,
index) and touches no global RNG. The same index gives the same image on every rank (tensor-
parallel ranks read their batches themselves, without a broadcast) and after a resume.
"""

from typing import List, Sequence, Tuple

import numpy as np
import torch

from megatron.legacy.data.image_folder import ImageFolder
from megatron.legacy.data.image_masks import inpainting_mask
from megatron.legacy.data.image_transforms import (
    DinoMultiCrop,
    classification_transform,
    inpainting_transform,
)
from megatron.training.datasets.data_samplers import RandomSeedDataset


class TransformedImageDataset(RandomSeedDataset):
    """An ImageFolder whose items go through a seeded transform.

    Args:
        folder (ImageFolder): the images.
        transform: callable (PIL image, numpy Generator) -> [c, h, w] float32 array.
        seed (int): base seed (--seed).
        mask_fn: optional callable (numpy Generator) -> [1, h, w] mask; items are then
            (image, mask) instead of (image, label).
    """

    def __init__(self, folder: ImageFolder, transform, seed: int, mask_fn=None):
        super().__init__(folder, seed)
        self.transform = transform
        self.mask_fn = mask_fn

    @property
    def classes(self) -> List[str]:
        return self.dataset.classes

    def __getitem__(self, idx: int):
        img, label = self.dataset[idx]
        epoch = self.curr_seed - self.base_seed
        rng = np.random.default_rng([self.base_seed, epoch, idx])
        out = self.transform(img, rng)
        # DINO's multi-crop gives a list of views.
        image = (
            [torch.from_numpy(v) for v in out] if isinstance(out, list) else torch.from_numpy(out)
        )
        if self.mask_fn is not None:
            return image, torch.from_numpy(self.mask_fn(rng))
        return image, label


def _folders(data_path: Sequence[str]) -> Tuple[str, str]:
    if not data_path or len(data_path) < 2:
        raise ValueError(
            f"--data-path needs a training and a validation image folder, got {list(data_path)}"
        )
    train = data_path[2] if len(data_path) > 2 else data_path[0]
    return train, data_path[1]


def build_train_valid_datasets(
    data_path: Sequence[str],
    image_size: Tuple[int, int],
    num_channels: int = 3,
    classes_fraction: float = 1.0,
    data_per_class_fraction: float = 1.0,
    seed: int = 1234,
    augment: bool = True,
    pretraining_type: str = 'classify',
    patch_dim: int = 16,
    mask_factor: float = 1.0,
    mask_type: str = 'random',
    local_img_size: int = 96,
    local_crops_number: int = 10,
):
    """(train, valid) datasets of `--data-path` for `pretraining_type` classify, inpaint (whose
    masks cover `mask_factor` x the patches, see image_masks.py) or dino (items: the list of 2
    global and `local_crops_number` local views, and the label; validation views are centred
    crops)."""
    train_dir, valid_dir = _folders(data_path)
    train_folder = ImageFolder(train_dir, num_channels, classes_fraction, data_per_class_fraction)
    valid_folder = ImageFolder(valid_dir, num_channels, classes_fraction, data_per_class_fraction)
    if train_folder.classes != valid_folder.classes:
        raise ValueError(
            f"the training folder {train_dir!r} has classes {train_folder.classes[:5]}... and the "
            f"validation folder {valid_dir!r} {valid_folder.classes[:5]}...: they must be equal"
        )
    mask_fn = None
    if pretraining_type == 'inpaint':
        # Megatron gives its training set the validation transform (no augmentation): here the
        # training set is augmented unless --no-image-augmentation.
        train_tf = inpainting_transform(image_size, train=True, augment=augment)
        valid_tf = inpainting_transform(image_size, train=False)

        def mask_fn(rng):
            return inpainting_mask(image_size[0], patch_dim, mask_factor, mask_type, rng)

    elif pretraining_type == 'dino':
        views = (image_size[0], local_img_size, local_crops_number, num_channels)
        train_tf = DinoMultiCrop(*views, augment=augment)
        valid_tf = DinoMultiCrop(*views, augment=False)
    else:
        train_tf = classification_transform(image_size, True, num_channels, augment)
        valid_tf = classification_transform(image_size, False, num_channels)
    train = TransformedImageDataset(train_folder, train_tf, seed, mask_fn)
    valid = TransformedImageDataset(valid_folder, valid_tf, seed, mask_fn)
    return train, valid
