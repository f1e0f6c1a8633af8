"""AutoAugment's ImageNet policy (megatron/legacy/data/autoaugment.py): the published table,
each operation against a plain numpy reference, determinism per generator, and its place in the
classification training pipeline."""

import numpy as np
import pytest
from PIL import Image

from megatron.legacy.data import autoaugment as AA
from megatron.legacy.data import image_transforms as T


def _image(mode='RGB', size=(24, 16), seed=0):
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0], 3) if mode == 'RGB' else (size[1], size[0])
    return Image.fromarray(rng.integers(0, 256, shape, np.uint8), mode)


def test_the_published_table():
    assert len(AA.IMAGENET_POLICY) == 25
    for p1, op1, level1, p2, op2, level2 in AA.IMAGENET_POLICY:
        assert op1 in AA.OPERATIONS and op2 in AA.OPERATIONS
        assert 0 <= level1 <= 9 and 0 <= level2 <= 9 and 0 <= p1 <= 1 and 0 <= p2 <= 1
    assert list(AA.MAGNITUDES['posterize']) == [8, 8, 7, 7, 6, 6, 5, 5, 4, 4]
    assert AA.MAGNITUDES['solarize'][0] == 256 and AA.MAGNITUDES['solarize'][-1] == 0
    assert AA.MAGNITUDES['rotate'][-1] == 30
    assert AA.MAGNITUDES['translateX'][-1] == pytest.approx(150 / 331)


@pytest.mark.parametrize('mode', ['RGB', 'L'])
def test_pixel_operations_against_numpy(mode):
    img = _image(mode)
    x = np.asarray(img).astype(np.int32)
    invert = np.asarray(AA.apply_operation(img, 'invert', 0, 1))
    assert np.array_equal(invert, 255 - x)
    # level 6 -> 5 bits kept
    posterized = np.asarray(AA.apply_operation(img, 'posterize', 6, 1))
    assert np.array_equal(posterized, x & 0b11111000)
    threshold = AA.MAGNITUDES['solarize'][5]
    solarized = np.asarray(AA.apply_operation(img, 'solarize', 5, 1))
    assert np.array_equal(solarized, np.where(x >= threshold, 255 - x, x))
    # level 0 of solarize (threshold 256) and of the enhancers (factor 1) change nothing
    for name in ('solarize', 'color', 'contrast', 'sharpness', 'brightness'):
        assert np.array_equal(np.asarray(AA.apply_operation(img, name, 0, -1)), x)


def test_translate_shifts_by_the_magnitude_and_fills_grey():
    img = _image('RGB', size=(331, 4))
    x = np.asarray(img)
    out = np.asarray(AA.apply_operation(img, 'translateX', 9, 1))  # 150 pixels
    assert np.array_equal(out[:, : 331 - 150], x[:, 150:])
    assert (out[:, 331 - 150 :] == 128).all()


def test_rotation_fills_the_uncovered_corners_grey():
    black = Image.new('RGB', (32, 32))
    out = np.asarray(AA.apply_operation(black, 'rotate', 9, 1))  # 30 degrees
    assert (out[0, 0] == 128).all() and (out[16, 16] == 0).all()


def test_policy_is_deterministic_per_generator_and_uses_the_probabilities():
    img = _image()
    policy = AA.ImageNetPolicy()
    runs = [np.asarray(policy(img, np.random.default_rng(seed))) for seed in (3, 3, 4, 5, 6, 7)]
    assert np.array_equal(runs[0], runs[1])
    assert any(not np.array_equal(runs[0], other) for other in runs[2:])
    always = AA.ImageNetPolicy(policy=((1.0, 'invert', 0, 0.0, 'equalize', 0),))
    for seed in range(5):
        out = np.asarray(always(img, np.random.default_rng(seed)))
        assert np.array_equal(out, 255 - np.asarray(img))


def test_classification_training_pipeline_applies_the_policy():
    names = [type(t).__name__ for t in T.classification_transform((16, 16), True).transforms]
    assert names.index('ImageNetPolicy') == names.index('ColorJitter') + 1
    no_augment = T.classification_transform((16, 16), True, augment=False).transforms
    assert 'ImageNetPolicy' not in [type(t).__name__ for t in no_augment]
    assert 'ImageNetPolicy' not in [
        type(t).__name__ for t in T.classification_transform((16, 16), False).transforms
    ]
