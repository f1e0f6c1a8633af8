"""`save` and `load` of sharded state dicts: Megatron's dist_checkpointing entry points.

A checkpoint directory holds `common.pt` (rank 0's non-sharded state, `torch.save`), the
sharded backend's files (torch_dist: DCP's `.distcp` + `.metadata`) and `metadata.json`,
written last (core.py). Order of a save: `common.pt` -> sharded files -> `.metadata` ->
`metadata.json`; the trainer moves its tracker file after that, so no reader ever takes a
partial directory for a checkpoint.

Loading is weights only: `common.pt` and every stored object are read with
`torch.load(weights_only=True)` (tensors, containers, numbers, strings and the few classes in
`SAFE_GLOBALS`), and DCP's `.metadata` with an unpickler restricted to DCP's classes.
"""

import io
import logging
import os
from typing import Any, Dict, List, Optional, Tuple, Union

import torch

from megatron.core.dist_checkpointing.core import (
    CheckpointingConfig,
    maybe_load_config,
    save_config,
)
from megatron.core.dist_checkpointing.dict_utils import (
    dict_list_map_inplace,
    extract_matching_values,
    merge,
    nested_values,
)
from megatron.core.dist_checkpointing.mapping import (  # noqa: F401  (apply_*: Megatron's names)
    CheckpointingException,
    LocalNonpersistentObject,
    ShardedBase,
    ShardedObject,
    ShardedStateDict,
    ShardedTensor,
    ShardedTensorFactory,
    apply_factories,
    apply_factory_merges,
)
from megatron.core.dist_checkpointing.safe_load import (  # noqa: F401  (Megatron's names)
    SAFE_GLOBALS,
    weights_only_load,
)
from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest
from megatron.core.dist_checkpointing.strategies.base import (
    AsyncSaveShardedStrategy,
    LoadShardedStrategy,
    SavePreflight,
    SaveShardedStrategy,
    StrategyAction,
    get_default_strategy,
)
from megatron.core.dist_checkpointing.strategies.defaults import (
    get_default_load_sharded_strategy,
    get_default_save_sharded_strategy,
)
from megatron.core.dist_checkpointing.validation import (
    StrictHandling,
    determine_mismatch,
    local_sharding_records,
    mismatch_message,
    parse_strict_flag,
    validate_sharding_integrity,
)

logger = logging.getLogger(__name__)

COMMON_STATE_FNAME = 'common.pt'


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


# ---------------------------------------------------------------------------------------------
# factories and non-persistent objects


def _is_sharded(x) -> bool:
    return isinstance(x, ShardedBase)


# ---------------------------------------------------------------------------------------------
# save


def _directory_problem(checkpoint_dir: str) -> Optional[str]:
    """Rank 0: what is wrong with the target directory (None on other ranks and when fine)."""
    if _rank() != 0:
        return None
    if not os.path.isdir(checkpoint_dir):
        return f'Checkpoint destination directory does not exist: {checkpoint_dir}'
    if os.listdir(checkpoint_dir):
        return f'Checkpoint destination directory ({checkpoint_dir}) is not empty'
    return None


def _check_directory(checkpoint_dir: str) -> None:
    """Rank 0: the target exists and is empty (collective verdict)."""
    problem = _directory_problem(checkpoint_dir)
    if torch.distributed.is_initialized():
        box = [problem]
        torch.distributed.broadcast_object_list(box, src=0)
        problem = box[0]
    if problem:
        raise CheckpointingException(problem)


def _atomic_write(data: bytes, path: str) -> None:
    tmp = path + '.tmp'
    with open(tmp, 'wb') as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _serialized(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def save(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Optional[SaveShardedStrategy] = None,
    common_strategy=None,
    validate_access_integrity: bool = True,
    async_sharded_save: bool = False,
) -> Optional[AsyncRequest]:
    """Collective: write a sharded state dict into the empty directory `checkpoint_dir`.

    With the torch_dist strategies the directory check, the sharding check and the planning
    are one exchange, and so are the end checks and the metadata writes (see strategies/).
    common.pt is serialized at once (rank 0) and written with the sharded files.

    Args:
        sharded_state_dict: nested dict of ShardedTensor / ShardedObject / factories / common
            values (rank 0's common values are written to common.pt).
        checkpoint_dir: an existing, empty directory.
        sharded_strategy: default: torch_dist.
        common_strategy: unused (the torch common backend); for Megatron signature parity.
        validate_access_integrity: check the sharding across ranks first.
        async_sharded_save: return an AsyncRequest that writes the files and, when finalized,
            the metadata and metadata.json, instead of writing them now.

    Returns:
        None, or the AsyncRequest with `async_sharded_save`.
    """
    if common_strategy is not None and getattr(common_strategy, 'backend', 'torch') != 'torch':
        raise CheckpointingException('only the torch common backend is supported')
    if sharded_strategy is None:
        sharded_strategy = get_default_save_sharded_strategy()
    elif isinstance(sharded_strategy, tuple):  # Megatron's (backend, version) form
        sharded_strategy = get_default_strategy(StrategyAction.SAVE_SHARDED, *sharded_strategy)
    if async_sharded_save and not isinstance(sharded_strategy, AsyncSaveShardedStrategy):
        raise CheckpointingException(
            f'{type(sharded_strategy).__name__} cannot save asynchronously'
        )

    apply_factories(sharded_state_dict)
    _, sharded_state_dict = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, LocalNonpersistentObject)
    )
    sharded_part, common_part = extract_matching_values(sharded_state_dict, _is_sharded)
    common_path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    config = CheckpointingConfig(sharded_strategy.backend, sharded_strategy.version)

    if getattr(sharded_strategy, 'supports_preflight', False):
        preflight = SavePreflight(
            local_sharding_records(sharded_part) if validate_access_integrity else None,
            _directory_problem(checkpoint_dir),
        )
        request = sharded_strategy.save_request(
            sharded_part, checkpoint_dir, async_sharded_save, preflight
        )
    else:
        _check_directory(checkpoint_dir)
        if validate_access_integrity:
            validate_sharding_integrity(sharded_part)
        if not async_sharded_save:
            if _rank() == 0:
                _atomic_write(_serialized(common_part), common_path)
            sharded_strategy.save(sharded_part, checkpoint_dir)
            if _rank() == 0:
                save_config(config, checkpoint_dir)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            return None
        request = sharded_strategy.async_save(sharded_part, checkpoint_dir)

    common_bytes = _serialized(common_part) if _rank() == 0 else None
    write_sharded = request.async_fn

    def write_common_then_sharded(*args):
        if common_bytes is not None:
            _atomic_write(common_bytes, common_path)
        return None if write_sharded is None else write_sharded(*args)

    request.async_fn = write_common_then_sharded
    request.add_coordinator_fn(lambda _results: save_config(config, checkpoint_dir))
    if async_sharded_save:
        return request
    request.execute_sync()
    return None


# ---------------------------------------------------------------------------------------------
# load


def load_common_state_dict(checkpoint_dir: str) -> Dict[str, Any]:
    """common.pt of a checkpoint, weights only (no collective)."""
    path = os.path.join(checkpoint_dir, COMMON_STATE_FNAME)
    if not os.path.isfile(path):
        raise CheckpointingException(
            f'{path} is missing: {checkpoint_dir} is not a complete distributed checkpoint'
        )
    return weights_only_load(path, what=path)


def _require_dist_checkpoint(checkpoint_dir: str) -> CheckpointingConfig:
    config = maybe_load_config(checkpoint_dir)
    if config is None:
        raise CheckpointingException(
            f'{checkpoint_dir} is not a distributed checkpoint (no metadata.json): the save did '
            f'not finish or it is a torch-format checkpoint'
        )
    return config


def load_tensors_metadata(
    checkpoint_dir: str, sharded_strategy: Optional[LoadShardedStrategy] = None
) -> Dict[str, ShardedTensor]:
    """{key: ShardedTensor without data} with the stored global shape and dtype of every tensor."""
    _require_dist_checkpoint(checkpoint_dir)
    strategy = sharded_strategy or get_default_load_sharded_strategy(checkpoint_dir)
    return strategy.load_tensors_metadata(checkpoint_dir)


def load_sharded_metadata(
    checkpoint_dir: str, sharded_strategy: Optional[LoadShardedStrategy] = None
) -> Dict[str, Any]:
    """{key: metadata} of the stored tensors (and objects, where the strategy lists them)."""
    _require_dist_checkpoint(checkpoint_dir)
    strategy = sharded_strategy or get_default_load_sharded_strategy(checkpoint_dir)
    return strategy.load_sharded_metadata(checkpoint_dir)


def load_plain_tensors(checkpoint_dir: str) -> Dict[str, torch.Tensor]:
    """Every stored tensor, whole (for inspection and conversion tools; no collective)."""
    metadata = load_tensors_metadata(checkpoint_dir)
    for sh in metadata.values():
        sh.data = torch.empty(sh.global_shape, dtype=sh.dtype)
    strategy = get_default_load_sharded_strategy(checkpoint_dir)
    strategy.load(metadata, checkpoint_dir)
    return {key: sh.data for key, sh in metadata.items()}


def _handle_strictness(sharded_part, checkpoint_dir, strategy, strict: StrictHandling):
    """Drop / log / raise / return key mismatches; returns (sharded_part, missing, unexpected)."""
    if not StrictHandling.requires_explicit_ckpt_mismatch_check(strict):
        return sharded_part, [], []
    requested = [
        sh for sh in nested_values(sharded_part) if isinstance(sh, (ShardedTensor, ShardedObject))
    ]
    stored = strategy.stored_keys(checkpoint_dir)
    global_requested = None
    if StrictHandling.requires_global_app_metadata(strict):
        local_keys = {
            sh.unique_key if isinstance(sh, ShardedObject) else sh.key for sh in requested
        }
        if torch.distributed.is_initialized():
            gathered = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, local_keys)
        else:
            gathered = [local_keys]
        global_requested = set().union(*gathered)
    missing, unexpected = determine_mismatch(requested, stored, global_requested)
    message = mismatch_message(missing, unexpected)
    if strict in (StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL) and message:
        raise CheckpointingException(message)
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and message:
        logger.warning(message)
    if unexpected:
        drop = set(unexpected)
        _, sharded_part = extract_matching_values(
            sharded_part,
            lambda x: (
                isinstance(x, (ShardedTensor, ShardedObject))
                and (x.unique_key if isinstance(x, ShardedObject) else x.key) in drop
            ),
        )
    return sharded_part, missing, unexpected


def _unwrap(x):
    if isinstance(x, ShardedTensor):
        return x.data
    if isinstance(x, ShardedObject):
        return x.data
    return x


def load(
    sharded_state_dict: ShardedStateDict,
    checkpoint_dir: str,
    sharded_strategy: Optional[LoadShardedStrategy] = None,
    common_strategy=None,
    validate_access_integrity: bool = True,
    strict: Union[str, StrictHandling] = StrictHandling.ASSUME_OK_UNEXPECTED,
) -> Union[Dict[str, Any], Tuple[Dict[str, Any], List[str], List[str]]]:
    """Load the layout `sharded_state_dict` describes from `checkpoint_dir`, in place.

    The request may use any parallel layout: every rank reads the overlap of each of its
    chunks with the stored chunks. Tensors are loaded into the given `data` tensors.

    Args:
        sharded_state_dict: the request (this run's layout); its common values are replaced by
            the checkpoint's.
        checkpoint_dir: a distributed checkpoint directory.
        sharded_strategy: default: chosen by the checkpoint's metadata.json.
        common_strategy: unused (for Megatron signature parity).
        validate_access_integrity: check the requested sharding across ranks (one gather).
        strict: StrictHandling (or its value), see validation.py.

    Returns:
        the loaded state dict (tensors, objects and common values in their places); with a
        `return_*` strictness the tuple (state dict, missing keys, unexpected keys).
    """
    _require_dist_checkpoint(checkpoint_dir)
    strict = parse_strict_flag(strict)
    strategy = sharded_strategy or get_default_load_sharded_strategy(checkpoint_dir)
    common = load_common_state_dict(checkpoint_dir)

    apply_factories(sharded_state_dict)
    nonpersistent, sharded_state_dict = extract_matching_values(
        sharded_state_dict, lambda x: isinstance(x, LocalNonpersistentObject)
    )
    dict_list_map_inplace(lambda x: x.unwrap(), nonpersistent)
    sharded_part, _ = extract_matching_values(sharded_state_dict, _is_sharded)
    sharded_part, missing, unexpected = _handle_strictness(
        sharded_part, checkpoint_dir, strategy, strict
    )
    if validate_access_integrity:
        validate_sharding_integrity(sharded_part)
    loaded = strategy.load(sharded_part, checkpoint_dir)
    loaded = dict_list_map_inplace(_unwrap, loaded)
    loaded = apply_factory_merges(loaded)
    merge(common, loaded)
    merge(common, nonpersistent)
    if StrictHandling.requires_returning_mismatch_keys(strict):
        return common, missing, unexpected
    return common
