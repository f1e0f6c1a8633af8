"""An in-process memo of built dataset indices, for builds that have no on-disk cache.

Without a cache path (`--mock-data`, or no `--data-cache-path` for an index-less source) every
build of a GPT dataset shuffles every sample of its epochs again: the mock dataset's train split
alone is about 12 million samples, a second or more of numpy's Fisher-Yates per split. A process
that builds the same split twice (an evaluation that rebuilds its datasets, `pretrain()` called
again in the same process after a restart, a test harness running many short jobs) gets the
arrays from here instead.

The key is a digest of everything the indices are a function of: the documents' lengths and
order, the epoch plan and the sampling config (see `GPTDataset._build_indices`). Arrays are stored
read-only (as the memory-mapped cache files are), so no holder can change another's copy. The
memo keeps the most recently used entries within `MAX_BYTES`.
"""

import collections
import hashlib
import threading
from typing import Callable, Hashable, Tuple

import numpy

#: Upper bound on the bytes the memo holds per process (least recently used entries go first).
MAX_BYTES = 256 * 2**20

_entries: 'collections.OrderedDict[str, Tuple[numpy.ndarray, ...]]' = collections.OrderedDict()
_lock = threading.Lock()


def digest(*parts: Hashable) -> str:
    """A hex digest of numpy arrays (dtype, shape and bytes) and plain values, in order."""
    hasher = hashlib.sha1()
    for part in parts:
        if isinstance(part, numpy.ndarray):
            array = numpy.ascontiguousarray(part)
            hasher.update(f'{array.dtype.str}{array.shape}'.encode())
            hasher.update(array.data)
        else:
            hasher.update(repr(part).encode())
        hasher.update(b'\x00')
    return hasher.hexdigest()


def memoized(key: str, build: Callable[[], Tuple[numpy.ndarray, ...]]) -> Tuple[numpy.ndarray, ...]:
    """The arrays `build()` returns for `key`, built at most once while they stay in the memo."""
    with _lock:
        if key in _entries:
            _entries.move_to_end(key)
            return _entries[key]
    arrays = tuple(build())
    for array in arrays:
        array.setflags(write=False)
    size = sum(array.nbytes for array in arrays)
    with _lock:
        if size <= MAX_BYTES:
            _entries[key] = arrays
            while sum(a.nbytes for entry in _entries.values() for a in entry) > MAX_BYTES:
                _entries.popitem(last=False)
    return arrays


def clear() -> None:
    """Drop every entry."""
    with _lock:
        _entries.clear()
