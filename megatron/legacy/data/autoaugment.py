"""AutoAugment's ImageNet policy (Cubuk et al., 2019) in Pillow, as Megatron's classification
training pipeline applies it after the colour jitter (`megatron/legacy/data/autoaugment.py`,
`ImageNetPolicy`).

The policy is 25 sub-policies; each image gets one, chosen uniformly, and a sub-policy is two
operations, each applied with its own probability at one of ten magnitude levels. The table
(probabilities, operations, levels) and the magnitude ranges are the published policy's. Like the
other transforms here it is a callable `(img, rng) -> img` drawing every random number from the
per-sample `numpy.random.Generator` (the operation's sign included), so it is deterministic per
(seed, epoch, sample); Megatron draws from Python's global `random`.

Grayscale images go through the same operations in their own mode (the rotation's grey fill
and `ImageOps` work on 'L' as on 'RGB').
"""

from typing import Callable, Dict, Sequence, Tuple

import numpy as np
from PIL import Image, ImageEnhance, ImageOps

#: Operation -> the magnitude of each of the ten levels.
MAGNITUDES: Dict[str, Sequence] = {
    'shearX': np.linspace(0, 0.3, 10),
    'shearY': np.linspace(0, 0.3, 10),
    'translateX': np.linspace(0, 150 / 331, 10),
    'translateY': np.linspace(0, 150 / 331, 10),
    'rotate': np.linspace(0, 30, 10),
    'color': np.linspace(0.0, 0.9, 10),
    'posterize': np.round(np.linspace(8, 4, 10), 0).astype(int),
    'solarize': np.linspace(256, 0, 10),
    'contrast': np.linspace(0.0, 0.9, 10),
    'sharpness': np.linspace(0.0, 0.9, 10),
    'brightness': np.linspace(0.0, 0.9, 10),
    'autocontrast': [0] * 10,
    'equalize': [0] * 10,
    'invert': [0] * 10,
}

#: The ImageNet policy: (probability, operation, level) pairs, one row per sub-policy.
IMAGENET_POLICY: Tuple[Tuple[float, str, int, float, str, int], ...] = (
    (0.4, 'posterize', 8, 0.6, 'rotate', 9),
    (0.6, 'solarize', 5, 0.6, 'autocontrast', 5),
    (0.8, 'equalize', 8, 0.6, 'equalize', 3),
    (0.6, 'posterize', 7, 0.6, 'posterize', 6),
    (0.4, 'equalize', 7, 0.2, 'solarize', 4),
    (0.4, 'equalize', 4, 0.8, 'rotate', 8),
    (0.6, 'solarize', 3, 0.6, 'equalize', 7),
    (0.8, 'posterize', 5, 1.0, 'equalize', 2),
    (0.2, 'rotate', 3, 0.6, 'solarize', 8),
    (0.6, 'equalize', 8, 0.4, 'posterize', 6),
    (0.8, 'rotate', 8, 0.4, 'color', 0),
    (0.4, 'rotate', 9, 0.6, 'equalize', 2),
    (0.0, 'equalize', 7, 0.8, 'equalize', 8),
    (0.6, 'invert', 4, 1.0, 'equalize', 8),
    (0.6, 'color', 4, 1.0, 'contrast', 8),
    (0.8, 'rotate', 8, 1.0, 'color', 2),
    (0.8, 'color', 8, 0.8, 'solarize', 7),
    (0.4, 'sharpness', 7, 0.6, 'invert', 8),
    (0.6, 'shearX', 5, 1.0, 'equalize', 9),
    (0.4, 'color', 0, 0.6, 'equalize', 3),
    (0.4, 'equalize', 7, 0.2, 'solarize', 4),
    (0.6, 'solarize', 5, 0.6, 'autocontrast', 5),
    (0.6, 'invert', 4, 1.0, 'equalize', 8),
    (0.6, 'color', 4, 1.0, 'contrast', 8),
    (0.8, 'equalize', 8, 0.6, 'equalize', 3),
)

_GREY = 128


def _fill(img: Image.Image):
    return _GREY if img.mode == 'L' else (_GREY,) * len(img.getbands())


def _affine(img: Image.Image, coefficients) -> Image.Image:
    bicubic = Image.Resampling.BICUBIC
    return img.transform(
        img.size, Image.Transform.AFFINE, coefficients, bicubic, fillcolor=_fill(img)
    )


def _rotate(img: Image.Image, degrees: float) -> Image.Image:
    # Rotate with an alpha channel, then lay the result over grey: the corners the rotation
    # uncovers are grey, as in the published implementation.
    rotated = img.convert('RGBA').rotate(degrees)
    grey = Image.new('RGBA', rotated.size, (_GREY,) * 4)
    return Image.composite(rotated, grey, rotated).convert(img.mode)


def _enhance(enhancer) -> Callable:
    return lambda img, m, sign: enhancer(img).enhance(1 + m * sign)


#: Operation -> f(img, magnitude, sign) with sign in {-1, +1} (used by the signed operations).
OPERATIONS: Dict[str, Callable] = {
    'shearX': lambda img, m, sign: _affine(img, (1, m * sign, 0, 0, 1, 0)),
    'shearY': lambda img, m, sign: _affine(img, (1, 0, 0, m * sign, 1, 0)),
    'translateX': lambda img, m, sign: _affine(img, (1, 0, m * img.size[0] * sign, 0, 1, 0)),
    'translateY': lambda img, m, sign: _affine(img, (1, 0, 0, 0, 1, m * img.size[1] * sign)),
    'rotate': lambda img, m, sign: _rotate(img, m * sign),
    'color': _enhance(ImageEnhance.Color),
    'posterize': lambda img, m, sign: ImageOps.posterize(img, int(m)),
    'solarize': lambda img, m, sign: ImageOps.solarize(img, m),
    'contrast': _enhance(ImageEnhance.Contrast),
    'sharpness': _enhance(ImageEnhance.Sharpness),
    'brightness': _enhance(ImageEnhance.Brightness),
    'autocontrast': lambda img, m, sign: ImageOps.autocontrast(img),
    'equalize': lambda img, m, sign: ImageOps.equalize(img),
    'invert': lambda img, m, sign: ImageOps.invert(img),
}


def apply_operation(img: Image.Image, name: str, level: int, sign: int) -> Image.Image:
    """Operation `name` at magnitude level `level` (0-9); `sign` flips the signed ones."""
    return OPERATIONS[name](img, MAGNITUDES[name][level], sign)


class ImageNetPolicy:
    """Pick one of the 25 sub-policies uniformly and apply its two operations, each with its
    probability (one sign drawn per applied operation)."""

    def __init__(self, policy=IMAGENET_POLICY):
        self.policy = policy

    def __call__(self, img: Image.Image, rng) -> Image.Image:
        p1, op1, level1, p2, op2, level2 = self.policy[rng.integers(len(self.policy))]
        for probability, name, level in ((p1, op1, level1), (p2, op2, level2)):
            if rng.random() < probability:
                img = apply_operation(img, name, level, 1 if rng.random() < 0.5 else -1)
        return img
