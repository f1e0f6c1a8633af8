"""Write the image-folder layout the vision scripts read: OUTPUT/train/<class>/*.png and
OUTPUT/val/<class>/*.png.

Two sources:
- `--digits [CSV_GZ]`: the bundled handwritten digits (data/vision/digits.csv.gz: 64 pixels in
  0..16 and the label per row) as grayscale PNGs, optionally resized to `--size`;
- `--input DIR`: any folder of class sub-folders, split into train/val (files are copied).

The split is deterministic: within each class, every k-th sample (k = round(1 / valid
fraction)) goes to validation. Example:

    python tools/prepare_image_folder.py --digits --output digits_folder
    torchrun --nproc-per-node 2 pretrain_vision_classify.py ... \
        --data-path digits_folder/train digits_folder/val
"""

import argparse
import gzip
import os
import shutil
import sys

import numpy as np
from PIL import Image

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
DIGITS = os.path.join(REPO, 'data', 'vision', 'digits.csv.gz')
sys.path.insert(0, REPO)

from megatron.legacy.data.image_folder import class_files, find_classes  # noqa: E402


def _is_valid(position: int, every: int) -> bool:
    return every > 0 and position % every == every - 1


def _read_digits(path: str):
    with gzip.open(path, 'rt') as f:
        rows = [line.strip() for line in f if line.strip()]
    data = np.array([[float(v) for v in row.split(',')] for row in rows], dtype=np.float32)
    if data.shape[1] != 65:
        raise ValueError(f"{path}: expected 64 pixels and a label per row, got {data.shape[1]}")
    pixels = (data[:, :64].reshape(-1, 8, 8) * (255.0 / 16.0)).round().astype(np.uint8)
    return pixels, data[:, 64].astype(int)


def write_digits(path: str, output: str, every: int, size: int) -> dict:
    """The digits as PNGs; returns {split: count}."""
    pixels, labels = _read_digits(path)
    counts = {'train': 0, 'val': 0}
    seen = {}
    for i, (img, label) in enumerate(zip(pixels, labels)):
        position = seen.get(label, 0)
        seen[label] = position + 1
        split = 'val' if _is_valid(position, every) else 'train'
        folder = os.path.join(output, split, str(label))
        os.makedirs(folder, exist_ok=True)
        picture = Image.fromarray(img, 'L')
        if size != 8:
            picture = picture.resize((size, size), Image.Resampling.BILINEAR)
        picture.save(os.path.join(folder, f'{i:05d}.png'))
        counts[split] += 1
    return counts


def split_folder(source: str, output: str, every: int) -> dict:
    """Copy a class-per-folder tree into train/val; returns {split: count}."""
    counts = {'train': 0, 'val': 0}
    for name in find_classes(source):
        for position, path in enumerate(class_files(os.path.join(source, name))):
            split = 'val' if _is_valid(position, every) else 'train'
            folder = os.path.join(output, split, name)
            os.makedirs(folder, exist_ok=True)
            shutil.copy2(path, os.path.join(folder, os.path.basename(path)))
            counts[split] += 1
    return counts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument('--digits', nargs='?', const=DIGITS, help='the digits CSV (gzip)')
    source.add_argument('--input', help='a folder of class sub-folders to split')
    parser.add_argument('--output', required=True, help='folder to write train/ and val/ into')
    parser.add_argument('--valid-fraction', type=float, default=0.2)
    parser.add_argument('--size', type=int, default=8, help='side of the digit images (pixels)')
    args = parser.parse_args(argv)
    if not 0.0 <= args.valid_fraction < 1.0:
        parser.error(f'--valid-fraction must be in [0, 1), got {args.valid_fraction}')
    if args.size <= 0:
        parser.error(f'--size must be positive, got {args.size}')
    if os.path.exists(os.path.join(args.output, 'train')):
        parser.error(f'--output {args.output} already holds a train/ folder')
    every = round(1.0 / args.valid_fraction) if args.valid_fraction > 0 else 0
    try:
        if args.digits:
            counts = write_digits(args.digits, args.output, every, args.size)
        else:
            counts = split_folder(args.input, args.output, every)
    except (ValueError, OSError) as err:
        print(f'error: {err}', file=sys.stderr)
        return 1
    print(
        f"wrote {counts['train']} training and {counts['val']} validation images to {args.output}"
    )
    return 0


if __name__ == '__main__':
    sys.exit(main())
