"""The image folder reader, its refusals, the seeded transforms (against plain numpy) and the
digits converter."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from megatron.legacy.data import image_transforms as T
from megatron.legacy.data.image_folder import ImageFolder
from megatron.legacy.data.vit_dataset import build_train_valid_datasets

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _write(path, array, mode):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(array, mode).save(path)


def _folder(root, classes=('cat', 'dog'), per_class=3, mode='RGB', size=12):
    rng = np.random.default_rng(0)
    shape = (size, size, 3) if mode == 'RGB' else (size, size)
    for name in classes:
        for i in range(per_class):
            _write(str(root / name / f'{i}.png'), rng.integers(0, 256, shape, np.uint8), mode)
    return str(root)


def test_reader_classes_samples_and_fractions(tmp_path):
    root = _folder(tmp_path / 'a', classes=('b', 'a', 'c'), per_class=4)
    folder = ImageFolder(root)
    assert folder.classes == ['a', 'b', 'c'] and len(folder) == 12
    img, target = folder[5]
    assert img.mode == 'RGB' and target == 1
    assert folder.samples[5][0].endswith(os.path.join('b', '1.png'))
    part = ImageFolder(root, classes_fraction=0.67, data_per_class_fraction=0.5)
    assert part.classes == ['a', 'b'] and len(part) == 4


@pytest.mark.parametrize(
    'damage, message',
    [
        ('missing', 'does not exist'),
        ('no_classes', 'has no class sub-folders'),
        ('empty_class', "holds no images"),
        ('empty_file', "is empty"),
        ('garbage', 'cannot be decoded'),
        ('gray', r'is grayscale \(1 channel\)'),
    ],
)
def test_reader_refuses_bad_input(tmp_path, damage, message):
    root = tmp_path / 'data'
    if damage != 'missing':
        root.mkdir()
    if damage not in ('missing', 'no_classes'):
        _folder(root)
    bad = root / 'cat' / 'bad.png'
    if damage == 'empty_class':
        (root / 'zebra').mkdir()
    elif damage == 'empty_file':
        bad.write_bytes(b'')
    elif damage == 'garbage':
        bad.write_bytes(b'not a png at all')
    elif damage == 'gray':
        _write(str(bad), np.zeros((12, 12), np.uint8), 'L')
    with pytest.raises(ValueError, match=message) as err:
        ImageFolder(str(root), num_channels=3)
    if damage in ('empty_file', 'garbage', 'gray'):
        assert 'bad.png' in str(err.value)
    assert '\n' not in str(err.value)


def test_reader_refuses_channel_counts(tmp_path):
    root = _folder(tmp_path / 'd')
    with pytest.raises(ValueError, match='--num-channels 4'):
        ImageFolder(root, num_channels=4)
    with pytest.raises(ValueError, match='is colour'):
        ImageFolder(root, num_channels=1)


def test_train_and_valid_classes_must_match(tmp_path):
    train = _folder(tmp_path / 'train', classes=('a', 'b'))
    valid = _folder(tmp_path / 'val', classes=('a', 'c'))
    with pytest.raises(ValueError, match='must be equal'):
        build_train_valid_datasets([train, valid], (8, 8))


def _numpy_reference(img: Image.Image, mean, std):
    arr = np.asarray(img, dtype=np.float64) / 255.0
    arr = arr.transpose(2, 0, 1)
    return (arr - np.array(mean)[:, None, None]) / np.array(std)[:, None, None]


def test_validation_transform_equals_numpy_reference():
    rng = np.random.default_rng(1)
    pixels = rng.integers(0, 256, (20, 16, 3), np.uint8)  # [h, w, c], already 16 wide
    img = Image.fromarray(pixels, 'RGB')
    out = T.classification_transform((16, 16), train=False)(img, rng)
    top = int(round((20 - 16) / 2.0))
    expected = _numpy_reference(
        Image.fromarray(pixels[top : top + 16]), T.IMAGENET_MEAN, T.IMAGENET_STD
    )
    assert out.dtype == np.float32 and out.shape == (3, 16, 16)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_flip_and_crop_equal_numpy():
    pixels = np.arange(8 * 6 * 3, dtype=np.uint8).reshape(8, 6, 3)
    img = Image.fromarray(pixels, 'RGB')
    flipped = T.RandomHorizontalFlip(p=1.0)(img, np.random.default_rng(0))
    np.testing.assert_array_equal(np.asarray(flipped), pixels[:, ::-1])
    rng_a, rng_b = np.random.default_rng(5), np.random.default_rng(5)
    top, left, h, w = T.random_resized_crop_box(6, 8, rng_a, scale=(0.3, 0.6))
    assert 0 <= top and top + h <= 8 and 0 <= left and left + w <= 6
    assert 0.3 * 48 * 0.6 <= h * w <= 0.6 * 48 * 1.6
    assert T.random_resized_crop_box(6, 8, rng_b, scale=(0.3, 0.6)) == (top, left, h, w)
    # The transform resizes exactly that box: at the box's own size it is the numpy slice.
    out = img.resize((w, h), box=(left, top, left + w, top + h))
    np.testing.assert_array_equal(np.asarray(out), pixels[top : top + h, left : left + w])
    crop = T.RandomResizedCrop(size=4, scale=(0.3, 0.6))(img, np.random.default_rng(5))
    assert crop.size == (4, 4)


def test_training_items_are_deterministic_per_seed_epoch_and_index(tmp_path):
    train = _folder(tmp_path / 'train', per_class=4, size=20)
    valid = _folder(tmp_path / 'val', per_class=2, size=20)
    ds, _ = build_train_valid_datasets([train, valid], (16, 16), seed=7)
    again, _ = build_train_valid_datasets([train, valid], (16, 16), seed=7)
    other_seed, _ = build_train_valid_datasets([train, valid], (16, 16), seed=8)
    image, label = ds[3]
    assert isinstance(image, torch.Tensor) and image.shape == (3, 16, 16) and label == 0
    assert torch.equal(image, again[3][0])
    assert not torch.equal(image, other_seed[3][0])
    state = np.random.get_state()
    ds.set_epoch(1)
    assert not torch.equal(image, ds[3][0])  # another epoch, another crop
    ds.set_epoch(0)
    assert torch.equal(image, ds[3][0])
    # The transforms never touch the global RNGs.
    assert np.array_equal(np.random.get_state()[1], state[1])


def test_digits_converter(tmp_path):
    out = tmp_path / 'digits'
    done = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tools', 'prepare_image_folder.py'), '--digits',
         '--output', str(out)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert 'wrote 1442 training and 355 validation images' in done.stdout
    folder = ImageFolder(str(out / 'val'), num_channels=1)
    assert folder.classes == [str(d) for d in range(10)]
    assert np.asarray(folder[0][0]).shape == (8, 8)
    again = subprocess.run(
        [sys.executable, os.path.join(REPO, 'tools', 'prepare_image_folder.py'), '--digits',
         '--output', str(out)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert again.returncode == 2 and 'already holds a train/ folder' in again.stderr
