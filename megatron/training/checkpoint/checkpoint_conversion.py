"""Whole-model access to checkpoints for resharding and import/export (tools/checkpoint).

A checkpoint written by `save_checkpoint` at some TP x PP (x virtual PP) layout is read one
pipeline stage at a time, its tensor-parallel shards merged into full tensors, and its layers
renumbered globally; a full model is written back at any target TP x PP in the same file layout.
Between the two, each transformer layer travels as one dict whose keys are the names of the
messages of Megatron's tools/checkpoint protocol ("qkv weight", "mlp l0 weight W", ...).

Parameter rules (megatron-core GPT / BERT / T5 names, see
`hf_weight_mapping.tensor_parallel_partition_dim`):

- column-parallel, split along dim 0: word embeddings, output layer (and the BERT / T5 output
  bias), linear_qkv (whole query groups per rank), T5's cross-attention linear_q and linear_kv
  (whole heads), linear_fc1 (per half under SwiGLU: rank r holds [gate_r; up_r]);
- row-parallel, split along dim 1: the linear_proj (self and cross attention) and linear_fc2
  weights;
- replicated (taken from TP rank 0): norms, position and token-type embeddings, row-parallel
  biases, BERT's pooler, LM-head transform and binary head.

Nothing here needs torch.distributed: files are read and written directly. T5's stage contents
(encoder and decoder stacks around a pipeline split rank) are in checkpoint_conversion_t5.py.
"""

import argparse
import copy
import json
import math
import os
import re
import types
import zipfile
from typing import Dict, List, Optional, Tuple

import torch

from megatron.core.models.gpt.hf_weight_mapping import (
    merge_tensor_parallel_state_dicts,
    split_state_dict_for_tensor_parallel,
)
from megatron.core.transformer.pipeline_layer_split import pipeline_stage_layer_offset
from megatron.training.checkpoint.checkpoint_layout import (
    check_single_layout,
    commit_staged_checkpoint,
    staging_root,
)
from megatron.training.checkpointing import (
    CHECKPOINT_VERSION,
    SAFE_GLOBALS,
    get_checkpoint_name,
    get_checkpoint_tracker_filename,
)

StateDict = Dict[str, torch.Tensor]

#: mcore layer-local parameter name -> Megatron message key (the fc1 keys depend on SwiGLU).
LAYER_MESSAGE_KEYS = {
    'input_layernorm.weight': 'input norm weight',
    'input_layernorm.bias': 'input norm bias',
    'pre_mlp_layernorm.weight': 'post norm weight',
    'pre_mlp_layernorm.bias': 'post norm bias',
    'self_attention.linear_qkv.weight': 'qkv weight',
    'self_attention.linear_qkv.bias': 'qkv bias',
    'self_attention.linear_proj.weight': 'dense weight',
    'self_attention.linear_proj.bias': 'dense bias',
    'self_attention.q_layernorm.weight': 'q norm weight',
    'self_attention.k_layernorm.weight': 'k norm weight',
    # Multi-latent attention (q_layernorm is its query latent norm, "q norm weight" above).
    'self_attention.linear_q_proj.weight': 'q proj weight',
    'self_attention.linear_q_down_proj.weight': 'q down proj weight',
    'self_attention.linear_q_up_proj.weight': 'q up proj weight',
    'self_attention.linear_kv_down_proj.weight': 'kv down proj weight',
    'self_attention.kv_layernorm.weight': 'kv norm weight',
    'self_attention.linear_kv_up_proj.weight': 'kv up proj weight',
    'mlp.linear_fc1.weight': 'mlp l0 weight',
    'mlp.linear_fc1.bias': 'mlp l0 bias',
    'mlp.linear_fc2.weight': 'mlp l1 weight',
    'mlp.linear_fc2.bias': 'mlp l1 bias',
}
#: Parallel linears of a layer, each with an `_extra_state` entry (None for local modules) in a
#: model state dict; the cross-attention ones exist in T5 decoder layers only.
_EXTRA_STATE_MODULES = (
    'self_attention.linear_proj',
    'self_attention.linear_qkv',
    # MLA's column-parallel projections (its down projections are DuplicatedLinear: no extra
    # state).
    'self_attention.linear_q_proj',
    'self_attention.linear_q_up_proj',
    'self_attention.linear_kv_up_proj',
    'cross_attention.linear_proj',
    'cross_attention.linear_q',
    'cross_attention.linear_kv',
    'mlp.linear_fc1',
    'mlp.linear_fc2',
)


# ---------------------------------------------------------------------------------------------
# layer numbering and vocabulary


def layer_offset(
    num_layers: int, pp: int, pp_rank: int, vp: Optional[int], vp_rank: int, source_args=None
) -> int:
    """Global index of the first layer of chunk `vp_rank` on pipeline stage `pp_rank`.

    Without a virtual pipeline stage p holds layers [p*L/pp, (p+1)*L/pp), unless the checkpoint's
    args (`source_args`) fix the first or last stage's count (--standalone-embedding-stage, whose
    stage 0 holds no layer, or --decoder-first/last-pipeline-num-layers); interleaved, chunk v of
    stage p holds L/(pp*vp) layers starting at v*L/vp + p*L/(pp*vp).
    """
    first, last = stage_layer_overrides(source_args)
    if (vp is None or vp == 1) and (first is not None or last is not None):
        return pipeline_stage_layer_offset(num_layers, pp, pp_rank, first, last)
    if vp is None or vp == 1:
        return pp_rank * (num_layers // pp)
    return vp_rank * (num_layers // vp) + pp_rank * (num_layers // (pp * vp))


def stage_layer_overrides(source_args):
    """(first, last) stage layer counts recorded in a checkpoint's args (None: the even share).

    Megatron r0.8 checkpoints record only `standalone_embedding_stage`, which means first = 0.
    """
    if source_args is None:
        return None, None
    first = getattr(source_args, 'decoder_first_pipeline_num_layers', None)
    if first is None and getattr(source_args, 'standalone_embedding_stage', False):
        first = 0
    return first, getattr(source_args, 'decoder_last_pipeline_num_layers', None)


def padded_vocab_size(true_vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's rule: the true vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return int(math.ceil(true_vocab_size / multiple) * multiple)


def repad_vocab(weight: torch.Tensor, padded_size: int) -> torch.Tensor:
    """Resize an embedding-like table to `padded_size` rows, as Megatron's checkpoint savers do.

    A larger source table keeps its leading rows; a smaller one is extended by repeating its last
    row (normally a padding row).
    """
    rows = weight.shape[0]
    if padded_size == rows:
        return weight
    if padded_size < rows:
        # A copy: saving a slice would write the whole original storage.
        return weight[:padded_size].clone()
    extra = weight[-1:].expand(padded_size - rows, *weight.shape[1:])
    return torch.cat([weight, extra], dim=0)


def true_vocab_size_from_file(vocab_file: str) -> int:
    """Entries of a JSON vocabulary (a GPT-2 style vocab.json), as Megatron's loaders read it."""
    try:
        with open(vocab_file) as f:
            return len(json.load(f))
    except (OSError, ValueError) as exc:
        raise ValueError(f'--vocab-file {vocab_file}: cannot read it as a JSON vocabulary ({exc})')


def recorded_true_vocab_size(args) -> Optional[int]:
    """The unpadded vocabulary a checkpoint's args reveal, or None.

    Converted checkpoints record it as `true_vocab_size` (an arg Megatron does not have, so the
    padding can be recomputed at the next conversion); the NullTokenizer has vocab_size + 1 ids.
    """
    recorded = getattr(args, 'true_vocab_size', None)
    if recorded is not None:
        return recorded
    if getattr(args, 'tokenizer_type', None) == 'NullTokenizer' and getattr(
        args, 'vocab_size', None
    ):
        return args.vocab_size + 1
    return None


# ---------------------------------------------------------------------------------------------
# messages <-> mcore layer state dicts


def layer_to_message(
    layer: StateDict, swiglu: bool, keys: Optional[Dict[str, str]] = None
) -> Dict[str, torch.Tensor]:
    """Full (TP-merged) layer tensors keyed by layer-local mcore names -> message keys.

    Under SwiGLU the fc1 weight [gate; up] is sent as "mlp l0 weight W" (gate) and "V" (up).
    `keys` is the name -> message table (default `LAYER_MESSAGE_KEYS`; T5 decoder layers add
    their cross attention's).
    """
    keys = LAYER_MESSAGE_KEYS if keys is None else keys
    message = {}
    for name, tensor in layer.items():
        if name.endswith('_extra_state'):
            continue
        if name not in keys:
            raise ValueError(
                f'layer parameter {name!r} has no message in the checkpoint conversion protocol '
                f'(supported: {sorted(keys)})'
            )
        key = keys[name]
        if swiglu and name.startswith('mlp.linear_fc1.'):
            gate, up = torch.chunk(tensor, 2, dim=0)
            message[key + ' W'], message[key + ' V'] = gate, up
        else:
            message[key] = tensor
    return message


def message_to_layer(
    message: Dict[str, torch.Tensor], swiglu: bool, keys: Optional[Dict[str, str]] = None
) -> StateDict:
    """Inverse of `layer_to_message`: pops the known keys (leftovers stay in `message`)."""
    keys = LAYER_MESSAGE_KEYS if keys is None else keys
    layer = {}
    for name, key in keys.items():
        if swiglu and name.startswith('mlp.linear_fc1.'):
            if key + ' W' in message:
                layer[name] = torch.cat([message.pop(key + ' W'), message.pop(key + ' V')], dim=0)
        elif key in message:
            layer[name] = message.pop(key)
    return layer


# ---------------------------------------------------------------------------------------------
# reading


def torch_load_weights_only(filename: str, mmap: bool = True) -> dict:
    """Load a checkpoint file with weights_only=True (tensors memory-mapped when possible).

    Raises:
        ValueError: naming the file, when it is truncated, corrupt or holds more than tensors and
            plain data.
    """
    with torch.serialization.safe_globals(SAFE_GLOBALS):
        try:
            if mmap and zipfile.is_zipfile(filename):
                return torch.load(filename, map_location='cpu', weights_only=True, mmap=True)
            # Files not in the zip format cannot be memory-mapped.
            return torch.load(filename, map_location='cpu', weights_only=True)
        except Exception as exc:
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            reason = lines[0] if lines else type(exc).__name__
            raise ValueError(
                f'checkpoint file {filename} cannot be read (truncated, corrupt, or not tensors '
                f'and plain data): {reason}'
            ) from exc


def _read_tracker(load_dir: str) -> Tuple[int, bool]:
    tracker = get_checkpoint_tracker_filename(load_dir)
    if not os.path.isfile(tracker):
        raise ValueError(
            f'--load-dir {load_dir}: no checkpoint there (no {os.path.basename(tracker)})'
        )
    text = open(tracker).read().strip()
    if text == 'release':
        return 0, True
    try:
        return int(text), False
    except ValueError:
        raise ValueError(f'{tracker}: expected an iteration number or "release", found {text!r}')


class CheckpointReader:
    """A checkpoint directory at any TP x PP (x virtual PP) layout, read stage by stage.

    The constructor reads only the tracker and the rank-0 file's args, and checks that every
    rank file of the layout exists (raising ValueError naming the missing ones) before any tensor
    is read.
    """

    def __init__(self, load_dir: str):
        self.load_dir = load_dir
        self.iteration, self.release = _read_tracker(load_dir)
        self.tp, self.pp, self.args = self._read_layout()
        vp = getattr(self.args, 'virtual_pipeline_model_parallel_size', None)
        self.vp = vp if vp is not None and vp > 1 else None
        missing = [
            name
            for name in (self.rank_file(t, p) for p in range(self.pp) for t in range(self.tp))
            if not os.path.isfile(name)
        ]
        if missing:
            raise ValueError(
                f'--load-dir {load_dir}: partial checkpoint, {len(missing)} of '
                f'{self.tp * self.pp} rank files of its TP{self.tp} x PP{self.pp} layout are '
                f'missing: {", ".join(os.path.relpath(m, load_dir) for m in missing)}'
            )

    def _read_layout(self):
        base = get_checkpoint_name(
            self.load_dir, self.iteration, self.release, return_base_dir=True
        )
        for pipeline_parallel in (False, True):
            name = get_checkpoint_name(
                self.load_dir,
                self.iteration,
                self.release,
                pipeline_parallel=pipeline_parallel,
                tensor_rank=0,
                pipeline_rank=0,
                expert_parallel=False,
                expert_rank=0,
            )
            if os.path.isfile(name):
                state = torch_load_weights_only(name)
                if 'args' not in state:
                    raise ValueError(f'{name}: the checkpoint holds no args; cannot convert it')
                args = state['args']
                check_single_layout(base, args)
                self.model_keys = sorted(state.get('model', state.get('model0', {})))
                return args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args
        present = sorted(os.listdir(base)) if os.path.isdir(base) else 'nothing'
        raise ValueError(
            f'--load-dir {self.load_dir}: partial checkpoint, no rank-0 file mp_rank_00[_000]/'
            f'model_optim_rng.pt under {base} (found {present})'
        )

    def merge_shards(self, shards: List[StateDict], swiglu) -> StateDict:
        """One chunk's TP shards -> its full tensors (a model family may override the rules)."""
        return merge_tensor_parallel_state_dicts(shards, swiglu)

    @property
    def model_type(self) -> str:
        """'T5' for an encoder-decoder model, 'BERT' when the model has an encoder block only,
        else 'GPT'.

        T5 is told by the model type its args record (stage 0 of a pipelined T5 holds encoder
        layers only), else by the rank-0 file holding both stacks.
        """
        return model_type_from_keys(self.model_keys, getattr(self.args, 'model_type', None))

    def rank_file(self, tp_rank: int, pp_rank: int) -> str:
        return get_checkpoint_name(
            self.load_dir,
            self.iteration,
            self.release,
            pipeline_parallel=self.pp > 1,
            tensor_rank=tp_rank,
            pipeline_rank=pp_rank,
            expert_parallel=False,
            expert_rank=0,
        )

    def load_stage(self, pp_rank: int) -> Tuple[List[Tuple[int, StateDict]], List[dict]]:
        """TP-merged model chunks of one stage.

        Returns:
            ([(global layer offset, merged chunk state dict)] in chunk order, and the per-TP-rank
            top-level dicts without their model entries (consumed counters, iteration...)). A
            T5's offset is None: its stacks are placed by `checkpoint_conversion_t5.t5_stage`.
        """
        swiglu = types.SimpleNamespace(gated_linear_unit=bool(getattr(self.args, 'swiglu', False)))
        files = [torch_load_weights_only(self.rank_file(t, pp_rank)) for t in range(self.tp)]
        keys = ['model'] if 'model' in files[0] else [f'model{i}' for i in range(self.vp or 1)]
        chunks = []
        for vp_rank, key in enumerate(keys):
            if self.tp == 1:
                # Nothing to merge: keep the memory-mapped tensors instead of copying them.
                merged = dict(files[0][key])
            else:
                merged = self.merge_shards([f[key] for f in files], swiglu)
            offset = (
                None
                if self.model_type == 'T5'
                else layer_offset(
                    self.args.num_layers, self.pp, pp_rank, self.vp, vp_rank, self.args
                )
            )
            chunks.append((offset, merged))
        others = [{k: v for k, v in f.items() if not k.startswith('model')} for f in files]
        return chunks, others


def model_type_from_keys(keys, recorded=None) -> str:
    """'T5', 'BERT' or 'GPT' for a model state dict's keys (any checkpoint format).

    The model type recorded in the checkpoint's args decides first (encoder_and_decoder: T5; a
    pipelined T5's stage 0 holds encoder layers only); else both stacks mean T5, an encoder
    alone BERT, a decoder alone GPT.
    """
    if getattr(recorded, 'name', recorded) == 'encoder_and_decoder':
        return 'T5'
    keys = list(keys)
    encoder = any(k.startswith('encoder.') for k in keys)
    if encoder and any(k.startswith('decoder.') for k in keys):
        return 'T5'
    return 'BERT' if encoder else 'GPT'


def block_name(model_type: str) -> str:
    """The transformer block of a model's state dict: 'decoder' (GPT) or 'encoder' (BERT)."""
    return 'encoder' if model_type == 'BERT' else 'decoder'


def split_chunk_by_layer(chunk: StateDict, offset: int) -> Tuple[Dict[int, StateDict], StateDict]:
    """({global layer index: layer-local state dict}, the chunk's non-layer tensors).

    Layers are `decoder.layers.N.*` (GPT) or `encoder.layers.N.*` (BERT).
    """
    layers: Dict[int, StateDict] = {}
    rest: StateDict = {}
    for name, tensor in chunk.items():
        match = _LAYER_RE.match(name)
        if match:
            index = offset + int(match.group(2))
            layers.setdefault(index, {})[match.group(3)] = tensor
        else:
            rest[name] = tensor
    return dict(sorted(layers.items())), rest


_LAYER_RE = re.compile(r'^(decoder|encoder)\.layers\.(\d+)\.(.+)$')
_MTP_LAYER_RE = re.compile(r'^mtp\.layers\.(\d+)\.')


# ---------------------------------------------------------------------------------------------
# writing


def args_for_target(
    source_args: argparse.Namespace,
    tp: int,
    pp: int,
    padded_vocab: int,
    save_dir: str,
    iteration: int,
    true_vocab_size: Optional[int] = None,
    split_rank: Optional[int] = None,
) -> argparse.Namespace:
    """The args saved with a converted checkpoint: the source's, at the target layout.

    The converted checkpoint is never interleaved; --use-checkpoint-args at load time takes
    TP, PP, the T5 pipeline split rank (`split_rank`, None for GPT / BERT and one stage) and the
    (absent) virtual pipeline from here.
    """
    args = copy.copy(source_args)
    args.tensor_model_parallel_size = tp
    args.pipeline_model_parallel_size = pp
    args.pipeline_model_parallel_split_rank = split_rank
    args.virtual_pipeline_model_parallel_size = None
    args.num_layers_per_virtual_pipeline_stage = None
    # The target layout splits the layers evenly (the savers write num_layers / pp per stage).
    args.standalone_embedding_stage = False
    args.decoder_first_pipeline_num_layers = None
    args.decoder_last_pipeline_num_layers = None
    args.world_size = tp * pp
    args.data_parallel_size = 1
    args.padded_vocab_size = padded_vocab
    if true_vocab_size is not None:
        args.true_vocab_size = true_vocab_size
    args.save = save_dir
    args.load = None
    args.iteration = iteration
    args.tensorboard_dir = None
    return args


def add_extra_state_entries(stage: StateDict, has_output_layer: bool) -> StateDict:
    """The `_extra_state` entries (None) a model state dict lists for each parallel linear.

    A layer's linears are those whose weight the stage holds; T5's LM head is also registered
    as `lm_head.output_layer`.
    """
    out = dict(stage)
    layers = sorted(
        {m.group(1, 2) for m in map(_LAYER_RE.match, stage) if m}, key=lambda bl: int(bl[1])
    )
    prefixes = [f'{block}.layers.{i}.' for block, i in layers]
    # Multi-token prediction modules: eh_proj and the inner layer's linears.
    mtp = sorted({m.group(1) for m in map(_MTP_LAYER_RE.match, stage) if m}, key=int)
    for k in mtp:
        if f'mtp.layers.{k}.eh_proj.weight' in stage:
            out[f'mtp.layers.{k}.eh_proj._extra_state'] = None
        prefixes.append(f'mtp.layers.{k}.transformer_layer.')
    for prefix in prefixes:
        for module in _EXTRA_STATE_MODULES:
            if f'{prefix}{module}.weight' in stage:
                out[f'{prefix}{module}._extra_state'] = None
    if has_output_layer:
        out['output_layer._extra_state'] = None
        if any(name.startswith('lm_head.output_layer.') for name in stage):
            out['lm_head.output_layer._extra_state'] = None
    return out


class CheckpointWriter:
    """Writes a full model stage by stage at a target TP x PP, in Megatron's file layout.

    Each rank file holds `args`, `checkpoint_version`, `iteration`, `model` and
    `num_floating_point_operations_so_far` (0): no optimizer, scheduler or RNG state, so the
    checkpoint is loaded with --finetune (or --no-load-optim --no-load-rng).

    The stages are written into a staging directory inside `save_dir`; `finish` then replaces
    the checkpoint `save_dir` held (if any) as a whole, so an overwrite never leaves the rank
    folders of two layouts in one iteration, and a conversion killed half-way leaves the old
    checkpoint as it was.
    """

    def __init__(self, save_dir: str, iteration: int, tp: int, pp: int, args, swiglu: bool):
        self.save_dir, self.iteration, self.tp, self.pp = save_dir, iteration, tp, pp
        self.args = args
        self.swiglu = types.SimpleNamespace(gated_linear_unit=swiglu)
        self.staging = staging_root(save_dir)

    def write_stage(self, pp_rank: int, stage: StateDict, has_output_layer: bool) -> List[str]:
        """Split one stage's full state dict (stage-local layer numbers) and save each TP rank.

        `stage` is consumed: each full tensor is dropped once split, so the stage is held about
        once in memory, not twice.
        """
        shards = self._split_consuming(stage)
        names = []
        for tp_rank, shard in enumerate(shards):
            name = get_checkpoint_name(
                self.staging,
                self.iteration,
                pipeline_parallel=self.pp > 1,
                tensor_rank=tp_rank,
                pipeline_rank=pp_rank,
                expert_parallel=False,
                expert_rank=0,
            )
            os.makedirs(os.path.dirname(name), exist_ok=True)
            state = {
                'args': self.args,
                'checkpoint_version': CHECKPOINT_VERSION,
                'iteration': self.iteration,
                'model': add_extra_state_entries(shard, has_output_layer),
                'num_floating_point_operations_so_far': 0,
            }
            tmp = f'{name}.tmp.{os.getpid()}'
            torch.save(state, tmp)
            os.replace(tmp, name)
            names.append(name)
        return names

    def _split_consuming(self, stage: StateDict) -> List[StateDict]:
        if self.tp == 1:
            shards = [dict(stage)]
            stage.clear()
            return shards
        shards: List[StateDict] = [{} for _ in range(self.tp)]
        for name in list(stage):
            pieces = split_state_dict_for_tensor_parallel(
                {name: stage.pop(name)}, self.swiglu, self.tp
            )
            for shard, piece in zip(shards, pieces):
                shard.update(piece)
        return shards

    def finish(self) -> None:
        """Switch `save_dir` to the staged checkpoint; the tracker is written last, so a partial
        conversion is never taken as a checkpoint."""
        commit_staged_checkpoint(self.save_dir, self.staging, self.iteration)
