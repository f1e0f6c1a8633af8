"""Image transforms of Megatron's vision scripts in Pillow + numpy (no torchvision).

Each transform is a callable `(img, rng) -> img` where `img` is a PIL image (or, after `ToArray`,
a float32 numpy array [c, h, w]) and `rng` a `numpy.random.Generator`. All randomness comes
from `rng`, which the dataset seeds per (seed, epoch, sample index): the same sample gets the same
crop on every tensor-parallel rank and in every rerun, whatever the worker or process.

The geometry follows torchvision's definitions (RandomResizedCrop's ten area/aspect attempts and
centre-crop fallback, Resize of the shorter side, CenterCrop's rounding, ColorJitter's factor
ranges in a random order), so a Megatron user gets the augmentation they know; the random numbers
themselves differ from torchvision's.
"""

import math
from typing import List, Sequence, Tuple

import numpy as np
from PIL import Image, ImageEnhance, ImageFilter, ImageOps

from megatron.legacy.data.autoaugment import ImageNetPolicy

#: ImageNet statistics in [0, 1] units (Megatron's legacy classification / DINO transforms).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: OpenAI CLIP's pixel statistics (later Megatron's `pixel_statistics['clip']`).
CLIP_PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)

_BILINEAR = Image.Resampling.BILINEAR
_BICUBIC = Image.Resampling.BICUBIC


class Compose:
    """Apply transforms in order, threading the same generator through them."""

    def __init__(self, transforms: Sequence):
        self.transforms = list(transforms)

    def __call__(self, img, rng: np.random.Generator):
        for t in self.transforms:
            img = t(img, rng)
        return img


def random_resized_crop_box(
    width: int,
    height: int,
    rng: np.random.Generator,
    scale: Tuple[float, float] = (0.08, 1.0),
    ratio: Tuple[float, float] = (3.0 / 4.0, 4.0 / 3.0),
) -> Tuple[int, int, int, int]:
    """(top, left, h, w) of a crop covering `scale` of the area with an aspect ratio in `ratio`
    (log-uniform); after ten misses, the largest centred crop whose ratio lies in `ratio`."""
    area = width * height
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if 0 < w <= width and 0 < h <= height:
            top = int(rng.integers(0, height - h + 1))
            left = int(rng.integers(0, width - w + 1))
            return top, left, h, w
    in_ratio = width / height
    if in_ratio < min(ratio):
        w, h = width, int(round(width / min(ratio)))
    elif in_ratio > max(ratio):
        h, w = height, int(round(height * max(ratio)))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


class RandomResizedCrop:
    """Crop a random area / aspect box and resize it to (size, size)."""

    def __init__(self, size: int, scale=(0.08, 1.0), ratio=(3.0 / 4.0, 4.0 / 3.0), bicubic=False):
        self.size, self.scale, self.ratio = size, scale, ratio
        self.resample = _BICUBIC if bicubic else _BILINEAR

    def __call__(self, img: Image.Image, rng):
        top, left, h, w = random_resized_crop_box(
            img.width, img.height, rng, self.scale, self.ratio
        )
        box = (left, top, left + w, top + h)
        return img.resize((self.size, self.size), self.resample, box=box)


class RandomHorizontalFlip:
    """Mirror left-right with probability p."""

    def __init__(self, p: float = 0.5):
        self.p = p

    def __call__(self, img: Image.Image, rng):
        return ImageOps.mirror(img) if rng.random() < self.p else img


class ColorJitter:
    """Brightness, contrast, saturation factors drawn from [1 - x, 1 + x] and a hue shift from
    [-hue, hue] (fraction of the colour wheel), applied in a random order. Saturation and hue
    leave single-channel images unchanged."""

    def __init__(self, brightness=0.0, contrast=0.0, saturation=0.0, hue=0.0):
        self.ranges = {'b': brightness, 'c': contrast, 's': saturation, 'h': hue}

    def __call__(self, img: Image.Image, rng):
        for op in rng.permutation(['b', 'c', 's', 'h']):
            x = self.ranges[op]
            if x <= 0:
                continue
            if op == 'h':
                img = _shift_hue(img, rng.uniform(-x, x))
                continue
            factor = rng.uniform(max(0.0, 1.0 - x), 1.0 + x)
            if op == 'b':
                img = ImageEnhance.Brightness(img).enhance(factor)
            elif op == 'c':
                img = ImageEnhance.Contrast(img).enhance(factor)
            elif img.mode == 'RGB':
                img = ImageEnhance.Color(img).enhance(factor)
        return img


def _shift_hue(img: Image.Image, shift: float) -> Image.Image:
    if img.mode != 'RGB':
        return img
    hsv = np.asarray(img.convert('HSV')).copy()
    hsv[..., 0] = (hsv[..., 0].astype(np.int16) + int(round(shift * 255))) % 256
    return Image.fromarray(hsv, 'HSV').convert('RGB')


class RandomApply:
    """Apply `transform` with probability p."""

    def __init__(self, transform, p: float):
        self.transform, self.p = transform, p

    def __call__(self, img, rng):
        return self.transform(img, rng) if rng.random() < self.p else img


class RandomGrayscale:
    """With probability p, an RGB image becomes gray (kept as 3 equal channels)."""

    def __init__(self, p: float = 0.1):
        self.p = p

    def __call__(self, img: Image.Image, rng):
        if rng.random() >= self.p or img.mode != 'RGB':
            return img
        return img.convert('L').convert('RGB')


class GaussianBlur:
    """With probability p, a Gaussian blur of radius drawn from [radius_min, radius_max]."""

    def __init__(self, p: float = 0.5, radius_min: float = 0.1, radius_max: float = 2.0):
        self.p, self.radius_min, self.radius_max = p, radius_min, radius_max

    def __call__(self, img: Image.Image, rng):
        if rng.random() >= self.p:
            return img
        radius = rng.uniform(self.radius_min, self.radius_max)
        return img.filter(ImageFilter.GaussianBlur(radius=radius))


class Solarization:
    """With probability p, invert the pixels above 128."""

    def __init__(self, p: float = 0.2):
        self.p = p

    def __call__(self, img: Image.Image, rng):
        return ImageOps.solarize(img) if rng.random() < self.p else img


class Resize:
    """Resize the shorter side to `size`, keeping the aspect ratio."""

    def __init__(self, size: int, bicubic: bool = False):
        self.size = size
        self.resample = _BICUBIC if bicubic else _BILINEAR

    def __call__(self, img: Image.Image, rng):
        w, h = img.size
        if w <= h:
            new = (self.size, int(self.size * h / w))
        else:
            new = (int(self.size * w / h), self.size)
        return img if new == (w, h) else img.resize(new, self.resample)


class CenterCrop:
    """The centred (size, size) box."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, img: Image.Image, rng):
        w, h = img.size
        top = int(round((h - self.size) / 2.0))
        left = int(round((w - self.size) / 2.0))
        return img.crop((left, top, left + self.size, top + self.size))


class ToArray:
    """PIL image -> float32 [c, h, w] in [0, 1]."""

    def __call__(self, img: Image.Image, rng):
        arr = np.asarray(img, dtype=np.float32) / 255.0
        if arr.ndim == 2:
            arr = arr[:, :, None]
        return np.ascontiguousarray(arr.transpose(2, 0, 1))  # [h, w, c] -> [c, h, w]


class Normalize:
    """(x - mean) / std per channel of a [c, h, w] array."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = np.asarray(mean, dtype=np.float32)[:, None, None]
        self.std = np.asarray(std, dtype=np.float32)[:, None, None]

    def __call__(self, arr: np.ndarray, rng):
        return (arr - self.mean) / self.std


def mean_std(num_channels: int) -> Tuple[List[float], List[float]]:
    """ImageNet statistics for RGB; their channel average for one-channel (grayscale) data."""
    if num_channels == 3:
        return list(IMAGENET_MEAN), list(IMAGENET_STD)
    return [float(np.mean(IMAGENET_MEAN))], [float(np.mean(IMAGENET_STD))]


def classification_transform(
    image_size: Tuple[int, int], train: bool, num_channels: int = 3, augment: bool = True
) -> Compose:
    """Megatron's classification pipeline: train = RandomResizedCrop, horizontal flip, colour
    jitter (0.4, 0.4, 0.4, 0.1), AutoAugment's ImageNet policy, to array, normalise; validation
    = resize, centre crop, to array, normalise. `augment=False` keeps only the validation
    geometry (for data where flips or heavy crops change the label, such as digits)."""
    h, w = image_size
    if h != w:
        raise ValueError(f"the vision transforms take square images, got --img-h {h} --img-w {w}")
    mean, std = mean_std(num_channels)
    tail = [ToArray(), Normalize(mean, std)]
    if train and augment:
        head = [
            RandomResizedCrop(h),
            RandomHorizontalFlip(),
            ColorJitter(0.4, 0.4, 0.4, 0.1),
            ImageNetPolicy(),
        ]
    else:
        head = [Resize(h), CenterCrop(h)]
    return Compose(head + tail)


def inpainting_transform(image_size: Tuple[int, int], train: bool, augment: bool = True):
    """The inpainting pipeline: the classification geometry without normalisation (pixels stay in
    [0, 1], which the PSNR metric assumes)."""
    h, _ = image_size
    if train and augment:
        return Compose([RandomResizedCrop(h), RandomHorizontalFlip(), ToArray()])
    return Compose([Resize(h), CenterCrop(h), ToArray()])


class DinoMultiCrop:
    """DINO's multi-crop augmentation: 2 global crops (scale 0.4-1) and `local_crops_number`
    local crops (scale 0.05-0.4) of `local_size`, each flipped, colour-jittered (p 0.8) and
    grayed (p 0.2); blur p 1.0 / 0.1 on the two global crops and 0.5 on the local ones; the
    second global crop is solarised with p 0.2. Returns the list of [c, h, w] arrays, global
    crops first."""

    def __init__(
        self,
        global_size: int,
        local_size: int,
        local_crops_number: int,
        num_channels: int = 3,
        augment: bool = True,
    ):
        mean, std = mean_std(num_channels)
        tail = [ToArray(), Normalize(mean, std)]
        if not augment:
            self.views = [Compose([Resize(global_size), CenterCrop(global_size)] + tail)] * 2
            self.views += [Compose([Resize(local_size), CenterCrop(local_size)] + tail)] * (
                local_crops_number
            )
            return
        jitter = [
            RandomHorizontalFlip(0.5),
            RandomApply(ColorJitter(0.4, 0.4, 0.2, 0.1), p=0.8),
            RandomGrayscale(0.2),
        ]

        def crop(size, scale):
            return RandomResizedCrop(size, scale=scale, bicubic=True)

        first = Compose([crop(global_size, (0.4, 1.0))] + jitter + [GaussianBlur(1.0)] + tail)
        second = Compose(
            [crop(global_size, (0.4, 1.0))] + jitter + [GaussianBlur(0.1), Solarization(0.2)] + tail
        )
        local = Compose([crop(local_size, (0.05, 0.4))] + jitter + [GaussianBlur(0.5)] + tail)
        self.views = [first, second] + [local] * local_crops_number

    def __call__(self, img: Image.Image, rng):
        return [view(img, rng) for view in self.views]
