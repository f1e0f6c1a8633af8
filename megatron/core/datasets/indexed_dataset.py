"""Megatron's memory-mapped indexed dataset: a `.bin` of raw token ids and an `.idx` index.

Byte layout of `.idx` (Megatron's megatron/core/datasets/indexed_dataset.py, little endian):

    offset 0   9 B   magic b"MMIDIDX\\x00\\x00"
    offset 9   8 B   version <Q (1)
    offset 17  1 B   dtype code <B (DType)
    offset 18  8 B   sequence_count S <Q
    offset 26  8 B   document_count D <Q  (= number of documents + 1)
    offset 34  4S B  sequence_lengths int32[S]
               8S B  sequence_pointers int64[S] (byte offsets into .bin)
               8D B  document_indices int64[D]
               1S B  sequence_modes int8[S] (multimodal only)

`.bin` is every sequence's tokens, concatenated, in the dataset dtype, with no header.
"""

import logging
import os
import shutil
import struct
from enum import Enum
from functools import lru_cache
from itertools import accumulate
from typing import List, Optional, Tuple, Type, Union

import numpy
import torch

logger = logging.getLogger(__name__)

_INDEX_HEADER = b"MMIDIDX\x00\x00"
_HEADER_SIZE = 34


class DType(Enum):
    """The dtype codes stored in byte 17 of `.idx`."""

    uint8 = 1
    int8 = 2
    int16 = 3
    int32 = 4
    int64 = 5
    float64 = 6
    float32 = 7
    uint16 = 8

    @classmethod
    def code_from_dtype(cls, value: Type[numpy.number]) -> int:
        """The code of a numpy dtype."""
        return cls[numpy.dtype(value).name].value

    @classmethod
    def dtype_from_code(cls, value: int) -> Type[numpy.number]:
        """The numpy dtype of a code."""
        return getattr(numpy, cls(value).name)

    @staticmethod
    def size(key: Union[int, Type[numpy.number]]) -> int:
        """Bytes per element of a code or dtype."""
        if isinstance(key, int):
            return DType.dtype_from_code(key)().itemsize
        if numpy.number in getattr(key, "__mro__", ()):
            return key().itemsize
        return numpy.dtype(key).itemsize

    @staticmethod
    def optimal_dtype(cardinality: Optional[int]) -> Type[numpy.number]:
        """uint16 for a vocabulary under 65500, else int32."""
        if cardinality is not None and cardinality < 65500:
            return numpy.uint16
        return numpy.int32


def get_idx_path(path_prefix: str) -> str:
    """`prefix.idx`."""
    return path_prefix + ".idx"


def get_bin_path(path_prefix: str) -> str:
    """`prefix.bin`."""
    return path_prefix + ".bin"


class _IndexWriter(object):
    """Writes an `.idx` file (context manager)."""

    def __init__(self, idx_path: str, dtype: Type[numpy.number]) -> None:
        self.idx_path = idx_path
        self.dtype = dtype

    def __enter__(self) -> "_IndexWriter":
        self.idx_writer = open(self.idx_path, "wb")
        self.idx_writer.write(_INDEX_HEADER)
        self.idx_writer.write(struct.pack("<Q", 1))
        self.idx_writer.write(struct.pack("<B", DType.code_from_dtype(self.dtype)))
        return self

    def __exit__(self, exc_type, exc_val, exc_tb) -> Optional[bool]:
        self.idx_writer.close()
        return None

    def write(
        self,
        sequence_lengths: List[int],
        sequence_modes: Optional[List[int]],
        document_indices: List[int],
    ) -> None:
        """Write counts, lengths, byte pointers, document indices and (optionally) modes."""
        sequence_pointers = self._sequence_pointers(sequence_lengths)
        sequence_count = len(sequence_lengths)
        self.idx_writer.write(struct.pack("<Q", sequence_count))
        self.idx_writer.write(struct.pack("<Q", len(document_indices)))
        self.idx_writer.write(numpy.array(sequence_lengths, dtype=numpy.int32).tobytes(order="C"))
        self.idx_writer.write(numpy.array(sequence_pointers, dtype=numpy.int64).tobytes(order="C"))
        self.idx_writer.write(numpy.array(document_indices, dtype=numpy.int64).tobytes(order="C"))
        if sequence_modes is not None:
            self.idx_writer.write(numpy.array(sequence_modes, dtype=numpy.int8).tobytes(order="C"))

    def _sequence_pointers(self, sequence_lengths: List[int]) -> numpy.ndarray:
        itemsize = DType.size(self.dtype)
        lengths = numpy.asarray(sequence_lengths, dtype=numpy.int64)
        pointers = numpy.zeros(len(lengths), dtype=numpy.int64)
        if len(lengths) > 1:
            numpy.cumsum(lengths[:-1] * itemsize, out=pointers[1:])
        return pointers


class _IndexReader(object):
    """Reads an `.idx` file through one numpy memmap.

    Raises:
        ValueError: when the file is not an MMIDIDX index, has a bad version or dtype code, or is
            shorter than its header says.
    """

    def __init__(self, idx_path: str, multimodal: bool) -> None:
        file_size = os.path.getsize(idx_path)
        with open(idx_path, "rb") as stream:
            header = stream.read(_HEADER_SIZE)
        if len(header) < _HEADER_SIZE or header[:9] != _INDEX_HEADER:
            raise ValueError(f"{idx_path}: not a Megatron MMIDIDX index file (bad magic or header)")
        (version,) = struct.unpack("<Q", header[9:17])
        if version != 1:
            raise ValueError(f"{idx_path}: unsupported index version {version} (expected 1)")
        (code,) = struct.unpack("<B", header[17:18])
        try:
            self.dtype = DType.dtype_from_code(code)
        except ValueError:
            raise ValueError(f"{idx_path}: unknown dtype code {code}") from None
        self.dtype_size = DType.size(self.dtype)
        (self.sequence_count,) = struct.unpack("<Q", header[18:26])
        (self.document_count,) = struct.unpack("<Q", header[26:34])
        expected = _HEADER_SIZE + 12 * self.sequence_count + 8 * self.document_count
        if multimodal:
            expected += self.sequence_count
        if file_size < expected:
            raise ValueError(
                f"{idx_path}: truncated index ({file_size} bytes, header needs {expected} for "
                f"{self.sequence_count} sequences and {self.document_count} document entries)"
            )
        self.idx_path = idx_path
        # The memmaps are never closed explicitly: numpy views handed out (sequence_lengths, token
        # arrays) keep them alive, and closing under a live view would crash.
        self.bin_buffer_mmap = numpy.memmap(idx_path, mode="r", order="C")
        self.bin_buffer = memoryview(self.bin_buffer_mmap)
        offset = _HEADER_SIZE
        self.sequence_lengths = numpy.frombuffer(
            self.bin_buffer, dtype=numpy.int32, count=self.sequence_count, offset=offset
        )
        offset += self.sequence_lengths.nbytes
        self.sequence_pointers = numpy.frombuffer(
            self.bin_buffer, dtype=numpy.int64, count=self.sequence_count, offset=offset
        )
        offset += self.sequence_pointers.nbytes
        self.document_indices = numpy.frombuffer(
            self.bin_buffer, dtype=numpy.int64, count=self.document_count, offset=offset
        )
        offset += self.document_indices.nbytes
        self.sequence_modes = None
        if multimodal:
            self.sequence_modes = numpy.frombuffer(
                self.bin_buffer, dtype=numpy.int8, count=self.sequence_count, offset=offset
            )
        if self.document_count == 0 or int(self.document_indices[-1]) != self.sequence_count:
            last = int(self.document_indices[-1]) if self.document_count else None
            raise ValueError(
                f"{idx_path}: corrupt index: last document index {last} != sequence count "
                f"{self.sequence_count}"
            )

    def __len__(self) -> int:
        return self.sequence_count

    @lru_cache(maxsize=8)
    def __getitem__(self, idx: int) -> Tuple[numpy.int64, numpy.int32, Optional[numpy.int8]]:
        return (
            self.sequence_pointers[idx],
            self.sequence_lengths[idx],
            self.sequence_modes[idx] if self.sequence_modes is not None else None,
        )


class IndexedDataset(torch.utils.data.Dataset):
    """A memory-mapped (or file-read) view of one `.bin`/`.idx` pair.

    Args:
        path_prefix: the files are `path_prefix + ".bin"` and `path_prefix + ".idx"`.
        multimodal: whether the index carries a `sequence_modes` array.
        mmap: memory-map `.bin` (True) or read it with seeks (False).

    Raises:
        FileNotFoundError: when either file is missing (the message names it).
        ValueError: when the index is malformed or `.bin` is shorter than the index requires.
    """

    def __init__(self, path_prefix: str, multimodal: bool = False, mmap: bool = True) -> None:
        super().__init__()
        # Unpickling goes through initialize() as well, so that is where the attributes are set;
        # until it succeeds they read None.
        self.path_prefix = self.multimodal = self.mmap = None
        self.initialize(path_prefix, multimodal, mmap)

    def initialize(self, path_prefix: str, multimodal: bool, mmap: bool) -> None:
        """Open the files (also used when unpickling)."""
        idx_path = get_idx_path(path_prefix)
        bin_path = get_bin_path(path_prefix)
        for path in (idx_path, bin_path):
            if not os.path.isfile(path):
                other = bin_path if path == bin_path else idx_path
                raise FileNotFoundError(f"indexed dataset '{path_prefix}': missing file {other}")
        self.path_prefix = path_prefix
        self.multimodal = multimodal
        self.mmap = mmap
        self.index = _IndexReader(idx_path, self.multimodal)
        bin_size = os.path.getsize(bin_path)
        if len(self.index) > 0:
            needed = (
                int(self.index.sequence_pointers[-1])
                + int(self.index.sequence_lengths[-1]) * self.index.dtype_size
            )
        else:
            needed = 0
        if bin_size < needed:
            raise ValueError(
                f"{bin_path}: truncated data file ({bin_size} bytes, the index needs {needed})"
            )
        if bin_size > needed:
            # Every byte of a .bin belongs to a sequence of its .idx: a larger file was paired
            # with the index of another (smaller) preprocessing run.
            raise ValueError(
                f"{bin_path} has {bin_size} bytes but its index {idx_path} describes {needed}: "
                f"the .bin and .idx come from different preprocessing runs"
            )
        self.bin_buffer = None
        self.bin_buffer_mmap = None
        if mmap:
            if bin_size > 0:
                self.bin_buffer_mmap = numpy.memmap(bin_path, mode="r", order="C")
                self.bin_buffer = memoryview(self.bin_buffer_mmap)
            else:
                self.bin_buffer = memoryview(b"")

    def __getstate__(self) -> Tuple[str, bool, bool]:
        return self.path_prefix, self.multimodal, self.mmap

    def __setstate__(self, state: Tuple[str, bool, bool]) -> None:
        path_prefix, multimodal, mmap = state
        self.initialize(path_prefix, multimodal, mmap)

    def __len__(self) -> int:
        return len(self.index)

    def _read(self, count: int, byte_offset: int) -> numpy.ndarray:
        if self.mmap:
            return numpy.frombuffer(
                self.bin_buffer, dtype=self.index.dtype, count=count, offset=byte_offset
            )
        with open(get_bin_path(self.path_prefix), "rb") as stream:
            stream.seek(byte_offset)
            data = stream.read(count * self.index.dtype_size)
        return numpy.frombuffer(data, dtype=self.index.dtype, count=count)

    def __getitem__(
        self, idx: Union[int, numpy.integer, slice]
    ) -> Union[numpy.ndarray, Tuple[numpy.ndarray, numpy.ndarray], List]:
        """One sequence (array), or `(array, mode)` when multimodal; a step-1 slice gives a list."""
        if isinstance(idx, (int, numpy.integer)):
            idx = int(idx)
            if idx < 0:
                idx += len(self)
            if not 0 <= idx < len(self):
                raise IndexError(f"index {idx} out of range for {len(self)} sequences")
            pointer, length, mode = self.index[idx]
            sequence = self._read(int(length), int(pointer))
            return (sequence, mode) if mode is not None else sequence
        if isinstance(idx, slice):
            start, stop, step = idx.indices(len(self))
            if step != 1:
                raise ValueError(f"slices into {type(self).__name__} must be contiguous")
            if stop <= start:
                return []
            sequence_lengths = self.index.sequence_lengths[idx]
            sequence_modes = self.index.sequence_modes[idx] if self.multimodal else None
            sequence_offsets = list(accumulate(int(x) for x in sequence_lengths))
            sequences = numpy.split(
                self._read(int(sum(sequence_lengths)), int(self.index.sequence_pointers[start])),
                sequence_offsets[:-1],
            )
            return (sequences, sequence_modes) if sequence_modes is not None else sequences
        raise TypeError(f"Unexpected type received for idx: {type(idx)}")

    def get(self, idx: int, offset: int = 0, length: Optional[int] = None) -> numpy.ndarray:
        """Tokens `[offset, offset + length)` of sequence `idx` (to its end when length is None)."""
        pointer, sequence_length, mode = self.index[int(idx)]
        if length is None:
            length = int(sequence_length) - int(offset)
        pointer = int(pointer) + int(offset) * self.index.dtype_size
        sequence = self._read(int(length), pointer)
        return (sequence, mode) if mode is not None else sequence

    @property
    def sequence_lengths(self) -> numpy.ndarray:
        """int32 tokens per sequence."""
        return self.index.sequence_lengths

    @property
    def document_indices(self) -> numpy.ndarray:
        """int64 sequence index where each document starts, plus the total at the end."""
        return self.index.document_indices

    @property
    def sequence_modes(self) -> Optional[numpy.ndarray]:
        """int8 modes (multimodal only)."""
        return self.index.sequence_modes

    # Legacy (MMapIndexedDataset) names.
    @property
    def sizes(self) -> numpy.ndarray:
        """Alias of `sequence_lengths` (legacy name)."""
        return self.index.sequence_lengths

    @property
    def doc_idx(self) -> numpy.ndarray:
        """Alias of `document_indices` (legacy name)."""
        return self.index.document_indices

    supports_prefetch = False

    def get_document_indices(self) -> numpy.ndarray:
        """The document indices."""
        return self.index.document_indices

    def set_document_indices(self, document_indices: numpy.ndarray) -> None:
        """Replace the in-memory document indices (not written back)."""
        self.index.document_indices = document_indices

    @staticmethod
    def exists(path_prefix: str) -> bool:
        """Whether both `prefix.idx` and `prefix.bin` exist."""
        return os.path.exists(get_idx_path(path_prefix)) and os.path.exists(
            get_bin_path(path_prefix)
        )


class IndexedDatasetBuilder(object):
    """Writes a `.bin` incrementally, then its `.idx` in `finalize`.

    Args:
        bin_path: the `.bin` to write (opened immediately).
        dtype: token dtype written to `.bin` and coded in `.idx`.
        multimodal: also record one int8 mode per sequence.
    """

    def __init__(
        self, bin_path: str, dtype: Type[numpy.number] = numpy.int32, multimodal: bool = False
    ) -> None:
        self.data_file = open(bin_path, "wb")
        self.bin_path = bin_path
        self.dtype = dtype
        self.multimodal = multimodal
        self.sequence_lengths = []
        self.document_indices = [0]
        self.sequence_modes = [] if self.multimodal else None

    def add_item(
        self, tensor: Union[torch.Tensor, numpy.ndarray, List[int]], mode: int = 0
    ) -> None:
        """Append one sequence (does not close the document)."""
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.numpy()
        np_array = numpy.asarray(tensor, dtype=self.dtype)
        self.data_file.write(np_array.tobytes(order="C"))
        self.sequence_lengths.append(int(np_array.size))
        if self.multimodal:
            self.sequence_modes.append(mode)

    def add_document(
        self,
        tensor: Union[torch.Tensor, numpy.ndarray, List[int]],
        lengths: List[int],
        modes: Optional[List[int]] = None,
    ) -> None:
        """Append a whole document: flat tokens split into sequences of `lengths`."""
        if isinstance(tensor, torch.Tensor):
            tensor = tensor.numpy()
        np_array = numpy.asarray(tensor, dtype=self.dtype).reshape(-1)
        if sum(lengths) != np_array.size:
            raise ValueError(
                f"add_document: lengths sum to {sum(lengths)} but the document has {np_array.size} "
                "tokens"
            )
        self.data_file.write(np_array.tobytes(order="C"))
        self.sequence_lengths.extend(int(x) for x in lengths)
        self.document_indices.append(len(self.sequence_lengths))
        if self.multimodal:
            self.sequence_modes.extend(modes if modes is not None else [0] * len(lengths))

    def end_document(self) -> None:
        """Close the current document."""
        self.document_indices.append(len(self.sequence_lengths))

    def add_index(self, path_prefix: str) -> None:
        """Append a finished dataset (same dtype): its index entries shifted, its `.bin`
        verbatim."""
        index = _IndexReader(get_idx_path(path_prefix), multimodal=self.multimodal)
        if numpy.dtype(index.dtype) != numpy.dtype(self.dtype):
            raise ValueError(
                f"add_index: {path_prefix} has dtype {numpy.dtype(index.dtype).name}, "
                f"the builder writes {numpy.dtype(self.dtype).name}"
            )
        offset = len(self.sequence_lengths)
        self.sequence_lengths.extend(index.sequence_lengths.tolist())
        self.document_indices.extend((offset + index.document_indices)[1:].tolist())
        if self.multimodal:
            self.sequence_modes.extend(index.sequence_modes.tolist())
        del index
        with open(get_bin_path(path_prefix), "rb") as f:
            shutil.copyfileobj(f, self.data_file)

    def finalize(self, idx_path: str) -> None:
        """Close `.bin` and write `idx_path`."""
        self.data_file.close()
        with _IndexWriter(idx_path, self.dtype) as writer:
            writer.write(self.sequence_lengths, self.sequence_modes, self.document_indices)


# Legacy aliases (23.06 names).
MMapIndexedDataset = IndexedDataset
MMapIndexedDatasetBuilder = IndexedDatasetBuilder
