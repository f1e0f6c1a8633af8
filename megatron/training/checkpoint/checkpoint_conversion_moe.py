"""MoE checkpoints in tools/checkpoint: layer messages with experts, and reading / writing the
`mp_rank_TT[_PPP][_EEE]` layout at any expert-parallel size (the MoE counterpart of
checkpoint_conversion.py).

Messages of an MoE layer (Megatron's loader_mixtral_hf / saver_mcore protocol): "router weight"
[E, h]; the experts stacked over E: "mlp l0 weight W" / "mlp l0 weight V" [E, f, h] (gate / up
halves of fc1; "mlp l0 weight" [E, f, h] without SwiGLU), "mlp l1 weight" [E, h, f] (biases
likewise, when present). Beyond Megatron's protocol: "router expert bias" [E], and the shared
experts as "shared mlp l0 weight W" / "V", "shared mlp l1 weight" and "shared gate weight".
Dense layers of a mixed model send the dense messages.

Multi-token prediction module k (`mtp.layers.{k}.`, last pipeline stage) travels as "mtp layer
{k}" after "output layer": its inner transformer layer as a layer message, plus "enorm weight",
"hnorm weight", "eh proj weight" and "final norm weight".

Files: expert-parallel rank r's file holds every dense weight and its experts r nle .. r nle +
nle - 1 under local indices 0 .. nle - 1 (nle = E / ep); a grouped-GEMM checkpoint holds them as
`mlp.experts.weight1` / `weight2`, which are read and written here as well.
"""

import os
import re
from typing import Dict, List, Optional, Tuple

import torch

from megatron.training.checkpoint import checkpoint_conversion as cc
from megatron.training.checkpoint.checkpoint_layout import check_single_layout
from megatron.training.checkpointing import find_checkpoint_rank_0, get_checkpoint_name

StateDict = Dict[str, torch.Tensor]

_EXPERT_RE = re.compile(
    r'^(.*mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.(?:weight|bias))$'
)
_GROUPED_RE = re.compile(r'^(.*mlp\.experts\.)weight([12])$')
_EXPERT_MESSAGES = {
    'linear_fc1.weight': 'mlp l0 weight',
    'linear_fc1.bias': 'mlp l0 bias',
    'linear_fc2.weight': 'mlp l1 weight',
    'linear_fc2.bias': 'mlp l1 bias',
}
_SHARED_MESSAGES = {
    'mlp.shared_experts.linear_fc1.weight': 'shared mlp l0 weight',
    'mlp.shared_experts.linear_fc2.weight': 'shared mlp l1 weight',
    'mlp.shared_experts.gate_weight': 'shared gate weight',
}
_ROUTER_MESSAGES = {
    'mlp.router.weight': 'router weight',
    'mlp.router.expert_bias': 'router expert bias',
}


# ---------------------------------------------------------------------------------------------
# messages


def moe_layer_to_message(layer: StateDict, swiglu: bool, num_experts: int) -> Dict:
    """Full (TP- and EP-merged) layer tensors -> message; dense parts as checkpoint_conversion's.

    Raises:
        ValueError: an MoE layer whose experts are not exactly 0 .. num_experts - 1.
    """
    dense, experts, message = {}, {}, {}
    for name, tensor in layer.items():
        match = _EXPERT_RE.match(name)
        if name.endswith('_extra_state'):
            continue
        if match:
            experts.setdefault(match.group(3), {})[int(match.group(2))] = tensor
        elif name in _ROUTER_MESSAGES:
            message[_ROUTER_MESSAGES[name]] = tensor
        elif name in _SHARED_MESSAGES:
            key = _SHARED_MESSAGES[name]
            if swiglu and name.endswith('linear_fc1.weight'):
                message[key + ' W'], message[key + ' V'] = torch.chunk(tensor, 2, dim=0)
            else:
                message[key] = tensor
        else:
            dense[name] = tensor
    message.update(cc.layer_to_message(dense, swiglu))
    if not experts:
        return message
    if 'router weight' not in message:
        raise ValueError('an MoE layer without mlp.router.weight')
    for suffix, by_expert in experts.items():
        if sorted(by_expert) != list(range(num_experts)):
            raise ValueError(
                f'MoE layer {suffix}: experts {sorted(by_expert)} found, expected 0 .. '
                f'{num_experts - 1}'
            )
        stacked = torch.stack([by_expert[j] for j in range(num_experts)])
        key = _EXPERT_MESSAGES[suffix]
        if swiglu and suffix.startswith('linear_fc1.'):
            message[key + ' W'], message[key + ' V'] = torch.chunk(stacked, 2, dim=1)
        else:
            message[key] = stacked
    return message


def message_to_moe_layer(message: Dict, swiglu: bool) -> StateDict:
    """Inverse of `moe_layer_to_message`: pops the known keys (leftovers stay in `message`)."""
    layer = {}
    if 'router weight' in message:
        for name, key in _ROUTER_MESSAGES.items():
            if key in message:
                layer[name] = message.pop(key)
        num_experts = layer['mlp.router.weight'].shape[0]
        for suffix, key in _EXPERT_MESSAGES.items():
            if swiglu and suffix.startswith('linear_fc1.') and key + ' W' in message:
                stacked = torch.cat([message.pop(key + ' W'), message.pop(key + ' V')], dim=1)
            elif key in message:
                stacked = message.pop(key)
            else:
                continue
            if stacked.shape[0] != num_experts:
                raise ValueError(
                    f'"{key}" holds {stacked.shape[0]} experts, the router has {num_experts}'
                )
            for j in range(num_experts):
                layer[f'mlp.experts.local_experts.{j}.{suffix}'] = stacked[j]
        for name, key in _SHARED_MESSAGES.items():
            if swiglu and name.endswith('linear_fc1.weight') and key + ' W' in message:
                layer[name] = torch.cat([message.pop(key + ' W'), message.pop(key + ' V')])
            elif key in message:
                layer[name] = message.pop(key)
    layer.update(cc.message_to_layer(message, swiglu))
    return layer


def check_expert_message(message: Dict, num_experts: int, hidden: int, ffn: int, swiglu: bool):
    """A loader's MoE layer message has every expert tensor, with its shape (ValueError in one
    line otherwise: a saver must never fill experts with random values)."""
    expected = {'router weight': (num_experts, hidden), 'mlp l1 weight': (num_experts, hidden, ffn)}
    if swiglu:
        expected['mlp l0 weight W'] = expected['mlp l0 weight V'] = (num_experts, ffn, hidden)
    else:
        expected['mlp l0 weight'] = (num_experts, ffn, hidden)
    for key, shape in expected.items():
        if key not in message:
            raise ValueError(f'MoE layer message: "{key}" is missing')
        if tuple(message[key].shape) != shape:
            raise ValueError(
                f'MoE layer message: "{key}" has shape {tuple(message[key].shape)}, expected '
                f'{shape}'
            )


_MTP_RE = re.compile(r'^mtp\.layers\.(\d+)\.(.+)$')
_MTP_INNER = 'transformer_layer.'
_MTP_PARTS = {
    'enorm.weight': 'enorm weight',
    'hnorm.weight': 'hnorm weight',
    'eh_proj.weight': 'eh proj weight',
    'final_layernorm.weight': 'final norm weight',
}


def mtp_layer_messages(
    rest: StateDict, swiglu: bool, num_experts: Optional[int]
) -> List[Tuple[str, Dict]]:
    """[("mtp layer k", message)] for the MTP modules among a last stage's non-layer tensors.

    Raises:
        ValueError: an MTP tensor the protocol has no message for.
    """
    by_depth: Dict[int, StateDict] = {}
    for name, tensor in rest.items():
        match = _MTP_RE.match(name)
        if match and not name.endswith('_extra_state'):
            by_depth.setdefault(int(match.group(1)), {})[match.group(2)] = tensor
    messages = []
    for k in sorted(by_depth):
        parts = by_depth[k]
        inner = {n[len(_MTP_INNER) :]: t for n, t in parts.items() if n.startswith(_MTP_INNER)}
        unknown = sorted(n for n in parts if not n.startswith(_MTP_INNER) and n not in _MTP_PARTS)
        if unknown:
            raise ValueError(f'mtp.layers.{k}.{unknown[0]} has no message in the protocol')
        message = moe_layer_to_message(inner, swiglu, num_experts)
        message.update({key: parts[n] for n, key in _MTP_PARTS.items() if n in parts})
        messages.append((f'mtp layer {k}', message))
    return messages


def message_to_mtp_layer(message: Dict, swiglu: bool, depth: int) -> StateDict:
    """Inverse of one `mtp_layer_messages` entry: `mtp.layers.{depth}.*` tensors (pops the
    known keys)."""
    prefix = f'mtp.layers.{depth}.'
    out = {prefix + n: message.pop(key) for n, key in _MTP_PARTS.items() if key in message}
    inner = message_to_moe_layer(message, swiglu)
    out.update({prefix + _MTP_INNER + n: t for n, t in inner.items()})
    return out


# ---------------------------------------------------------------------------------------------
# grouped experts


def grouped_to_sequential(state: StateDict, num_local_experts: int, hidden: int) -> StateDict:
    """`mlp.experts.weight1` [h, nle g f'] / `weight2` [nle f', h] -> per-expert
    `local_experts.{e}.linear_fc1.weight` [g f', h] / `linear_fc2.weight` [h, f'] (f' = f / tp)."""
    out = {}
    for name, tensor in state.items():
        match = _GROUPED_RE.match(name)
        if match is None:
            out[name] = tensor
            continue
        prefix, which = match.groups()
        if which == '1':
            blocks = tensor.reshape(num_local_experts, hidden, -1)  # [nle, h, g f']
        else:
            blocks = tensor.reshape(num_local_experts, -1, hidden)  # [nle, f', h]
        for e in range(num_local_experts):
            out[f'{prefix}local_experts.{e}.linear_fc{which}.weight'] = blocks[e].t().contiguous()
    return out


def sequential_to_grouped(state: StateDict, num_local_experts: int) -> StateDict:
    """Inverse of `grouped_to_sequential` (drops the experts' `_extra_state` entries)."""
    out, blocks = {}, {}
    for name, tensor in state.items():
        match = _EXPERT_RE.match(name)
        if match is None:
            if not re.match(r'.*mlp\.experts\.local_experts\.\d+\..*_extra_state$', name):
                out[name] = tensor
            continue
        prefix, e, suffix = match.groups()
        blocks.setdefault((prefix, suffix), {})[int(e)] = tensor
    for (prefix, suffix), by_expert in blocks.items():
        # GroupedMLP reads weight1 [h, nle g f'] as the raw view [nle, h, g f'] (and weight2
        # [nle f', h] as [nle, f', h]): expert e is the e-th contiguous block of either.
        stacked = torch.stack([by_expert[e].t() for e in range(num_local_experts)])
        if suffix == 'linear_fc1.weight':
            hidden = stacked.shape[1]
            out[prefix + 'weight1'] = stacked.reshape(hidden, -1).contiguous()
        elif suffix == 'linear_fc2.weight':
            out[prefix + 'weight2'] = stacked.reshape(-1, stacked.shape[-1]).contiguous()
        else:
            raise ValueError(f'grouped experts have no {suffix}')
    return out


# ---------------------------------------------------------------------------------------------
# reading


class MoECheckpointReader(cc.CheckpointReader):
    """CheckpointReader for any TP x PP x EP layout: stage tensors TP-merged, experts of every
    expert-parallel rank gathered under their global indices."""

    def _read_layout(self):
        name = find_checkpoint_rank_0(self.load_dir, self.iteration, self.release)
        if name is None:
            base = get_checkpoint_name(
                self.load_dir, self.iteration, self.release, return_base_dir=True
            )
            present = sorted(os.listdir(base)) if os.path.isdir(base) else 'nothing'
            raise ValueError(
                f'--load-dir {self.load_dir}: partial checkpoint, no rank-0 file under {base} '
                f'(found {present})'
            )
        state = cc.torch_load_weights_only(name)
        if 'args' not in state:
            raise ValueError(f'{name}: the checkpoint holds no args; cannot convert it')
        args = state['args']
        base = get_checkpoint_name(
            self.load_dir, self.iteration, self.release, return_base_dir=True
        )
        check_single_layout(base, args)
        self.model_keys = sorted(state.get('model', state.get('model0', {})))
        self.ep = getattr(args, 'expert_model_parallel_size', 1) or 1
        self.num_experts = getattr(args, 'num_experts', None)
        self.grouped = bool(getattr(args, 'moe_grouped_gemm', False))
        if getattr(args, 'moe_extended_tp', False):
            raise ValueError(f'{name}: --moe-extended-tp checkpoints cannot be converted')
        return args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args

    def rank_file(self, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> str:
        return get_checkpoint_name(
            self.load_dir,
            self.iteration,
            self.release,
            pipeline_parallel=self.pp > 1,
            tensor_rank=tp_rank,
            pipeline_rank=pp_rank,
            expert_parallel=self.ep > 1,
            expert_rank=ep_rank,
        )

    def __init__(self, load_dir: str):
        super().__init__(load_dir)
        missing = [
            self.rank_file(t, p, e)
            for e in range(self.ep)
            for p in range(self.pp)
            for t in range(self.tp)
            if not os.path.isfile(self.rank_file(t, p, e))
        ]
        if missing:
            raise ValueError(
                f'--load-dir {load_dir}: partial checkpoint, {len(missing)} of '
                f'{self.tp * self.pp * self.ep} rank files of its TP{self.tp} x PP{self.pp} x '
                f'EP{self.ep} layout are missing: '
                f'{", ".join(os.path.relpath(m, load_dir) for m in missing)}'
            )

    def load_stage(self, pp_rank: int) -> Tuple[List[Tuple[int, StateDict]], List[dict]]:
        if not self.num_experts:
            return super().load_stage(pp_rank)
        import types

        swiglu = types.SimpleNamespace(gated_linear_unit=bool(getattr(self.args, 'swiglu', False)))
        nle = self.num_experts // self.ep
        hidden = self.args.hidden_size
        chunks, others = None, None
        for ep_rank in range(self.ep):
            files = [
                cc.torch_load_weights_only(self.rank_file(t, pp_rank, ep_rank))
                for t in range(self.tp)
            ]
            keys = ['model'] if 'model' in files[0] else [f'model{i}' for i in range(self.vp or 1)]
            if chunks is None:
                num_layers = self.args.num_layers
                chunks = [
                    (cc.layer_offset(num_layers, self.pp, pp_rank, self.vp, v, self.args), {})
                    for v in range(len(keys))
                ]
                others = [{k: v for k, v in f.items() if not k.startswith('model')} for f in files]
            for vp_rank, key in enumerate(keys):
                shards = [f[key] for f in files]
                if self.grouped:
                    shards = [grouped_to_sequential(s, nle, hidden) for s in shards]
                merged = (
                    shards[0]
                    if self.tp == 1
                    else cc.merge_tensor_parallel_state_dicts(shards, swiglu)
                )
                target = chunks[vp_rank][1]
                for name, tensor in merged.items():
                    match = _EXPERT_RE.match(name)
                    if match:
                        prefix, local, suffix = match.groups()
                        global_id = ep_rank * nle + int(local)
                        target[f'{prefix}local_experts.{global_id}.{suffix}'] = tensor
                    elif ep_rank == 0 and 'local_experts.' not in name:
                        target[name] = tensor
        return chunks, others


# ---------------------------------------------------------------------------------------------
# writing


def _moe_extra_state_entries(shard: StateDict, grouped: bool) -> StateDict:
    """A GPTModel's `_extra_state` entries (None) for MoE layers: the experts' and shared
    experts' linears, none for the dense MLP linears an MoE layer does not have."""
    out = dict(shard)
    moe_layers = {n.split('mlp.router.weight')[0] for n in shard if n.endswith('mlp.router.weight')}
    for prefix in moe_layers:
        out.pop(prefix + 'mlp.linear_fc1._extra_state', None)
        out.pop(prefix + 'mlp.linear_fc2._extra_state', None)
        if prefix + 'mlp.shared_experts.linear_fc1.weight' in shard:
            for fc in ('linear_fc1', 'linear_fc2'):
                out[f'{prefix}mlp.shared_experts.{fc}._extra_state'] = None
    if not grouped:
        for name in shard:
            match = _EXPERT_RE.match(name)
            if match and match.group(3).endswith('weight'):
                fc = match.group(3).split('.')[0]
                out[f'{match.group(1)}local_experts.{match.group(2)}.{fc}._extra_state'] = None
    return out


class MoECheckpointWriter(cc.CheckpointWriter):
    """CheckpointWriter for a TP x PP x EP target: each (tp, ep) file gets the dense weights and
    its expert-parallel rank's experts under local indices (grouped weights when the args ask)."""

    def __init__(self, save_dir, iteration, tp, pp, args, swiglu, ep: int):
        super().__init__(save_dir, iteration, tp, pp, args, swiglu)
        self.ep = ep
        self.num_experts = args.num_experts
        self.grouped = bool(getattr(args, 'moe_grouped_gemm', False))

    def write_stage(self, pp_rank: int, stage: StateDict, has_output_layer: bool) -> List[str]:
        nle = self.num_experts // self.ep
        per_ep = [{} for _ in range(self.ep)]
        for name in list(stage):
            tensor = stage.pop(name)
            match = _EXPERT_RE.match(name)
            if match is None:
                for part in per_ep:
                    part[name] = tensor
                continue
            prefix, global_id, suffix = match.groups()
            ep_rank, local = divmod(int(global_id), nle)
            per_ep[ep_rank][f'{prefix}local_experts.{local}.{suffix}'] = tensor
        names = []
        for ep_rank, part in enumerate(per_ep):
            for tp_rank, shard in enumerate(self._split_consuming(part)):
                name = get_checkpoint_name(
                    self.staging,  # switched into save_dir as a whole by finish()
                    self.iteration,
                    pipeline_parallel=self.pp > 1,
                    tensor_rank=tp_rank,
                    pipeline_rank=pp_rank,
                    expert_parallel=self.ep > 1,
                    expert_rank=ep_rank,
                )
                model = cc.add_extra_state_entries(shard, has_output_layer)
                model = _moe_extra_state_entries(model, self.grouped)
                if self.grouped:
                    model = sequential_to_grouped(model, nle)
                os.makedirs(os.path.dirname(name), exist_ok=True)
                state = {
                    'args': self.args,
                    'checkpoint_version': cc.CHECKPOINT_VERSION,
                    'iteration': self.iteration,
                    'model': model,
                    'num_floating_point_operations_so_far': 0,
                }
                tmp = f'{name}.tmp.{os.getpid()}'
                torch.save(state, tmp)
                os.replace(tmp, name)
                names.append(name)
        return names
