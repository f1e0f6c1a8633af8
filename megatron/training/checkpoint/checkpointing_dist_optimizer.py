"""Loading optimizer state saved by a run whose optimizer was split differently.

A model with expert-parallel parameters (MoE at expert parallel size > 1) trains with a chain of
two optimizers, dense and expert (Megatron's `ChainedOptimizer`); every key of sub-optimizer k
carries the prefix `chained_{k}.` (`chained_1.optimizer.state.exp_avg.<model key>`) and the
common state is `{0: {...}, 1: {...}}`. At expert parallel size 1 the same model has one
optimizer and unprefixed keys. Megatron r0.8 therefore cannot resume an EP2 checkpoint at EP1
with its optimizer state.

Here the requested optimizer tensors are matched to the stored ones by their model key (unique
across the sub-optimizers), whatever the prefixes, and when the number of sub-optimizers
differs, the shared step and loss scaler come from the checkpoint while the param-group
hyperparameters stay this run's (the scheduler sets lr and weight decay at every step anyway).
"""

import copy
import re
from typing import Any, Dict, List, Optional, Set

from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedTensor,
    ShardedTensorFactory,
)
from megatron.core.dist_checkpointing.optimizer import loaded_common_state

_CHAINED_PREFIX = re.compile(r'^chained_\d+\.')


def _unchained(key: str) -> str:
    return _CHAINED_PREFIX.sub('', key, count=1)


def sub_optimizers(optimizer) -> List:
    """The run's optimizers: the chain's members, or the optimizer itself."""
    return list(getattr(optimizer, 'chained_optimizers', None) or [optimizer])


def stored_sub_optimizer_count(common_optimizer: Any) -> int:
    """How many optimizers wrote the checkpoint's optimizer state (common.pt's structure)."""
    if isinstance(common_optimizer, dict) and common_optimizer:
        indices = [k for k in common_optimizer if isinstance(k, int)]
        if indices and len(indices) == len(common_optimizer):
            return len(indices)
    return 1


def match_optimizer_keys(optimizer_state_dict, stored: Set[str]) -> int:
    """Rename requested optimizer tensors absent from the checkpoint to the stored key with the
    same model key and another `chained_{k}.` prefix (or none), in place.

    Returns:
        the number of renamed requests.
    """
    by_model_key: Dict[str, Optional[str]] = {}
    for key in stored:
        base = _unchained(key.split('/', 1)[0])
        if base.startswith('optimizer.state.'):
            by_model_key[base] = None if base in by_model_key else key  # None: ambiguous
    renamed = 0
    for sh in nested_values(optimizer_state_dict):
        if not isinstance(sh, (ShardedTensor, ShardedTensorFactory)) or sh.key in stored:
            continue
        target = by_model_key.get(_unchained(sh.key))
        if target is not None:
            sh.key = target
            renamed += 1
    return renamed


def adapt_loaded_state(optimizer, loaded: Dict, stored_count: int) -> Any:
    """The loaded optimizer dict in this run's structure.

    The tensors were loaded in place already; when the checkpoint's optimizers were split
    otherwise, each of this run's optimizers gets a state dict holding its own param groups
    with the checkpoint's shared step, and the checkpoint's loss scaler (if any).
    """
    subs = sub_optimizers(optimizer)
    if stored_count == len(subs):
        return loaded
    stored_subs = [loaded[i] for i in range(stored_count)] if stored_count > 1 else [loaded]
    steps, scaler = set(), None
    for sub in stored_subs:
        _, step, sub_scaler = loaded_common_state(sub)
        if step is not None:
            steps.add(step)
        scaler = scaler if scaler is not None else sub_scaler
    if len(steps) > 1:
        raise ValueError(f'the checkpoint\'s optimizers are at different steps {sorted(steps)}')
    step = steps.pop() if steps else None
    adapted = []
    for sub in subs:
        groups = []
        for group in sub.param_groups:
            group = {k: copy.deepcopy(v) for k, v in group.items() if k != 'params'}
            if step is not None:
                group['step'] = step
            groups.append(group)
        state = {'optimizer': {'param_groups': groups}}
        if scaler is not None:
            state['grad_scaler'] = scaler
        adapted.append(state)
    return {i: s for i, s in enumerate(adapted)} if len(subs) > 1 else adapted[0]
