"""The on-disk cache of dataset indices (`--data-cache-path`, or `<data prefix>/cache/...`).

The cache usually sits next to shared data, so anyone who can write there can plant a file that
every job then reads. Indices are therefore written and read as plain numpy arrays only: never
with `allow_pickle` (a pickled `.npy` runs arbitrary code when loaded). A file that is not a plain
array of the expected rank - planted pickle, object array, truncated write, other garbage - is
refused with a message naming it, before any of its content is used.

Writes go to a temporary name in the same directory and are renamed into place, so a reader
never sees a half-written file.
"""

import os
from typing import Optional

import numpy


class CorruptCacheError(ValueError):
    """A cache file cannot be used; the message names it and says how to rebuild it."""


def save_index(path: str, array: numpy.ndarray) -> None:
    """Write `array` to `path` as a plain `.npy` (no pickle), atomically."""
    if array.dtype.hasobject:
        raise TypeError(f'refusing to cache an object array at {path}')
    tmp = f'{path}.tmp{os.getpid()}.npy'
    try:
        numpy.save(tmp, array, allow_pickle=False)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` atomically."""
    tmp = f'{path}.tmp{os.getpid()}'
    with open(tmp, 'wt') as writer:
        writer.write(text)
    os.replace(tmp, path)


def load_index(path: str, ndim: Optional[int] = None) -> numpy.ndarray:
    """Memory-map a cached index written by `save_index`.

    Args:
        path: the `.npy` file.
        ndim: the rank the index must have (1 or 2), or None to accept any.

    Raises:
        CorruptCacheError: the file is not a plain numeric numpy array (of rank `ndim`).
    """
    try:
        array = numpy.load(path, allow_pickle=False, mmap_mode='r')
    except (ValueError, OSError, EOFError) as exc:
        raise CorruptCacheError(_message(path, f'not a plain numpy array: {exc}')) from None
    if not isinstance(array, numpy.ndarray) or array.dtype.kind not in 'iu':
        raise CorruptCacheError(_message(path, 'not an integer numpy array'))
    if ndim is not None and array.ndim != ndim:
        raise CorruptCacheError(_message(path, f'expected {ndim} dimension(s), found {array.ndim}'))
    return array


def _message(path: str, reason: str) -> str:
    return (
        f'dataset cache file {path} is corrupt or was not written by Megatron ({reason}); '
        f'delete it (or its cache directory {os.path.dirname(path)}) so the indices are rebuilt'
    )
