"""T5 (encoder-decoder) checkpoints for resharding (tools/checkpoint --model-type T5).

What a pipeline stage of a T5Model holds, given the encoder / decoder depths, the pipeline size
and `--pipeline-model-parallel-split-rank` r (as `T5Model` and `get_model` build it):

- one stage (PP 1): the embedding, every encoder layer, the encoder's final LayerNorm, every
  decoder layer, the decoder's final LayerNorm and the LM head;
- stages 0 .. r-1 hold the encoder, encoder_layers / r layers each; stage 0 the embedding,
  stage r-1 the encoder's final LayerNorm;
- stages r .. pp-1 hold the decoder, decoder_layers / (pp - r) layers each; stage r a second copy
  of the embedding (word and position tables, equal to stage 0's), the last stage the decoder's
  final LayerNorm and the LM head. A tied head on a last stage without the embedding keeps a
  third copy of the word table as `output_layer.weight`.

The LM head is one ColumnParallelLinear registered twice (`output_layer.*` and
`lm_head.output_layer.*` name the same tensors); tied to the word embedding it has a bias (split
along the vocabulary like the table) and no weight of its own, untied a weight and no bias.

Layer-local names of a decoder layer are a GPT layer's plus the cross attention's
(`pre_cross_attn_layernorm`, `cross_attention.linear_q / linear_kv / linear_proj`); their
messages are `DECODER_MESSAGE_KEYS`.
"""

import dataclasses
import re
from typing import Dict, Optional, Tuple

import torch

from megatron.training.checkpoint.checkpoint_conversion import LAYER_MESSAGE_KEYS

StateDict = Dict[str, torch.Tensor]

#: Cross-attention names of a decoder layer -> message keys (Megatron's converter has no T5).
CROSS_MESSAGE_KEYS = {
    'pre_cross_attn_layernorm.weight': 'cross norm weight',
    'pre_cross_attn_layernorm.bias': 'cross norm bias',
    'cross_attention.linear_q.weight': 'cross q weight',
    'cross_attention.linear_q.bias': 'cross q bias',
    'cross_attention.linear_kv.weight': 'cross kv weight',
    'cross_attention.linear_kv.bias': 'cross kv bias',
    'cross_attention.linear_proj.weight': 'cross dense weight',
    'cross_attention.linear_proj.bias': 'cross dense bias',
}
DECODER_MESSAGE_KEYS = {**LAYER_MESSAGE_KEYS, **CROSS_MESSAGE_KEYS}

_LAYER_RE = re.compile(r'^(encoder|decoder)\.layers\.(\d+)\.(.+)$')


@dataclasses.dataclass(frozen=True)
class T5Stage:
    """What one pipeline stage of a T5 holds.

    Attributes:
        encoder: (first global encoder layer, count), or None on a decoder stage.
        decoder: (first global decoder layer, count), or None on an encoder stage.
        embedding: the word (and position) tables (stage 0 and the split-rank stage).
        encoder_final_norm: the encoder's final LayerNorm (the last encoder stage).
        decoder_head: the decoder's final LayerNorm and the LM head (the last stage).
    """

    encoder: Optional[Tuple[int, int]]
    decoder: Optional[Tuple[int, int]]
    embedding: bool
    encoder_final_norm: bool
    decoder_head: bool


def check_t5_layout(
    encoder_layers: int,
    decoder_layers: int,
    pp: int,
    split: Optional[int],
    pp_flag: str = '--pipeline-model-parallel-size',
    split_flag: str = '--pipeline-model-parallel-split-rank',
) -> None:
    """A T5 at PP `pp` with split rank `split` has a whole number of layers per stage.

    Raises:
        ValueError: one line naming the flags and the numbers.
    """
    if pp == 1:
        if split is not None:
            raise ValueError(f'{split_flag} {split} needs {pp_flag} > 1 (got 1)')
        return
    if split is None:
        raise ValueError(f'{split_flag} is required for a T5 at {pp_flag} {pp}')
    if not 1 <= split < pp:
        raise ValueError(
            f'{split_flag} {split} does not fit {pp_flag} {pp}: it must be at least 1 and less '
            f'than {pp} (stages 0 .. split-1 hold the encoder, the others the decoder)'
        )
    if encoder_layers % split:
        raise ValueError(
            f'{split_flag} {split}: the {encoder_layers} encoder layers do not divide into '
            f'{split} encoder stages'
        )
    if decoder_layers % (pp - split):
        raise ValueError(
            f'{split_flag} {split} with {pp_flag} {pp}: the {decoder_layers} decoder layers do '
            f'not divide into {pp - split} decoder stages'
        )


def t5_stage(
    encoder_layers: int, decoder_layers: int, pp: int, split: Optional[int], pp_rank: int
) -> T5Stage:
    """The contents of stage `pp_rank` (the layout is assumed valid: see `check_t5_layout`)."""
    if pp == 1:
        return T5Stage((0, encoder_layers), (0, decoder_layers), True, True, True)
    if pp_rank < split:
        per_stage = encoder_layers // split
        return T5Stage(
            encoder=(pp_rank * per_stage, per_stage),
            decoder=None,
            embedding=pp_rank == 0,
            encoder_final_norm=pp_rank == split - 1,
            decoder_head=False,
        )
    per_stage = decoder_layers // (pp - split)
    return T5Stage(
        encoder=None,
        decoder=((pp_rank - split) * per_stage, per_stage),
        embedding=pp_rank == split,
        encoder_final_norm=False,
        decoder_head=pp_rank == pp - 1,
    )


def split_t5_chunk(
    chunk: StateDict, stage: T5Stage
) -> Tuple[Dict[int, StateDict], Dict[int, StateDict], StateDict]:
    """(encoder layers, decoder layers, the rest) of one stage's (TP-merged) state dict.

    Layers are keyed by global index within their stack, each a layer-local state dict.
    """
    stacks: Dict[str, Dict[int, StateDict]] = {'encoder': {}, 'decoder': {}}
    rest: StateDict = {}
    for name, tensor in chunk.items():
        match = _LAYER_RE.match(name)
        if not match:
            rest[name] = tensor
            continue
        block, local, key = match.group(1), int(match.group(2)), match.group(3)
        share = stage.encoder if block == 'encoder' else stage.decoder
        if share is None or local >= share[1]:
            raise ValueError(
                f'checkpoint tensor {name} does not belong on this pipeline stage of the T5 its '
                f'args describe ({block} layers: {share})'
            )
        stacks[block].setdefault(share[0] + local, {})[key] = tensor
    return (
        dict(sorted(stacks['encoder'].items())),
        dict(sorted(stacks['decoder'].items())),
        rest,
    )


def t5_depths(args) -> Tuple[int, int]:
    """(encoder layers, decoder layers) recorded in a checkpoint's args."""
    encoder = getattr(args, 'encoder_num_layers', None) or args.num_layers
    decoder = getattr(args, 'decoder_num_layers', None) or encoder
    return encoder, decoder
