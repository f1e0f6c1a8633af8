"""torch_dist checkpoints <-> full (TP=1, PP=1, EP=1) state dicts, for the conversion tools.

A torch_dist checkpoint stores every tensor whole under its global key (see
docs/dist_checkpointing.md): layer tensors stacked as `[num_layers, ...]` under
`{block}.layers.<name>` (or per layer, `{block}.layers.<g>.<name>`, when the layers differ: MoE
mixed with dense layers), the separate norms of the local spec under Transformer Engine's names,
experts stacked as `[num_experts, ...]` under `mlp.experts.experts.<name>`; a multi-token-
prediction module's inner layer (`mtp.layers.<k>.transformer_layer.<name>`) like one such layer.
`dist_to_full_state_dict` turns the stored global tensors into the flat per-layer state dict of
a one-rank model (`decoder.layers.3.input_layernorm.weight`,
`decoder.layers.0.mlp.experts.local_experts.2.linear_fc1.weight`, ...), `full_to_dist_tensors`
does the inverse, and `write_full_state_dict` saves such a state dict as a torch_dist checkpoint
(one process; the trainer reshards it at load, at any TP / PP / EP).
"""

import os
import re
import socket
from typing import Dict

import torch

#: Local-spec layer names -> the names distributed checkpoints use (Megatron's
#: sharded_state_dict_keys_map of the local GPT / BERT layer specs).
TE_NAMES = {
    'input_layernorm.': 'self_attention.linear_qkv.layer_norm_',
    'pre_mlp_layernorm.': 'mlp.linear_fc1.layer_norm_',
}
_LAYER = re.compile(r'^(decoder|encoder)\.layers\.(\d+)\.(.+)$')
_GLOBAL_LAYER = re.compile(r'^(decoder|encoder)\.layers\.(.+)$')
_LOCAL_EXPERT = re.compile(r'^(.*mlp\.experts\.)local_experts\.(\d+)\.(.+)$')
#: A multi-token-prediction module's inner layer, stored as a layer of its own (never stacked).
_MTP_LAYER = re.compile(r'^(mtp\.layers\.\d+\.transformer_layer)\.(.+)$')
_STORED_EXPERTS = 'mlp.experts.experts.'


def _to_te(name: str) -> str:
    for old, new in TE_NAMES.items():
        if name.startswith(old):
            return new + name[len(old) :]
    return name


def _from_te(name: str) -> str:
    for old, new in TE_NAMES.items():
        if name.startswith(new):
            return old + name[len(new) :]
    return name


def _layer_from_stored(name: str, tensor: torch.Tensor) -> Dict[str, torch.Tensor]:
    """One layer's stored tensor -> its local state-dict entries (experts split by index)."""
    name = _from_te(name)
    if name.startswith(_STORED_EXPERTS):
        rest = name[len(_STORED_EXPERTS) :]
        return {f'mlp.experts.local_experts.{e}.{rest}': tensor[e] for e in range(tensor.shape[0])}
    return {name: tensor}


def dist_to_full_state_dict(tensors: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Global tensors of a torch_dist checkpoint -> flat one-rank model state dict.

    Optimizer states (`optimizer.*`) are left out; the tied output layer of a pipeline's last
    stage is stored as the embedding and so does not appear.
    """
    full = {}
    for key, tensor in tensors.items():
        if key.startswith('optimizer.') or key.startswith('chained_'):
            continue
        per_layer = _LAYER.match(key)
        stacked = _GLOBAL_LAYER.match(key)
        mtp = _MTP_LAYER.match(key)
        if mtp:
            prefix, name = mtp.groups()
            for local, value in _layer_from_stored(name, tensor).items():
                full[f'{prefix}.{local}'] = value
        elif per_layer:  # layers that differ (dense and MoE): one key per layer
            block, index, name = per_layer.groups()
            for local, value in _layer_from_stored(name, tensor).items():
                full[f'{block}.layers.{index}.{local}'] = value
        elif stacked:
            block, name = stacked.groups()
            for index in range(tensor.shape[0]):
                for local, value in _layer_from_stored(name, tensor[index]).items():
                    full[f'{block}.layers.{index}.{local}'] = value
        else:
            full[key] = tensor
    return full


def _layer_to_stored(layer: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """One layer's local entries -> stored names (experts stacked over their indices)."""
    out, experts = {}, {}
    for name, tensor in layer.items():
        match = _LOCAL_EXPERT.match(name)
        if match:
            prefix, index, rest = match.groups()
            experts.setdefault(f'{prefix}experts.{rest}', {})[int(index)] = tensor
        else:
            out[_to_te(name)] = tensor
    for key, by_index in experts.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f'{key}: experts {sorted(by_index)} are not 0..{len(by_index) - 1}')
        out[key] = torch.stack([by_index[e] for e in range(len(by_index))])
    return out


def full_to_dist_tensors(state_dict: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    """Flat one-rank model state dict -> {global key: tensor}: layers stacked, or one key per
    layer when the layers do not all have the same tensors (the trainer's keys likewise)."""
    out, layers, mtp_layers = {}, {}, {}
    for name, tensor in state_dict.items():
        if tensor is None or name.endswith('_extra_state'):
            continue
        match = _LAYER.match(name)
        mtp = _MTP_LAYER.match(name)
        if mtp:
            prefix, rest = mtp.groups()
            mtp_layers.setdefault(prefix, {})[rest] = tensor
        elif match:
            block, index, rest = match.groups()
            layers.setdefault(block, {}).setdefault(int(index), {})[rest] = tensor
        else:
            out[name] = tensor
    for block, by_index in layers.items():
        if sorted(by_index) != list(range(len(by_index))):
            raise ValueError(f'{block} layers {sorted(by_index)} are not 0..{len(by_index) - 1}')
        stored = [_layer_to_stored(by_index[i]) for i in range(len(by_index))]
        if len({tuple(sorted(layer)) for layer in stored}) > 1:
            for index, layer in enumerate(stored):
                out.update({f'{block}.layers.{index}.{k}': v for k, v in layer.items()})
        else:
            for key in stored[0]:
                out[f'{block}.layers.{key}'] = torch.stack([layer[key] for layer in stored])
    for prefix, layer in mtp_layers.items():
        out.update({f'{prefix}.{k}': v for k, v in _layer_to_stored(layer).items()})
    return out


def _init_single_process_group() -> bool:
    """A one-rank gloo group (saving is collective); returns whether it was created here."""
    if torch.distributed.is_initialized():
        return False
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]
    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1
    )
    return True


def write_full_state_dict(
    save_dir: str, iteration: int, state_dict: Dict[str, torch.Tensor], args
) -> str:
    """Write a one-rank model state dict as a torch_dist checkpoint and move the tracker.

    Returns the iteration directory. `args` (the model's, at TP = PP = 1) go to common.pt.
    """
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.training.checkpoint.checkpoint_args import CHECKPOINT_VERSION, args_for_checkpoint
    from megatron.training.checkpoint.checkpoint_layout import get_checkpoint_name
    from megatron.training.checkpoint.checkpoint_tracker import write_tracker_atomically

    created = _init_single_process_group()
    try:
        checkpoint_dir = get_checkpoint_name(save_dir, iteration, return_base_dir=True)
        os.makedirs(checkpoint_dir, exist_ok=False)
        model = {
            key: ShardedTensor.from_rank_offsets(key, tensor.contiguous())
            for key, tensor in full_to_dist_tensors(state_dict).items()
        }
        dist_checkpointing.save(
            {
                'args': args_for_checkpoint(args),
                'checkpoint_version': CHECKPOINT_VERSION,
                'iteration': iteration,
                'model': model,
            },
            checkpoint_dir,
        )
        write_tracker_atomically(save_dir, iteration)
        return checkpoint_dir
    finally:
        if created:
            torch.distributed.destroy_process_group()
