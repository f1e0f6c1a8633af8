"""Reading DCP tensor records straight into the tensors that requested them.

DCP's `FileSystemWriter` stores every tensor chunk as one `torch.save` archive (an uncompressed
zip holding `data.pkl`, `byteorder`, `data/0`, ...) at some offset of a `.distcp` file. DCP's
`FileSystemReader` `torch.load`s each record into a freshly allocated tensor (zip parsing and
unpickling per record, the allocation's page faults, a read) and then copies the requested
part into the target: two passes over every byte and ~2 ms of Python per record.

`DirectFileSystemReader` reads the same files (the format is unchanged) by

- parsing the record's zip directory (a few small `pread`s) to find the raw bytes of `data/0`;
- interpreting `data.pkl` with `torch.load(weights_only=True)` on the meta device without its
  data (`torch.serialization.skip_data`), once per distinct `data.pkl` (records of equal shape
  and dtype share it), so the per-record cost is a dictionary lookup and nothing is unpickled
  beyond what `torch.load(weights_only=True)` allows;
- `pread`ing the requested region (contiguous in the stored chunk: a whole chunk, or rows of
  it, which is what resharding along dim 0 and distributed-optimizer boxes request) directly
  into a contiguous CPU target; any other request reads the smallest contiguous span into a
  scratch buffer (reused for the whole load) and copies the strided part.

Records it does not recognise (compressed or zip64 members it cannot place, several storages,
a stride other than row-major, another byte order, stream transforms) are read by DCP's own
code path, item by item, so every checkpoint DCP can read still loads.
"""

import io
import math
import os
import struct
import sys
from typing import Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.utils import _create_file_view
from torch.futures import Future

from megatron.core.dist_checkpointing.mapping import CheckpointingException

_EOCD = struct.Struct('<4s4H2LH')  # end of central directory
_EOCD64_LOCATOR = struct.Struct('<4sLQL')
_EOCD64 = struct.Struct('<4sQ2H2L4Q')
_CENTRAL = struct.Struct('<4s4B4HL2L5H2L')
_LOCAL = struct.Struct('<4s2B4HL2L2H')


class _Unrecognised(Exception):
    """A record the direct path does not handle (DCP's path reads it)."""


def _pread(fd: int, size: int, offset: int) -> bytes:
    data = os.pread(fd, size, offset)
    if len(data) != size:
        raise _Unrecognised(f'short read at {offset}')
    return data


def _pread_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill `buf` from the file at `offset` (os.preadv, looping over short reads)."""
    done, size = 0, len(buf)
    while done < size:
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(f'unexpected end of file at offset {offset + done}')
        done += n


def _zip_members(fd: int, start: int, length: int) -> Dict[str, Tuple[int, int]]:
    """{member name: (absolute data offset, size)} of the stored (uncompressed) zip archive at
    [start, start + length) of the file."""
    tail_size = min(length, 4096)
    tail = _pread(fd, tail_size, start + length - tail_size)
    at = tail.rfind(b'PK\x05\x06')
    if at < 0 or at + _EOCD.size > len(tail):
        raise _Unrecognised('no end of central directory')
    _, _, _, _, count, cd_size, cd_offset, comment_len = _EOCD.unpack_from(tail, at)
    if at + _EOCD.size + comment_len != len(tail):
        raise _Unrecognised('end of central directory is not at the end of the record')
    if 0xFFFFFFFF in (cd_size, cd_offset) or count == 0xFFFF:
        loc = at - _EOCD64_LOCATOR.size
        if loc < 0:
            raise _Unrecognised('zip64 locator outside the tail')
        sig, _, eocd64_offset, _ = _EOCD64_LOCATOR.unpack_from(tail, loc)
        if sig != b'PK\x06\x07':
            raise _Unrecognised('bad zip64 locator')
        rec = _EOCD64.unpack(_pread(fd, _EOCD64.size, start + eocd64_offset))
        if rec[0] != b'PK\x06\x06':
            raise _Unrecognised('bad zip64 end of central directory')
        count, cd_size, cd_offset = rec[7], rec[8], rec[9]
    if cd_offset + cd_size > length:
        raise _Unrecognised('central directory outside the record')
    directory = _pread(fd, cd_size, start + cd_offset)
    members, pos = {}, 0
    for _ in range(count):
        fields = _CENTRAL.unpack_from(directory, pos)
        if fields[0] != b'PK\x01\x02':
            raise _Unrecognised('bad central directory entry')
        method, csize, size = fields[6], fields[10], fields[11]
        name_len, extra_len, comment_len, header = fields[12], fields[13], fields[14], fields[18]
        name_at = pos + _CENTRAL.size
        name = directory[name_at : name_at + name_len].decode('utf-8')
        extra = directory[name_at + name_len : name_at + name_len + extra_len]
        size, csize, header = _zip64_fields(extra, size, csize, header)
        if method != 0 or csize != size:
            raise _Unrecognised(f'{name} is compressed')
        local = _LOCAL.unpack(_pread(fd, _LOCAL.size, start + header))
        if local[0] != b'PK\x03\x04':
            raise _Unrecognised('bad local header')
        data = header + _LOCAL.size + local[10] + local[11]
        if data + size > length:
            raise _Unrecognised(f'{name} extends past the record')
        members[name] = (start + data, size)
        pos = name_at + name_len + extra_len + comment_len
    return members


def _zip64_fields(extra: bytes, size: int, csize: int, header: int) -> Tuple[int, int, int]:
    """Sizes and header offset from a zip64 extra field where the 32-bit fields overflow."""
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from('<2H', extra, pos)
        if tag == 0x0001:
            values = list(struct.unpack_from(f'<{n // 8}Q', extra, pos + 4))
            if size == 0xFFFFFFFF:
                size = values.pop(0)
            if csize == 0xFFFFFFFF:
                csize = values.pop(0)
            if header == 0xFFFFFFFF:
                header = values.pop(0)
            break
        pos += 4 + n
    return size, csize, header


class _TensorRecord:
    """Where a stored chunk's raw bytes are, with its dtype and (row-major) shape."""

    __slots__ = ('data_offset', 'dtype', 'shape', 'strides')

    def __init__(self, data_offset: int, dtype: torch.dtype, shape: Tuple[int, ...]):
        self.data_offset = data_offset
        self.dtype = dtype
        self.shape = shape
        strides, acc = [], 1
        for size in reversed(shape):
            strides.append(acc)
            acc *= size
        self.strides = tuple(reversed(strides))


def _contiguous_region(shape, offsets, lengths) -> bool:
    """Whether the box (offsets, lengths) of a row-major `shape` is one contiguous range."""
    dims = len(shape)
    k = 0  # first axis that is not a single index
    while k < dims and lengths[k] == 1:
        k += 1
    return all(lengths[j] == shape[j] for j in range(k + 1, dims))


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable view of a contiguous CPU tensor's bytes."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class DirectFileSystemReader(FileSystemReader):
    """FileSystemReader whose `read_data` reads tensor records without `torch.load` (see the
    module docstring); byte objects and unrecognised records take DCP's path."""

    #: interpretation of a `data.pkl` (+ byte order): (dtype, shape) or None (not direct)
    _pickle_cache: Dict[Tuple[bytes, bytes], Optional[Tuple[torch.dtype, Tuple[int, ...]]]] = {}

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        per_file: Dict[str, List[ReadItem]] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].relative_path, []).append(
                item
            )
        self._scratch = None  # reused staging bytes of reads that cannot land in place
        try:
            for relative_path, items in per_file.items():
                items.sort(key=lambda it: self.storage_data[it.storage_index].offset)
                path = self.fs.concat_path(self.path, relative_path)
                with open(path, 'rb') as stream:
                    fd = stream.fileno()
                    records: Dict = {}
                    try:
                        for item in items:
                            self._read_item(fd, stream, item, planner, records)
                    except (AssertionError, CheckpointingException):
                        raise
                    except Exception as exc:  # a damaged record: name the file
                        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                        raise CheckpointingException(
                            f'{path} is corrupt (a record cannot be read: {reason})'
                        ) from exc
        finally:
            self._scratch = None
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, fd, stream, item: ReadItem, planner: LoadPlanner, records) -> None:
        info = self.storage_data[item.storage_index]
        record = None
        if item.type != LoadItemType.BYTE_IO and not info.transform_descriptors:
            key = (info.offset, info.length)
            if key not in records:
                try:
                    records[key] = self._tensor_record(fd, stream, info)
                except _Unrecognised:
                    records[key] = None
            record = records[key]
        if record is None:
            self._read_item_dcp(stream, item, planner)
            return
        target = planner.resolve_tensor(item).detach()
        lengths = tuple(item.lengths)
        if tuple(target.shape) != lengths:
            raise AssertionError(
                f'req {item.storage_index} mismatch sizes {tuple(target.shape)} vs {lengths}'
            )
        offsets = tuple(item.storage_offsets)
        if len(offsets) != len(record.shape) or any(
            o + n > s for o, n, s in zip(offsets, lengths, record.shape)
        ):
            raise AssertionError(f'req {item.storage_index} is outside the stored chunk')
        if math.prod(lengths) > 0:
            self._copy_region(fd, record, offsets, lengths, target)
        planner.commit_tensor(item, target)

    def _copy_region(self, fd, record: _TensorRecord, offsets, lengths, target) -> None:
        itemsize = record.dtype.itemsize
        first = sum(o * s for o, s in zip(offsets, record.strides))
        direct = (
            target.device.type == 'cpu'
            and target.dtype == record.dtype
            and target.is_contiguous()
            and _contiguous_region(record.shape, offsets, lengths)
        )
        if direct:
            _pread_into(fd, _byte_view(target), record.data_offset + first * itemsize)
            return
        last = sum((o + n - 1) * s for o, n, s in zip(offsets, lengths, record.strides))
        nbytes = (last - first + 1) * itemsize
        if self._scratch is None or self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        span = self._scratch[:nbytes]
        _pread_into(fd, _byte_view(span), record.data_offset + first * itemsize)
        target.copy_(span.view(record.dtype).as_strided(lengths, record.strides))

    def _tensor_record(self, fd, stream, info) -> _TensorRecord:
        members = _zip_members(fd, info.offset, info.length)
        pkl = [name for name in members if name.endswith('/data.pkl')]
        if len(pkl) != 1:
            raise _Unrecognised('no single data.pkl')
        prefix = pkl[0][: -len('data.pkl')]
        storages = [n for n in members if n.startswith(prefix + 'data/')]
        if len(storages) != 1:
            raise _Unrecognised('not a single storage')
        pkl_bytes = _pread(fd, members[pkl[0]][1], members[pkl[0]][0])
        order = members.get(prefix + 'byteorder')
        order_bytes = _pread(fd, order[1], order[0]) if order else b''
        if order_bytes not in (b'', sys.byteorder.encode()):
            raise _Unrecognised(f'byte order {order_bytes!r}')
        meaning = self._interpret(stream, info, pkl_bytes, order_bytes)
        if meaning is None:
            raise _Unrecognised('not a plain row-major tensor')
        dtype, shape = meaning
        data_offset, size = members[storages[0]]
        if size != math.prod(shape) * dtype.itemsize:
            raise _Unrecognised('storage size does not match the tensor')
        return _TensorRecord(data_offset, dtype, shape)

    def _interpret(self, stream, info, pkl_bytes: bytes, order_bytes: bytes):
        """(dtype, shape) of the record's tensor, None if it is not a plain row-major tensor at
        storage offset 0; weights-only torch.load without data, cached per data.pkl."""
        key = (pkl_bytes, order_bytes)
        if key not in self._pickle_cache:
            meaning = None
            if hasattr(torch.serialization, 'skip_data'):
                try:
                    view = _create_file_view(stream, info.offset, info.length)
                    with torch.serialization.skip_data():
                        meta = torch.load(view, map_location='meta', weights_only=True)
                except Exception:  # DCP's path will report what is wrong with the record
                    meta = None
                if (
                    type(meta) is torch.Tensor
                    and meta.layout == torch.strided
                    and meta.storage_offset() == 0
                    and meta.is_contiguous()
                    and meta.untyped_storage().nbytes() == meta.numel() * meta.element_size()
                ):
                    meaning = (meta.dtype, tuple(meta.shape))
            if len(self._pickle_cache) > 4096:
                self._pickle_cache.clear()
            self._pickle_cache[key] = meaning
        return self._pickle_cache[key]

    def _read_item_dcp(self, stream, item: ReadItem, planner: LoadPlanner) -> None:
        """DCP's own per-item path (FileSystemReader.read_data's loop body)."""
        info = self.storage_data[item.storage_index]
        file_slice = self._slice_file(stream, info)
        transform_from = self.transforms.transform_load_stream(
            item, info.transform_descriptors or (), file_slice
        )
        if item.type == LoadItemType.BYTE_IO:
            read_bytes = io.BytesIO(transform_from.read(-1))
            read_bytes.seek(0)
            planner.load_bytes(item, read_bytes)
            return
        if transform_from.seekable():
            seekable = transform_from
        else:
            seekable = io.BytesIO(transform_from.read(-1))
            seekable.seek(0)
        tensor = torch.load(seekable, map_location='cpu', weights_only=True)
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise AssertionError(
                f'req {item.storage_index} mismatch sizes {target.size()} vs {tensor.size()}'
            )
        target.copy_(tensor)
        planner.commit_tensor(item, target)
