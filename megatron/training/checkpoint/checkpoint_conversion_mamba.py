"""Mamba / hybrid checkpoints in tools/checkpoint (`convert.py --model-type mamba`): the
tensor-parallel split of a full (TP = 1) MambaModel state dict, the `mp_rank_TT[_PPP]` reader and
writer with that split, and the Hugging Face side (Mamba2ForCausalLM, NemotronHForCausalLM).

TP rules of a Mamba layer's mixer (`decoder.layers.N.mixer.`):

- `in_proj.weight` [z | x | B | C | dt, H]: each rank holds the r-th 1/T of every segment, in
  the same order (not a contiguous block of rows);
- `conv1d.weight` / `.bias` [x | B | C]: the same per-segment slicing;
- `A_log`, `D`, `dt_bias`, `norm.weight`: split along dim 0 (whole heads / channels);
- `out_proj.weight`: split along dim 1;
- `in_proj.layer_norm_weight` (the fused pre-norm): replicated.

The segment sizes are read from the tensors themselves (norm.weight gives d_inner, dt_bias the
heads, the conv the groups x state), so no model flag is needed. Attention and MLP layers, the
embedding and the output layer follow the GPT rules of checkpoint_conversion.py. A pipeline
stage holds L / PP consecutive layers numbered locally, as MambaStack does.
"""

import re
import types
from typing import Dict, List, Tuple

import torch

from megatron.core.models.gpt.hf_weight_mapping import (
    merge_tensor_parallel_state_dicts,
    split_state_dict_for_tensor_parallel,
)
from megatron.training.checkpoint.checkpoint_conversion import CheckpointReader, CheckpointWriter

StateDict = Dict[str, torch.Tensor]

_MIXER_RE = re.compile(r'^(.*\.mixer\.)(in_proj\.weight|conv1d\.weight|conv1d\.bias)$')
_MIXER_DIM0 = ('.mixer.A_log', '.mixer.D', '.mixer.dt_bias', '.mixer.norm.weight')
_MIXER_DIM1 = ('.mixer.out_proj.weight',)


def _segments(sd: StateDict, mixer_prefix: str, name: str, tp: int) -> List[int]:
    """Segment sizes of `name` in `sd` (a full or a rank-local state dict; `tp` = the number of
    ranks it is divided into, 1 for a full tensor's own sizes)."""
    d_inner = sd[f'{mixer_prefix}norm.weight'].shape[0]
    nheads = sd[f'{mixer_prefix}dt_bias'].shape[0]
    gn = (sd[f'{mixer_prefix}conv1d.weight'].shape[0] - d_inner) // 2
    sizes = [d_inner, d_inner, gn, gn, nheads] if name == 'in_proj.weight' else [d_inner, gn, gn]
    for size in sizes:
        if size % tp:
            raise ValueError(
                f'{mixer_prefix}{name}: segment size {size} is not divisible by the tensor '
                f'parallel size {tp} (--target-tensor-parallel-size)'
            )
    return [s // tp for s in sizes]


def split_mamba_state_dict(full: StateDict, swiglu, tp: int) -> List[StateDict]:
    """A full MambaModel state dict -> `tp` rank-local ones (the rules in the module docstring;
    `swiglu` has `gated_linear_unit` for the MLP layers)."""
    shards: List[StateDict] = [{} for _ in range(tp)]
    rest: StateDict = {}
    for name, tensor in full.items():
        match = _MIXER_RE.match(name)
        if match and tp > 1:
            sizes = _segments(full, match.group(1), match.group(2), 1)
            parts = torch.split(tensor, sizes, dim=0)
            for rank, shard in enumerate(shards):
                shard[name] = torch.cat([p.chunk(tp, dim=0)[rank] for p in parts]).clone()
        elif name.endswith(_MIXER_DIM0 + _MIXER_DIM1) and tp > 1:
            dim = 1 if name.endswith(_MIXER_DIM1) else 0
            if tensor.shape[dim] % tp:
                raise ValueError(
                    f'{name}: size {tensor.shape[dim]} of dim {dim} is not divisible by the '
                    f'tensor parallel size {tp} (--target-tensor-parallel-size)'
                )
            for shard, piece in zip(shards, tensor.chunk(tp, dim=dim)):
                shard[name] = piece.contiguous().clone()
        else:
            rest[name] = tensor
    for shard, piece in zip(shards, split_state_dict_for_tensor_parallel(rest, swiglu, tp)):
        shard.update(piece)
    return shards


def merge_mamba_state_dicts(shards: List[StateDict], swiglu) -> StateDict:
    """Inverse of `split_mamba_state_dict` (replicated tensors from rank 0)."""
    tp = len(shards)
    merged: StateDict = {}
    rest: List[StateDict] = [{} for _ in shards]
    for name in shards[0]:
        match = _MIXER_RE.match(name)
        if match and tp > 1:
            local = _segments(shards[0], match.group(1), match.group(2), 1)
            pieces = [torch.split(s[name], local, dim=0) for s in shards]
            merged[name] = torch.cat([torch.cat([p[i] for p in pieces]) for i in range(len(local))])
        elif name.endswith(_MIXER_DIM0 + _MIXER_DIM1) and tp > 1:
            dim = 1 if name.endswith(_MIXER_DIM1) else 0
            merged[name] = torch.cat([s[name] for s in shards], dim=dim)
        else:
            for r, s in zip(rest, shards):
                r[name] = s[name]
    merged.update(merge_tensor_parallel_state_dicts(rest, swiglu))
    return merged


class MambaCheckpointReader(CheckpointReader):
    """`CheckpointReader` whose TP shards are merged per Mamba segment."""

    def merge_shards(self, shards: List[StateDict], swiglu) -> StateDict:
        return merge_mamba_state_dicts(shards, swiglu)


class MambaCheckpointWriter(CheckpointWriter):
    """`CheckpointWriter` whose full tensors are split per Mamba segment."""

    def _split_consuming(self, stage: StateDict) -> List[StateDict]:
        shards = split_mamba_state_dict(stage, self.swiglu, self.tp)
        stage.clear()
        return shards


def _extra_state_names(stage: StateDict) -> StateDict:
    """The mixers' in_proj / out_proj `_extra_state` entries (None), as a model lists them."""
    out = {}
    for name in stage:
        for module in ('.mixer.in_proj', '.mixer.out_proj'):
            if name.endswith(f'{module}.weight'):
                out[name[: -len('weight')] + '_extra_state'] = None
    return out


def stage_state_dicts(full: StateDict, num_layers: int, pp: int) -> List[Tuple[StateDict, bool]]:
    """A full state dict (global layer numbers) -> [(stage state dict with local numbers, is the
    last stage)]: the embedding on stage 0, the final norm and output layer on the last."""
    if num_layers % pp:
        raise ValueError(
            f'--target-pipeline-parallel-size {pp} does not divide the number of layers '
            f'({num_layers})'
        )
    per_stage = num_layers // pp
    stages: List[StateDict] = [{} for _ in range(pp)]
    for name, tensor in full.items():
        match = re.match(r'^decoder\.layers\.(\d+)\.(.+)$', name)
        if match:
            index = int(match.group(1))
            local = index - (index // per_stage) * per_stage
            stages[index // per_stage][f'decoder.layers.{local}.{match.group(2)}'] = tensor
        elif name.startswith('embedding.'):
            stages[0][name] = tensor
        else:
            stages[-1][name] = tensor
    if pp > 1 and 'output_layer.weight' not in full:
        # Tied embeddings: the last stage keeps its own copy of the word embeddings.
        stages[-1]['output_layer.weight'] = full['embedding.word_embeddings.weight']
    out = []
    for p, stage in enumerate(stages):
        stage.update(_extra_state_names(stage))
        if p == pp - 1:
            # The last stage's output layer lists one even when it borrows the tied embedding.
            stage['output_layer._extra_state'] = None
        out.append((stage, p == pp - 1))
    return out


def full_state_dict(reader: CheckpointReader) -> Tuple[StateDict, List[dict]]:
    """All stages of a checkpoint merged into one full state dict with global layer numbers,
    and stage 0's other entries (a tied model's last-stage copy of the word embeddings,
    `output_layer.weight`, is kept: the caller drops it)."""
    full: StateDict = {}
    first_others = None
    for pp_rank in range(reader.pp):
        chunks, others = reader.load_stage(pp_rank)
        first_others = first_others or others
        for offset, chunk in chunks:
            for name, tensor in chunk.items():
                if name.endswith('._extra_state'):
                    continue
                match = re.match(r'^decoder\.layers\.(\d+)\.(.+)$', name)
                if match:
                    name = f'decoder.layers.{offset + int(match.group(1))}.{match.group(2)}'
                elif name in full:
                    continue
                full[name] = tensor
    return full, first_others


def swiglu_of(args) -> types.SimpleNamespace:
    return types.SimpleNamespace(gated_linear_unit=bool(getattr(args, 'swiglu', False)))
