"""An ImageFolder reader in Pillow (Megatron's `megatron/legacy/data/image_folder.py` layout).

A root holds one sub-folder per class; classes are the sorted sub-folder names (index = position)
and each class's images are its files with an image extension, sorted by path. Megatron's
`classes_fraction` and `data_per_class_fraction` keep the first share of the sorted classes and
of each class's files.

Every problem a run would meet later is found when the reader is built, before any training:
a missing or empty root, a class folder without images, an empty or undecodable file (named),
and a channel count the images do not have.
"""

import os
from typing import List, Tuple

from PIL import Image, UnidentifiedImageError

IMG_EXTENSIONS = ('.jpg', '.jpeg', '.png', '.ppm', '.bmp', '.pgm', '.tif', '.tiff', '.webp')

#: Pillow modes by channel count requested with --num-channels.
_MODES = {1: 'L', 3: 'RGB'}


def _keep(items: list, fraction: float) -> list:
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"a data fraction must be in (0, 1], got {fraction}")
    return items[: max(1, int(len(items) * fraction))]


def find_classes(root: str) -> List[str]:
    """Sorted class sub-folder names of `root`."""
    if not os.path.isdir(root):
        raise ValueError(f"image folder {root!r} does not exist or is not a directory")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise ValueError(f"image folder {root!r} has no class sub-folders")
    return classes


def class_files(folder: str) -> List[str]:
    paths = []
    for dirpath, _, files in sorted(os.walk(folder, followlinks=True)):
        for name in sorted(files):
            if name.lower().endswith(IMG_EXTENSIONS):
                paths.append(os.path.join(dirpath, name))
    if not paths:
        raise ValueError(f"class folder {folder!r} holds no images ({', '.join(IMG_EXTENSIONS)})")
    return paths


#: Pillow modes without colour (alpha aside).
_GRAY_MODES = ('1', 'L', 'LA', 'I', 'I;16', 'F')


def _is_gray(path: str) -> bool:
    """Whether one image file is grayscale, from its header; a one-line error names a bad file."""
    if os.path.getsize(path) == 0:
        raise ValueError(f"image file {path!r} is empty")
    try:
        with Image.open(path) as img:
            return img.mode in _GRAY_MODES
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"image file {path!r} cannot be decoded: {err}") from None


class ImageFolder:
    """(PIL image, class index) samples of a class-per-folder tree.

    Args:
        root (str): the folder of class sub-folders.
        num_channels (int): 1 (read as grayscale) or 3 (RGB).
        classes_fraction (float): share of the sorted classes kept.
        data_per_class_fraction (float): share of each class's sorted files kept.
    """

    def __init__(
        self,
        root: str,
        num_channels: int = 3,
        classes_fraction: float = 1.0,
        data_per_class_fraction: float = 1.0,
    ):
        if num_channels not in _MODES:
            raise ValueError(
                f"--num-channels {num_channels}: images are read with 1 (grayscale) or 3 (RGB) "
                "channels"
            )
        self.root = root
        self.mode = _MODES[num_channels]
        self.classes = _keep(find_classes(root), classes_fraction)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}
        self.samples: List[Tuple[str, int]] = []
        for name in self.classes:
            files = _keep(class_files(os.path.join(root, name)), data_per_class_fraction)
            self.samples.extend((path, self.class_to_idx[name]) for path in files)
        self._check_files(num_channels)
        self.targets = [target for _, target in self.samples]

    def _check_files(self, num_channels: int) -> None:
        for path, _ in self.samples:
            gray = _is_gray(path)
            # Grayscale data cannot fill 3 channels with colour, and colour data would lose it
            # in 1: either way the flag does not describe the data.
            if gray != (num_channels == 1):
                raise ValueError(
                    f"--num-channels {num_channels} does not match the data: {path!r} is "
                    f"{'grayscale (1 channel)' if gray else 'colour (3 channels)'}"
                )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Tuple[Image.Image, int]:
        path, target = self.samples[index]
        with Image.open(path) as img:
            return img.convert(self.mode), target
