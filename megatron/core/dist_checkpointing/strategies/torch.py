"""The torch_dist backend: sharded tensors and objects written and read with PyTorch's
`torch.distributed.checkpoint` (DCP) storage layer.

On disk (inside the iteration directory), PyTorch's own files:

- `__{rank}_{k}.distcp`: the chunks this rank wrote (k < thread_count);
- `.metadata`: DCP's `Metadata`: for every key the global size, dtype and the list of stored
  chunks (offsets, sizes); for every ShardedObject a bytes entry. Megatron's per-key
  `mcore_data` attribute is added (empty dicts), so Megatron reads these files too.

Mapping: a ShardedTensor's key is the DCP key of one global tensor of its global shape, and
its local chunk one stored chunk (a flattened distributed-optimizer slice is stored as the few
rectangular boxes it covers, so every key keeps the model's global shape and any chunking can
read it). A ShardedObject is the bytes entry `unique_key` holding `torch.save([obj])`.

Saving: planning is collective (plans gathered on rank 0, which builds the metadata and checks
that chunks neither overlap nor leave holes); writing is local; finishing gathers the write
results to rank 0, which writes `.metadata`. The same steps serve asynchronous saves (see
async_utils.py): staging copies the tensors to CPU first.

Loading needs no collective: every rank reads `.metadata` (with an unpickler that builds only
DCP's metadata classes, so a planted file cannot run code) and then exactly the byte ranges of
the stored chunks overlapping what it requested; tensors are read with `weights_only=True`.
"""

import dataclasses
import io
import logging
import math
import os
import pickle
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    CheckpointingException,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    flat_range_boxes,
    is_main_replica,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
)

logger = logging.getLogger(__name__)

#: Classes a DCP `.metadata` pickle may build (everything else is refused).
_SAFE_METADATA_GLOBALS = {
    ('torch.distributed.checkpoint.metadata', name)
    for name in (
        'Metadata',
        'TensorStorageMetadata',
        'BytesStorageMetadata',
        'ChunkStorageMetadata',
        'TensorProperties',
        'MetadataIndex',
        'StorageMeta',
        '_MEM_FORMAT_ENCODING',
    )
} | {
    ('torch.distributed.checkpoint.filesystem', '_StorageInfo'),
    ('torch.distributed.checkpoint.filesystem', '_StoragePrefix'),
    ('torch.distributed.checkpoint._extension', 'ExtensionRegistry'),
    ('torch', 'Size'),
    ('torch', 'device'),
    ('torch', 'layout'),
    ('torch', 'strided'),
    ('torch', 'memory_format'),
    ('torch.serialization', '_get_layout'),
    ('pathlib', 'PosixPath'),
    ('pathlib', 'WindowsPath'),
    ('pathlib', 'PurePosixPath'),
    ('collections', 'OrderedDict'),
    ('builtins', 'set'),
    ('builtins', 'frozenset'),
    ('builtins', 'slice'),
    ('builtins', 'getattr'),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata; refuses any class that is not plain DCP metadata."""

    def find_class(self, module, name):
        if (module, name) in _SAFE_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == 'torch' and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(
            f'refusing to load {module}.{name} from checkpoint metadata (only DCP metadata '
            f'classes may appear there)'
        )


class SafeFileSystemReader(FileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled without running code."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, '.metadata')
        if not os.path.isfile(path):
            raise CheckpointingException(
                f'{self.path} has no .metadata file: the distributed checkpoint is incomplete'
            )
        try:
            with open(path, 'rb') as f:
                metadata = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, ValueError) as exc:
            raise CheckpointingException(f'{path} cannot be read: {exc}') from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointingException(f'{path} does not hold DCP metadata')
        return metadata


def read_metadata(checkpoint_dir: str) -> Metadata:
    """The DCP metadata of a checkpoint directory (safe unpickling)."""
    return SafeFileSystemReader(checkpoint_dir).read_metadata()


# ---------------------------------------------------------------------------------------------
# sharded tensor <-> DCP chunks


def _tensor_chunks(sh: ShardedTensor) -> List[Tuple[Tuple[int, ...], Tuple[int, ...], Any]]:
    """(global offset, size, local view) of every stored chunk a ShardedTensor covers.

    A regular ST is one chunk. A flattened ST (a 1-D slice of its local chunk) is split into
    row-major contiguous boxes of the local chunk; each box is a chunk of the global tensor.
    The view is of `sh.data` (None when sh.data is None).
    """
    n = sh.prepend_axis_num
    if sh.flattened_range is None:
        data = None if sh.data is None else sh.data.detach().view(sh.local_chunk_shape)
        return [(sh.global_offset, sh.local_chunk_shape, data)]
    out = []
    base = sh.flattened_range.start
    for box in flat_range_boxes(sh.local_shape, sh.flattened_range.start, sh.flattened_range.stop):
        offset = tuple(g + b for g, b in zip(sh.global_offset, (0,) * n + tuple(box.offset)))
        size = (1,) * n + tuple(box.shape)
        data = None
        if sh.data is not None:
            data = sh.data.detach()[box.flat_start - base : box.flat_stop - base].view(size)
        out.append((offset, size, data))
    return out


def _object_bytes(obj: Any) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save([obj], buf)
    buf.seek(0)
    return buf


class MCoreSavePlanner(SavePlanner):
    """Writes the given (write item, data) pairs; global planning is DCP's default."""

    def __init__(self, items: List[Tuple[WriteItem, Any]]):
        self._items = items
        self._data = {}
        for item, data in items:
            self._data[(item.index.fqn, item.index.offset)] = data
        self.is_coordinator = False

    def set_up_planner(self, state_dict=None, storage_meta=None, is_coordinator=False) -> None:
        self.is_coordinator = is_coordinator

    def create_local_plan(self) -> SavePlan:
        return SavePlan([item for item, _ in self._items])

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        plans, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
        metadata.mcore_data = {
            key: {}
            for key, md in metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        }
        return plans, metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        return new_plan

    def resolve_data(self, write_item: WriteItem):
        data = self._data[(write_item.index.fqn, write_item.index.offset)]
        if write_item.type == WriteItemType.BYTE_IO:
            return _object_bytes(data) if not isinstance(data, io.BytesIO) else data
        return data.detach()


def build_write_items(
    sharded_state_dict: ShardedStateDict, stage: bool = False, staging: Optional[Dict] = None
):
    """(write item, data) for every main replica of the dict.

    `stage` snapshots every tensor on the CPU (for a background write while training changes
    the parameters); buffers in `staging` (keyed by chunk) are reused across saves, so a
    steady-state snapshot is a memcpy into warm pages rather than fresh allocations.
    """
    items = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            if not is_main_replica(sh.replica_id):
                continue
            props = TensorProperties(dtype=sh.dtype)
            for offset, size, data in _tensor_chunks(sh):
                if stage:
                    data = _stage(data, (sh.key, offset), staging)
                item = WriteItem(
                    index=MetadataIndex(sh.key, torch.Size(offset)),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(offset), torch.Size(size)),
                        properties=props,
                        size=torch.Size(sh.global_shape),
                    ),
                )
                items.append((item, data))
        elif isinstance(sh, ShardedObject):
            if not is_main_replica(sh.replica_id):
                continue
            data = _object_bytes(sh.data) if stage else sh.data
            items.append(
                (WriteItem(index=MetadataIndex(sh.unique_key), type=WriteItemType.BYTE_IO), data)
            )
    return items


def _stage(data: torch.Tensor, key, staging: Optional[Dict]) -> torch.Tensor:
    if staging is None:
        return data.detach().to('cpu', copy=True)
    buf = staging.get(key)
    if buf is None or buf.shape != data.shape or buf.dtype != data.dtype:
        buf = torch.empty(data.shape, dtype=data.dtype, device='cpu')
        staging[key] = buf
    buf.copy_(data.detach())
    return buf


def _plan_key(plan: SavePlan) -> List[Tuple]:
    return [(i.index.fqn, tuple(i.index.offset or ()), i.type.value) for i in plan.items]


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes main replicas with DCP's FileSystemWriter (one file per rank and writer thread).

    Args:
        backend, version: 'torch_dist', 1.
        keep_only_main_replica: only main replicas are written (always True here).
        thread_count: files (and writer threads) per rank.
        cached_metadata: reuse the global plan of the previous save when every rank's local
            plan is unchanged (`--ckpt-assume-constant-structure`); one scalar all-reduce
            decides.
    """

    def __init__(
        self,
        backend: str = 'torch_dist',
        version: int = 1,
        keep_only_main_replica: bool = True,
        thread_count: int = 2,
        cached_metadata: bool = False,
    ):
        super().__init__(backend, version)
        self.keep_only_main_replica = keep_only_main_replica
        self.thread_count = thread_count
        self.use_cached_ckpt_structure = cached_metadata
        self._cached = None  # (local plan key, central plan, metadata)
        self._staging: Dict = {}  # reused CPU snapshot buffers of asynchronous saves

    def save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> None:
        """Synchronous save: the tensors are written from where they are (no snapshot)."""
        self._request(sharded_state_dict, checkpoint_dir, stage=False).execute_sync()

    def async_save(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> AsyncRequest:
        """Plan (collective) and snapshot now; the returned request writes and finishes.

        The caller finalizes a request before the next one starts (the snapshot buffers are
        reused)."""
        return self._request(sharded_state_dict, checkpoint_dir, stage=True)

    def _request(self, sharded_state_dict, checkpoint_dir: str, stage: bool) -> AsyncRequest:
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        coordinator = rank == 0
        items = build_write_items(sharded_state_dict, stage=stage, staging=self._staging)
        planner = MCoreSavePlanner(items)
        planner.set_up_planner(is_coordinator=coordinator)
        writer = FileSystemWriter(
            checkpoint_dir,
            single_file_per_rank=True,
            thread_count=self.thread_count,
            sync_files=True,
            overwrite=False,
        )
        writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
        central_plan, metadata = self._global_plan(planner, writer, coordinator)

        def write():
            return writer.write_data(central_plan, planner).value()

        def finish():
            results = request.result
            gathered = _gather_to_0(results)
            if coordinator:
                writer.finish(metadata, gathered)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()

        request = AsyncRequest(write, (), [finish])
        return request

    def _global_plan(self, planner, writer, coordinator):
        local_plan = writer.prepare_local_plan(planner.create_local_plan())
        key = _plan_key(local_plan)
        if self.use_cached_ckpt_structure and self._cached is not None:
            same = int(self._cached[0] == key)
            if torch.distributed.is_initialized():
                flag = torch.tensor([same], dtype=torch.int32)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
                same = int(flag.item())
            if same:
                return self._cached[1], self._cached[2]
        all_plans = _gather_to_0(local_plan)
        payload = [None]
        if coordinator:
            plans, metadata = planner.create_global_plan(all_plans)
            problems = _chunk_problems(metadata)
            if problems:
                payload = [(None, problems)]
            else:
                payload = [(writer.prepare_global_plan(plans), metadata)]
        if torch.distributed.is_initialized():
            torch.distributed.broadcast_object_list(payload, src=0)
        plans, metadata = payload[0]
        if plans is None:
            raise CheckpointingException('invalid checkpoint sharding: ' + '; '.join(metadata))
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        central_plan = planner.finish_plan(plans[rank])
        if self.use_cached_ckpt_structure:
            self._cached = (key, central_plan, metadata)
        return central_plan, metadata


def _chunk_problems(metadata: Metadata) -> List[str]:
    """Keys whose stored chunks overlap or leave holes (at most 5 named)."""
    from torch.distributed.checkpoint.default_planner import _validate_global_plan

    errors = _validate_global_plan([], metadata)
    if isinstance(errors, bool):  # older torch: a bool
        return [] if errors else ['overlapping or out-of-bounds chunks']
    problems = list(errors)
    for key, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            volume = sum(math.prod(c.sizes) for c in md.chunks)
            if volume != math.prod(md.size):
                problems.append(f'{key}: chunks cover {volume} of {math.prod(md.size)} elements')
    return problems[:5]


def _gather_to_0(obj) -> Optional[List]:
    if not torch.distributed.is_initialized():
        return [obj]
    rank = torch.distributed.get_rank()
    out = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(obj, out, dst=0)
    return out


# ---------------------------------------------------------------------------------------------
# load


class MCoreLoadPlanner(LoadPlanner):
    """Reads requested chunks (and objects) into given target tensors, in place."""

    def __init__(self, requests: List[ReadItem], targets: Dict[int, torch.Tensor], objects):
        self._requests = requests
        self._targets = targets
        self._objects = objects  # unique_key -> list of [value] boxes

    def set_up_planner(self, state_dict=None, metadata=None, is_coordinator=False) -> None:
        pass

    def create_local_plan(self) -> LoadPlan:
        return LoadPlan(self._requests)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        from megatron.core.dist_checkpointing.serialization import weights_only_load

        loaded = weights_only_load(value, what=f'object {read_item.dest_index.fqn}')
        if isinstance(loaded, list) and len(loaded) >= 1:
            loaded = loaded[0]
        for box in self._objects[read_item.dest_index.fqn]:
            box[0] = loaded

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        target = self._targets[read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            target = target.narrow(dim, start, length)
        return target

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _stored_tensor_md(metadata: Metadata, sh: ShardedTensor) -> TensorStorageMetadata:
    md = metadata.state_dict_metadata.get(sh.key)
    if md is None:
        raise CheckpointingException(
            f'{sh.key} is not in the checkpoint (requested with global shape {sh.global_shape})'
        )
    if not isinstance(md, TensorStorageMetadata):
        raise CheckpointingException(f'{sh.key} is stored as an object, requested as a tensor')
    stored = tuple(md.size)
    if stored != sh.global_shape:
        if not sh.allow_shape_mismatch or len(stored) != len(sh.global_shape):
            raise CheckpointingException(
                f'Global shape mismatch for loaded ({stored}) and expected ({sh.global_shape}) '
                f'tensor for key {sh.key}'
            )
    return md


def build_read_requests(sharded_state_dict: ShardedStateDict, metadata: Metadata):
    """ReadItems, their target views and object boxes for every ST / SO of the dict."""
    requests, targets, objects = [], {}, {}
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedObject):
            md = metadata.state_dict_metadata.get(sh.unique_key)
            if not isinstance(md, BytesStorageMetadata):
                raise CheckpointingException(
                    f'{sh.unique_key} is not in the checkpoint (objects cannot be resharded: '
                    f'the grid of {sh.key} must be {sh.global_shape})'
                )
            box = [None]
            sh.data = box
            if sh.unique_key not in objects:
                index = MetadataIndex(sh.unique_key)
                requests.append(
                    ReadItem(
                        type=LoadItemType.BYTE_IO,
                        dest_index=index,
                        dest_offsets=torch.Size((0,)),
                        storage_index=index,
                        storage_offsets=torch.Size((0,)),
                        lengths=torch.Size((0,)),
                    )
                )
            objects.setdefault(sh.unique_key, []).append(box)
            continue
        if not isinstance(sh, ShardedTensor):
            continue
        md = _stored_tensor_md(metadata, sh)
        stored = tuple(md.size)
        if stored != sh.global_shape:
            with torch.no_grad():
                sh.data.zero_()  # padded rows beyond the stored vocabulary stay zero
        for offset, size, view in _tensor_chunks(sh):
            # Clip to the stored global shape (a padded vocabulary that shrank or grew).
            clipped = tuple(max(0, min(o + s, g) - o) for o, s, g in zip(offset, size, stored))
            if any(c == 0 for c in clipped):
                continue
            for dim, c in enumerate(clipped):
                if c != size[dim]:
                    view = view.narrow(dim, 0, c)
            target_id = len(targets)
            targets[target_id] = view
            chunk = ChunkStorageMetadata(torch.Size(offset), torch.Size(clipped))
            for item in create_read_items_for_chunk_list(sh.key, md, [chunk]):
                item = dataclasses.replace(
                    item, dest_index=dataclasses.replace(item.dest_index, index=target_id)
                )
                requests.append(item)
    return requests, targets, objects


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Reads what every rank requests with DCP's FileSystemReader (no collectives)."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> ShardedStateDict:
        reader = SafeFileSystemReader(checkpoint_dir)
        metadata = reader.read_metadata()
        requests, targets, objects = build_read_requests(sharded_state_dict, metadata)
        reader.set_up_storage_reader(metadata, False)
        planner = MCoreLoadPlanner(requests, targets, objects)
        plan = reader.prepare_local_plan(planner.create_local_plan())
        try:
            reader.read_data(plan, planner).wait()
        except FileNotFoundError as exc:
            name = os.path.basename(exc.filename or str(exc))
            raise CheckpointingException(
                f'{checkpoint_dir} is incomplete: {name} is missing (the files of global rank '
                f'{name[2:].split("_")[0] if name.startswith("__") else "?"} of the save)'
            ) from exc
        for sh in nested_values(sharded_state_dict):
            if isinstance(sh, ShardedObject):
                sh.data = sh.data[0]
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: str) -> Dict[str, ShardedTensor]:
        metadata = read_metadata(checkpoint_dir)
        out = {}
        for key, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                shape = tuple(md.size)
                out[key] = ShardedTensor(
                    key,
                    None,
                    md.properties.dtype,
                    shape,
                    shape,
                    (0,) * len(shape),
                    (1,) * len(shape),
                )
        return out

    def stored_keys(self, checkpoint_dir: str) -> set:
        """Every tensor key and object unique key in the checkpoint."""
        return set(read_metadata(checkpoint_dir).state_dict_metadata)
