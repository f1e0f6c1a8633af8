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

Saving: planning is one exchange (every rank's write records and sharding records, plain
tuples, gathered on rank 0, which checks the sharding, builds the metadata, checks that chunks
neither overlap nor leave holes, and broadcasts the verdict; none with an unchanged structure
under `--ckpt-assume-constant-structure`); writing is local (no intermediate copy of a tensor
that views a larger buffer); finishing gathers the write results to rank 0, which writes
`.metadata`. The same steps serve asynchronous saves (see async_utils.py), all but the
pickling of mutable objects in the writer thread: it builds the write list and copies the
tensors to CPU (staging) while the trainer's next forward and backward run, then takes part in
the planning exchange over a gloo group of its own and writes.

Loading needs no collective: every rank reads `.metadata` (with an unpickler that builds only
DCP's metadata classes, so a planted file cannot run code; parsed once per load) and then the
byte ranges of the stored chunks overlapping what it requested, straight into the requesting
tensors (direct_reader.py; records are interpreted with `torch.load(weights_only=True)`).
"""

import dataclasses
import io
import logging
import math
import os
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import create_default_global_save_plan
from torch.distributed.checkpoint.filesystem import _StoragePrefix
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
from megatron.core.dist_checkpointing.safe_load import weights_only_load
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    SavePreflight,
)
from megatron.core.dist_checkpointing.strategies.direct_reader import DirectFileSystemReader
from megatron.core.dist_checkpointing.strategies.metadata_unpickler import load_metadata
from megatron.core.dist_checkpointing.validation import sharding_problems
from megatron.core.utils import get_current_device

logger = logging.getLogger(__name__)


class SafeFileSystemReader(DirectFileSystemReader):
    """FileSystemReader whose `.metadata` is unpickled without running code and whose tensor
    records are read straight into their targets (direct_reader.py)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = os.path.join(self.path, '.metadata')
        if not os.path.isfile(path):
            raise CheckpointingException(
                f'{self.path} has no .metadata file: the distributed checkpoint is incomplete'
            )
        try:
            with open(path, 'rb') as f:
                metadata = load_metadata(f)
        except Exception as exc:  # anything a corrupt or planted pickle raises
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointingException(f'{path} cannot be read: {reason}') from exc
        if not isinstance(metadata, Metadata):
            raise CheckpointingException(f'{path} does not hold DCP metadata')
        return metadata


_METADATA_CACHE: Dict[Tuple, Metadata] = {}


def read_metadata(checkpoint_dir: str) -> Metadata:
    """The DCP metadata of a checkpoint directory (safe unpickling).

    One load asks for it several times (strictness, optional keys, the read itself): the parsed
    object is kept per file identity (path, inode, size, mtime), which a rewritten `.metadata`
    (DCP writes a temporary file and renames it) always changes. Callers must not modify it.
    """
    path = os.path.abspath(os.path.join(checkpoint_dir, '.metadata'))
    try:
        st = os.stat(path)
    except OSError:
        return SafeFileSystemReader(checkpoint_dir).read_metadata()  # raises the one-line error
    key = (path, st.st_ino, st.st_size, st.st_mtime_ns)
    if key not in _METADATA_CACHE:
        metadata = SafeFileSystemReader(checkpoint_dir).read_metadata()
        if len(_METADATA_CACHE) >= 4:
            _METADATA_CACHE.pop(next(iter(_METADATA_CACHE)))
        _METADATA_CACHE[key] = metadata
    return _METADATA_CACHE[key]


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


_NONE_BYTES: List[bytes] = []  # torch.save([None]), computed once


def _object_bytes(obj: Any) -> io.BytesIO:
    if obj is None:  # the empty `_extra_state` of every linear layer: pickled once per process
        if not _NONE_BYTES:
            _NONE_BYTES.append(_pickled([None]))
        return io.BytesIO(_NONE_BYTES[0])
    return io.BytesIO(_pickled([obj]))


def _pickled(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _compact(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, or an alias of it whose storage is exactly its bytes.

    `torch.save` writes whole storages, so DCP clones a CPU tensor whose storage is larger than
    its data (a parameter viewing a contiguous buffer, a distributed-optimizer slice) before
    writing it. The alias (a storage slice: no copy) gives the same bytes on disk."""
    if tensor.device.type != 'cpu' or not tensor.is_contiguous():
        return tensor
    nbytes = tensor.numel() * tensor.element_size()
    storage = tensor.untyped_storage()
    if storage.nbytes() == nbytes:
        return tensor
    start = tensor.storage_offset() * tensor.element_size()
    alias = torch.empty(0, dtype=tensor.dtype)
    return alias.set_(storage[start : start + nbytes], 0, tensor.shape, tensor.stride())


class MCoreSavePlanner(SavePlanner):
    """Writes the given (write item, data) pairs.

    `create_global_plan` is DCP's default (for callers driving DCP themselves); the strategy
    below builds the same metadata from compact records (`build_global_metadata`)."""

    def __init__(self, items: List[Tuple[WriteItem, Any]]):
        self._items = items
        self._data = {}
        self.set_data(items)
        self.is_coordinator = False

    def items(self) -> List[Tuple[WriteItem, Any]]:
        return self._items

    def set_data(self, items: List[Tuple[WriteItem, Any]]) -> None:
        """Write `items`' data (the same write items, e.g. their staged snapshots)."""
        for item, data in items:
            self._data[(item.index.fqn, item.index.offset)] = data

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
        return _compact(data.detach())


def build_write_items(
    sharded_state_dict: ShardedStateDict, stage: bool = False, staging: Optional[Dict] = None
):
    """(write item, data) for every main replica of the dict.

    `stage` snapshots every tensor on the CPU (for a background write while training changes
    the parameters); see `_stage_all`.
    """
    pickled = pickled_objects(sharded_state_dict) if stage else None
    items = _write_items(sharded_state_dict, pickled)
    return _stage_all(items, staging) if stage else items


def pickled_objects(sharded_state_dict: ShardedStateDict) -> Dict[str, io.BytesIO]:
    """The bytes of every main-replica object that is not a `snapshot`, by unique key.

    An asynchronous save pickles them in the save call: their values may change as soon as it
    returns (a snapshot object is a private copy, pickled by the writer)."""
    return {
        sh.unique_key: _object_bytes(sh.data)
        for sh in nested_values(sharded_state_dict)
        if isinstance(sh, ShardedObject) and is_main_replica(sh.replica_id) and not sh.snapshot
    }


def _write_items(sharded_state_dict: ShardedStateDict, pickled: Optional[Dict] = None):
    """(write item, data) for every main replica, tensors as they are; an object's data is its
    bytes in `pickled` when there, else the object itself."""
    items = []
    for sh in nested_values(sharded_state_dict):
        if isinstance(sh, ShardedTensor):
            if not is_main_replica(sh.replica_id):
                continue
            props = TensorProperties(dtype=sh.dtype)
            for offset, size, data in _tensor_chunks(sh):
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
            data = sh.data if pickled is None else pickled.get(sh.unique_key, sh.data)
            items.append(
                (WriteItem(index=MetadataIndex(sh.unique_key), type=WriteItemType.BYTE_IO), data)
            )
    return items


def _stage_all(items: List[Tuple[WriteItem, Any]], staging: Optional[Dict]) -> List[Tuple]:
    """The items with every tensor replaced by a CPU snapshot, each byte copied once.

    Tensors whose memory lies inside another item's (the fp32 main parameters of the
    distributed optimizer are views of the fp32 model parameters, so both keys hold the same
    bytes) become views of that item's snapshot instead of a second copy. Snapshot buffers in
    `staging` (keyed by chunk) are reused across saves: a steady-state snapshot is a memcpy
    into warm pages rather than fresh allocations.
    """
    spans = []  # (start address, -nbytes, index) of contiguous tensors
    for i, (item, data) in enumerate(items):
        if isinstance(data, torch.Tensor) and data.is_contiguous() and data.numel() > 0:
            nbytes = data.numel() * data.element_size()
            spans.append((data.data_ptr(), -nbytes, i))
    host_of = {}  # item index -> index of the item whose snapshot holds its bytes
    host, host_end = None, -1
    for start, neg_nbytes, i in sorted(spans):
        data, host_data = items[i][1], None if host is None else items[host][1]
        inside = (
            host is not None
            and start - neg_nbytes <= host_end
            and data.device == host_data.device
            and (start - host_data.data_ptr()) % data.element_size() == 0
        )
        if inside:
            host_of[i] = host
        elif start - neg_nbytes > host_end:
            host, host_end = i, start - neg_nbytes
    staged = list(items)
    for i, (item, data) in enumerate(items):
        if isinstance(data, torch.Tensor) and i not in host_of:
            key = (item.index.fqn, tuple(item.index.offset))
            staged[i] = (item, _stage(data, key, staging))
    for i, h in host_of.items():
        data, host_data, host_copy = items[i][1], items[h][1], staged[h][1]
        first = data.data_ptr() - host_data.data_ptr()
        nbytes = data.numel() * data.element_size()
        host_bytes = host_copy.view(-1).view(torch.uint8)
        view = host_bytes[first : first + nbytes].view(data.dtype).view(data.shape)
        staged[i] = (items[i][0], view)
    return staged


def _stage(data: torch.Tensor, key, staging: Optional[Dict]) -> torch.Tensor:
    if staging is None:
        return data.detach().to('cpu', copy=True)
    buf = staging.get(key)
    if buf is None or buf.shape != data.shape or buf.dtype != data.dtype:
        buf = torch.empty(data.shape, dtype=data.dtype, device='cpu')
        staging[key] = buf
    buf.copy_(data.detach())
    return buf


def _write_records(items: List[Tuple[WriteItem, Any]]) -> List[Tuple]:
    """This rank's contribution to the global metadata, as plain tuples (cheap to gather):
    (key,) for an object, (key, chunk offsets, chunk sizes, dtype, global size) for a tensor."""
    records = []
    for item, _ in items:
        if item.type == WriteItemType.BYTE_IO:
            records.append((item.index.fqn,))
        else:
            td = item.tensor_data
            records.append(
                (
                    item.index.fqn,
                    tuple(td.chunk.offsets),
                    tuple(td.chunk.sizes),
                    td.properties.dtype,
                    tuple(td.size),
                )
            )
    return records


def build_global_metadata(all_records: List[List[Tuple]]) -> Tuple[Metadata, List[str]]:
    """DCP's Metadata of every rank's `_write_records` (what DCP's default global plan builds
    from the ranks' save plans, in the same order), and the objects written twice."""
    md: Dict[str, Any] = {}
    problems = []
    for rank, records in enumerate(all_records):
        for rec in records:
            if len(rec) == 1:
                if rec[0] in md:
                    problems.append(f'{rec[0]} is written by more than one rank (again by {rank})')
                md[rec[0]] = BytesStorageMetadata()
                continue
            key, offsets, sizes, dtype, size = rec
            tensor_md = md.get(key)
            if tensor_md is None:
                tensor_md = md[key] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype), size=torch.Size(size), chunks=[]
                )
            tensor_md.chunks.append(ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)))
    metadata = Metadata(md)
    metadata.mcore_data = {
        key: {} for key, value in md.items() if isinstance(value, TensorStorageMetadata)
    }
    return metadata, problems


def _global_verdict(gathered: List[Tuple]) -> Tuple[Optional[str], Optional[Metadata]]:
    """Rank 0: (error message or None, metadata) of every rank's (write records, sharding
    records, problem)."""
    for _, _, problem in gathered:
        if problem:
            return problem, None
    if any(sharding is not None for _, sharding, _ in gathered):
        problems = sharding_problems([sharding or [] for _, sharding, _ in gathered])
        if problems:
            return '; '.join(problems), None
    metadata, problems = build_global_metadata([records for records, _, _ in gathered])
    problems = (problems + _chunk_problems(metadata))[:5]
    if problems:
        return 'invalid checkpoint sharding: ' + '; '.join(problems), None
    return None, metadata


class TorchDistSaveShardedStrategy(AsyncSaveShardedStrategy):
    """Writes main replicas with DCP's FileSystemWriter (one file per rank and writer thread).

    Planning is one exchange: every rank's write records and sharding records (SavePreflight)
    are gathered on rank 0, which checks the sharding, builds DCP's metadata (both skipped when
    the gathered records equal those of the last accepted save) and broadcasts the verdict;
    every rank's own plan is its items under its file prefix `__{rank}_`, as in DCP.
    Finishing is the request's one exchange (async_utils.py).

    Args:
        backend, version: 'torch_dist', 1.
        keep_only_main_replica: only main replicas are written (always True here).
        thread_count: files (and writer threads) per rank.
        cached_metadata: when every rank's records equal those of the previous save
            (`--ckpt-assume-constant-structure`; one scalar all-reduce decides), reuse its
            verdict and metadata instead of the exchange.
    """

    supports_preflight = True

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
        self._cached = None  # (records key, metadata on rank 0)
        self._accepted = None  # rank 0: (gathered records, metadata) of the last valid plan
        self._staging: Dict = {}  # reused CPU snapshot buffers of asynchronous saves

    def save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str,
        preflight: Optional[SavePreflight] = None,
    ) -> None:
        """Synchronous save: the tensors are written from where they are (no snapshot)."""
        self.save_request(sharded_state_dict, checkpoint_dir, False, preflight).execute_sync()

    def async_save(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str,
        preflight: Optional[SavePreflight] = None,
    ) -> AsyncRequest:
        """Plan (collective) now; the returned request snapshots (its `stage_fn`), writes and
        finishes.

        The caller does not change the saved tensors before the request is staged
        (`AsyncRequest.wait_until_staged`) and finalizes a request before the next one starts
        (the snapshot buffers are reused)."""
        return self.save_request(sharded_state_dict, checkpoint_dir, True, preflight)

    def save_request(
        self,
        sharded_state_dict: ShardedStateDict,
        checkpoint_dir: str,
        stage: bool,
        preflight: Optional[SavePreflight] = None,
    ) -> AsyncRequest:
        """The request that writes this rank's files and, when finalized, DCP's `.metadata`
        (rank 0).

        Without `stage` the planning exchange runs now (collective; a problem raises on every
        rank). With `stage` the save call only pickles the objects that may change
        (`pickled_objects`); the writer thread builds the write list and snapshots the tensors
        (the request's `stage_fn`), then plans over a process group of its own (so its
        collectives never interleave with training's) and writes; a problem then fails the
        request on every rank at finalization."""
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        writer = FileSystemWriter(
            checkpoint_dir,
            single_file_per_rank=True,
            thread_count=self.thread_count,
            sync_files=True,
            overwrite=False,
        )
        writer.set_up_storage_writer(rank == 0, rank=rank, use_collectives=True)
        done: Dict[str, Any] = {}  # what the steps below hand on

        def write_metadata(results):
            writer.finish(done['metadata'], results)

        if not stage:
            items = _write_items(sharded_state_dict)
            planner = MCoreSavePlanner(items)
            plan, done['metadata'] = self._local_and_global_plan(
                planner, writer, preflight, rank, None
            )
            return AsyncRequest(
                lambda: writer.write_data(plan, planner).value(),
                coordinator_fns=[write_metadata],
            )

        pickled = pickled_objects(sharded_state_dict)
        group = _planning_group()

        def snapshot():
            try:
                items = _write_items(sharded_state_dict, pickled)
                done['planner'] = MCoreSavePlanner(_stage_all(items, self._staging))
            except Exception as exc:  # every rank must still take part in the planning
                done['problem'] = f'rank {rank}: staging failed: {exc!r}'

        def plan_and_write():
            problem = done.get('problem') or (preflight.problem if preflight else None)
            planner = done.get('planner') or MCoreSavePlanner([])
            checks = dataclasses.replace(preflight or SavePreflight(), problem=problem)
            plan, done['metadata'] = self._local_and_global_plan(
                planner, writer, checks, rank, group
            )
            return writer.write_data(plan, planner).value()

        return AsyncRequest(plan_and_write, coordinator_fns=[write_metadata], stage_fn=snapshot)

    def _local_and_global_plan(self, planner, writer, preflight, rank, group):
        """Collective over `group` (None: the default one): this rank's DCP plan under its file
        prefix and the global metadata (rank 0; None elsewhere), or the same error raised on
        every rank."""
        planner.set_up_planner(is_coordinator=rank == 0)
        problem = preflight.problem if preflight is not None else None
        try:
            local_plan = writer.prepare_local_plan(planner.create_local_plan())
        except Exception as exc:  # reported on every rank by the exchange
            problem = problem or f'rank {rank}: {exc}'
            local_plan = None
        sharding = preflight.sharding if preflight is not None else None
        records = _write_records(planner.items())
        metadata = self._plan(records, sharding, problem, rank == 0, group)
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f'__{rank}_')), metadata

    def _plan(self, records, sharding, problem, coordinator, group=None) -> Optional[Metadata]:
        """Collective over `group`: the global metadata (rank 0; None elsewhere) or the same
        error raised on every rank."""
        key = (records, sharding)
        if self.use_cached_ckpt_structure and self._cached is not None:
            same = int(problem is None and self._cached[0] == key)
            if torch.distributed.is_initialized():
                device = 'cpu' if group is not None else get_current_device()
                flag = torch.tensor([same], dtype=torch.int32, device=device)
                torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN, group=group)
                same = int(flag.item())
            if same:
                return self._cached[1]
        gathered = _gather_to_0((records, sharding, problem), group)
        verdict, metadata = None, None
        if coordinator:
            # The verdict is a function of what was gathered: an unchanged structure (every
            # save of a training run) reuses the last accepted one instead of checking again.
            if self._accepted is not None and self._accepted[0] == gathered:
                metadata = self._accepted[1]
            else:
                verdict, metadata = _global_verdict(gathered)
                self._accepted = None if verdict else (gathered, metadata)
        if torch.distributed.is_initialized():
            box = [verdict]
            torch.distributed.broadcast_object_list(box, src=0, group=group)
            verdict = box[0]
        if verdict:
            raise CheckpointingException(verdict)
        if self.use_cached_ckpt_structure:
            self._cached = (key, metadata)
        return metadata


_PLANNING_GROUP: List[Tuple[Any, Any]] = []  # (the default group it was made in, the group)


def _planning_group():
    """A gloo group of every rank for the writer threads' planning exchange, made once per
    default process group (collective: every rank calls it in the same save), or None when
    torch.distributed is not initialized. Its own group keeps the exchange, which runs while
    the main thread communicates, apart from training's collectives; gloo because the
    exchange is of pickled objects (CPU)."""
    if not torch.distributed.is_initialized():
        return None
    world = torch.distributed.group.WORLD
    if not _PLANNING_GROUP or _PLANNING_GROUP[0][0] is not world:
        _PLANNING_GROUP[:] = [(world, torch.distributed.new_group(backend='gloo'))]
    return _PLANNING_GROUP[0][1]


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


def _gather_to_0(obj, group=None) -> Optional[List]:
    if not torch.distributed.is_initialized():
        return [obj]
    rank = torch.distributed.get_rank()
    out = [None] * torch.distributed.get_world_size() if rank == 0 else None
    torch.distributed.gather_object(obj, out, dst=0, group=group)
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


def _rank_of(name: str) -> str:
    return name[2:].split('_')[0] if name.startswith('__') else '?'


def check_storage_files(checkpoint_dir: str, metadata: Metadata) -> None:
    """Raise CheckpointingException unless every `.distcp` file the metadata names exists and
    is long enough for its records.

    Every rank checks every file (a stat each), so a missing or truncated file stops all ranks
    with the same line before any of them reads, instead of the one reading rank failing while
    the others wait in the next collective.
    """
    needed: Dict[str, int] = {}
    for info in metadata.storage_data.values():
        end = info.offset + info.length
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    for name in sorted(needed):
        path = os.path.join(checkpoint_dir, name)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            raise CheckpointingException(
                f'{checkpoint_dir} is incomplete: {name} is missing (the files of global rank '
                f'{_rank_of(name)} of the save)'
            ) from None
        if size < needed[name]:
            raise CheckpointingException(
                f'{path} is truncated: {size} bytes, its records end at byte {needed[name]} '
                '(the save did not finish, or the file was damaged)'
            )


class TorchDistLoadShardedStrategy(LoadShardedStrategy):
    """Reads what every rank requests with DCP's FileSystemReader (no collectives)."""

    def load(self, sharded_state_dict: ShardedStateDict, checkpoint_dir: str) -> ShardedStateDict:
        reader = SafeFileSystemReader(checkpoint_dir)
        metadata = read_metadata(checkpoint_dir)
        check_storage_files(checkpoint_dir, metadata)
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
                f'{_rank_of(name)} of the save)'
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

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load_sharded_metadata(self, checkpoint_dir: str) -> Dict[str, Any]:
        """load_tensors_metadata plus a data-less ShardedObject per stored object shard, keyed
        by its unique key (`{key}/shard_{offsets}_{shape}`), as Megatron's."""
        out: Dict[str, Any] = {}
        for key, md in read_metadata(checkpoint_dir).state_dict_metadata.items():
            if not isinstance(md, TensorStorageMetadata) and '/shard_' in key:
                out[key] = ShardedObject.empty_from_unique_key(key)
        out.update(self.load_tensors_metadata(checkpoint_dir))
        return out

    def stored_keys(self, checkpoint_dir: str) -> set:
        """Every tensor key and object unique key in the checkpoint."""
        return set(read_metadata(checkpoint_dir).state_dict_metadata)
