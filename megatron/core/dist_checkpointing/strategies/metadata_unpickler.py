"""Reading PyTorch DCP's `.metadata` pickle without letting it run code.

A `.metadata` written by `torch.distributed.checkpoint` (torch 2.3 to 2.13, at every layout we
save: dense, MoE, distributed optimizer, flattened ranges, ShardedObjects) references exactly
these globals:

- the dataclasses of `torch.distributed.checkpoint.metadata` (`Metadata`, `StorageMeta`,
  `TensorStorageMetadata`, `BytesStorageMetadata`, `ChunkStorageMetadata`, `TensorProperties`,
  `MetadataIndex`) and `filesystem._StorageInfo`, built by NEWOBJ + BUILD (or REDUCE);
- `_MEM_FORMAT_ENCODING(int)` (the enum TensorProperties pickles its memory format as);
- `torch.serialization._get_layout(str)` (how a `torch.layout` pickles), `torch.Size(list)`,
  the torch dtypes (plain objects, not callable);
- `pathlib.PosixPath(str, ...)`: `StorageMeta.checkpoint_id`.

Nothing else is resolved. No real class or function reaches the pickle's stack: each allowed
global is a fresh stand-in type made for this one load, whose construction checks its
arguments' types and builds the real object. So BUILD cannot set attributes on a real class
or function (it would reach only the throwaway stand-in), REDUCE cannot call anything but those
constructors, and no attribute lookup (`getattr`, `__globals__`) is possible. Finally the
loaded object is walked: every value must be one of the types above or plain data.
"""

import pathlib
import pickle
from typing import Any, BinaryIO, Callable, Dict, Tuple

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

_DCP_DATACLASSES = {
    ('torch.distributed.checkpoint.metadata', name): getattr(dcp_metadata, name)
    for name in (
        'Metadata',
        'StorageMeta',
        'TensorStorageMetadata',
        'BytesStorageMetadata',
        'ChunkStorageMetadata',
        'TensorProperties',
        'MetadataIndex',
    )
    if hasattr(dcp_metadata, name)
}
_DCP_DATACLASSES[('torch.distributed.checkpoint.filesystem', '_StorageInfo')] = (
    dcp_filesystem._StorageInfo
)

_LAYOUTS = {str(layout): layout for layout in (torch.strided, torch.sparse_coo, torch.jagged)}

_PLAIN = (str, bytes, int, float, bool, type(None))


def _build_dataclass(cls: type) -> Callable[..., Any]:
    def build(*args: Any, **kwargs: Any) -> Any:
        if not args and not kwargs:  # NEWOBJ: an empty instance, its fields come with BUILD
            return cls.__new__(cls)
        return cls(*args, **kwargs)

    return build


def _size(*args: Any) -> torch.Size:
    if len(args) > 1 or (args and not isinstance(args[0], (list, tuple))):
        raise pickle.UnpicklingError('torch.Size takes one list of integers')
    dims = list(args[0]) if args else []
    if not all(type(d) is int for d in dims):
        raise pickle.UnpicklingError('torch.Size takes one list of integers')
    return torch.Size(dims)


def _layout(name: Any) -> torch.layout:
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f'unknown tensor layout {name!r:.40}')
    return _LAYOUTS[name]


def _memory_format(value: Any) -> Any:
    if type(value) is not int:
        raise pickle.UnpicklingError('_MEM_FORMAT_ENCODING takes one integer')
    return dcp_metadata._MEM_FORMAT_ENCODING(value)


def _path(*parts: Any) -> pathlib.PurePosixPath:
    if not all(isinstance(p, str) for p in parts):
        raise pickle.UnpicklingError('a checkpoint path is made of strings only')
    return pathlib.PurePosixPath(*parts)  # a pure path: no file system access


def _constructors() -> Dict[Tuple[str, str], Callable[..., Any]]:
    table: Dict[Tuple[str, str], Callable[..., Any]] = {
        key: _build_dataclass(cls) for key, cls in _DCP_DATACLASSES.items()
    }
    table[('torch', 'Size')] = _size
    table[('torch.serialization', '_get_layout')] = _layout
    table[('torch.distributed.checkpoint.metadata', '_MEM_FORMAT_ENCODING')] = _memory_format
    for name in ('PosixPath', 'PurePosixPath', 'Path', 'WindowsPath', 'PureWindowsPath'):
        table[('pathlib', name)] = _path
    return table


def _stand_in(name: str, make: Callable[..., Any]) -> type:
    """A fresh type: calling it (REDUCE) or NEWOBJ on it returns `make(*args)`."""

    def __new__(stand_in, *args, **kwargs):  # noqa: N807 (the type's constructor)
        return make(*args, **kwargs)

    return type(f'_{name}', (), {'__new__': __new__, '__slots__': ()})


_ALLOWED_TYPES = tuple(_DCP_DATACLASSES.values()) + (
    torch.Size,
    torch.dtype,
    torch.layout,
    dcp_metadata._MEM_FORMAT_ENCODING,
    pathlib.PurePath,
)


def check_plain_metadata(obj: Any, depth: int = 0) -> None:
    """Raise UnpicklingError unless `obj` holds only DCP metadata types and plain data."""
    if depth > 32:
        raise pickle.UnpicklingError('metadata nested too deeply')
    if isinstance(obj, _PLAIN) or isinstance(
        obj, (torch.dtype, torch.layout, torch.memory_format, pathlib.PurePath)
    ):
        return
    if isinstance(obj, torch.Size):
        return
    if type(obj) in (list, tuple, set, frozenset):
        for item in obj:
            check_plain_metadata(item, depth + 1)
        return
    if type(obj) is dict:
        for key, value in obj.items():
            check_plain_metadata(key, depth + 1)
            check_plain_metadata(value, depth + 1)
        return
    if type(obj) in _ALLOWED_TYPES:
        if type(obj) is dcp_metadata._MEM_FORMAT_ENCODING:
            return
        for value in vars(obj).values():
            check_plain_metadata(value, depth + 1)
        return
    raise pickle.UnpicklingError(f'unexpected {type(obj).__name__} object in checkpoint metadata')


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata (see the module docstring); any other global is refused."""

    def __init__(self, file: BinaryIO) -> None:
        super().__init__(file)
        self._stand_ins = {key: _stand_in(key[1], make) for key, make in _constructors().items()}

    def find_class(self, module: str, name: str) -> Any:
        stand_in = self._stand_ins.get((module, name))
        if stand_in is not None:
            return stand_in
        if module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype is a plain value, not callable
        raise pickle.UnpicklingError(
            f'refusing to load {module}.{name} from checkpoint metadata (only DCP metadata classes '
            'may appear there)'
        )

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError('persistent ids do not appear in DCP metadata')


def load_metadata(file: BinaryIO) -> Any:
    """The object pickled in `file`, unpickled and checked as described above."""
    obj = MetadataUnpickler(file).load()
    check_plain_metadata(obj)
    return obj
