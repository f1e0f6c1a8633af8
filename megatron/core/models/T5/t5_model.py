"""T5Model: one shared embedding, a TransformerBlock encoder, a TransformerBlock decoder with cross
attention, and a tied LM head with a bias.

Notation: b batch, s_enc / s_dec encoder / decoder length, h hidden size, v padded vocabulary,
p tensor-parallel size.

Pipeline parallelism (`pipeline_model_parallel_split_rank` r, pp stages): stages 0..r-1 hold the
encoder (encoder_layers / r layers each), stages r..pp-1 the decoder (decoder_layers / (pp - r)
each). Stage 0 and stage r hold the embedding (two copies, kept equal: stage r's is zeroed and
all-reduced over the embedding / position-embedding groups at start, their gradients all-reduced
by `finalize_model_grads`); stage r-1 applies the encoder's final LayerNorm; the last stage the
decoder's final LayerNorm and the LM head. A decoder stage receives the encoder output (and, after
stage r, the decoder hidden states) through `set_input_tensor`; the schedule forwards the encoder
output unchanged to later decoder stages and carries its gradient back across the split.
"""

import dataclasses
from typing import List, Literal, Optional

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig


def _stage_side_of_split(pp_group) -> tuple:
    """(before split, after split) of this stage of `pp_group`: which stacks it runs.

    One stage runs both; with several stages, those before `pipeline_model_parallel_split_rank`
    run the encoder and the others the decoder (no split rank: every stage runs both).
    """
    size = torch.distributed.get_world_size(pp_group) if pp_group is not None else 1
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if size == 1 or split is None:
        return True, True
    rank = torch.distributed.get_rank(pp_group)
    return rank < split, rank >= split


def t5_extended_attention_mask(
    attention_mask_list: List[Optional[Tensor]],
) -> List[Optional[Tensor]]:
    """Insert the head axis: each bool [b, sq, sk] mask (True = masked out) -> [b, 1, sq, sk]."""

    def attn_mask_postprocess(attn_mask):
        # [b, sq, sk] -> [b, 1, sq, sk]
        return attn_mask.unsqueeze(1)

    return [
        attn_mask_postprocess(attn_mask) if attn_mask is not None else None
        for attn_mask in attention_mask_list
    ]


def t5_position_ids(token_ids: Tensor) -> Tensor:
    """Positions 0..s-1 for every row of token_ids [b, s]."""
    seq_length = token_ids.size(1)
    position_ids = torch.arange(seq_length, dtype=torch.long, device=token_ids.device)
    return position_ids.unsqueeze(0).expand_as(token_ids)


class T5LMHead(MegatronModule):
    """The LM head: a ColumnParallelLinear [h -> v] split along v (each rank computes v/p logits,
    all-reduce of the input gradient in backward). Tied to the word embedding it has a bias of v/p
    per rank that is added; untied it has no bias at all (as in Megatron).

    Args:
        config (TransformerConfig): the model config.
        parallel_output (bool): keep the logits split across the TP group.
        vocab_size (int): padded vocabulary size.
        pre_process (bool): this stage also holds the embedding (then a tied weight is borrowed).
        share_embeddings_and_output_weights (bool): tie the head to the word embedding.
        tp_group (ProcessGroup, optional): the tensor parallel group the vocabulary is split
            across (default: the global one).
    """

    def __init__(
        self,
        config: TransformerConfig,
        parallel_output: bool,
        vocab_size: int,
        pre_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
        tp_group: Optional[torch.distributed.ProcessGroup] = None,
    ):
        super().__init__(config=config)
        self.parallel_output = parallel_output
        tied = share_embeddings_and_output_weights
        # A tied head on the embedding stage borrows the embedding's weight at forward time, so it
        # allocates none of its own; the bias is then a real parameter added in place.
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            tp_group=tp_group,
            gather_output=not parallel_output,
            init_method=config.init_method,
            skip_weight_param_allocation=tied and pre_process,
            bias=tied,
            skip_bias_add=not tied,
        )

    def forward(self, hidden_states: Tensor, word_embeddings_weight: Optional[Tensor]) -> Tensor:
        """hidden_states [s_dec, b, h] -> logits [s_dec, b, v/p]."""
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


def _stage_share(num_layers: int, flag: str, stack: str, pp_group: torch.distributed.ProcessGroup):
    """(first layer, layer count) of this pipeline stage's share of a stack of num_layers layers.

    Without a split rank (or with one stage) the stage holds the whole stack. `pp_group` is the
    pipeline group of the model (its size and this rank's stage).
    """
    pp_size = pp_group.size()
    # The split rank is a global setting of parallel_state, not a property of any group.
    split = parallel_state.get_pipeline_model_parallel_split_rank()
    if pp_size == 1:
        return 0, num_layers
    if split is None:
        raise ValueError(
            f"T5 with pipeline_model_parallel_size {pp_size} needs "
            "pipeline_model_parallel_split_rank (--pipeline-model-parallel-split-rank)"
        )
    rank = pp_group.rank()
    num_stages = split if stack == 'encoder' else pp_size - split
    stage = rank if stack == 'encoder' else rank - split
    if num_layers % num_stages != 0:
        raise ValueError(
            f"{flag} ({num_layers}) must be divisible by the number of {stack} pipeline stages "
            f"({num_stages}; pipeline size {pp_size}, split rank {split})"
        )
    per_stage = num_layers // num_stages
    return stage * per_stage, per_stage


def _stage_block_spec(
    spec: TransformerBlockSubmodules,
    flag: str,
    stack: str,
    pp_group: torch.distributed.ProcessGroup,
):
    first, count = _stage_share(len(spec.layer_specs), flag, stack, pp_group)
    return TransformerBlockSubmodules(
        layer_specs=spec.layer_specs[first : first + count], layer_norm=spec.layer_norm
    )


class T5Model(LanguageModule):
    """Encoder-decoder transformer language model (Megatron's "T5": pre-LN LayerNorm layers with
    biases, learned absolute positions shared by both stacks, gelu MLP).

    Args:
        config (TransformerConfig): the model config; config.num_layers is the encoder depth.
        transformer_encoder_layer_spec (TransformerBlockSubmodules): encoder block spec (all
            layers; this stage keeps its share).
        transformer_decoder_layer_spec (TransformerBlockSubmodules): decoder block spec (all
            layers; its length is the decoder depth).
        vocab_size (int): padded vocabulary size.
        max_sequence_length (int): rows of the learned position table.
        pre_process (bool): this stage holds the embedding (pipeline stage 0 and the split rank).
        post_process (bool): this stage holds its stack's final LayerNorm (and, in the decoder, the
            LM head and loss).
        fp16_lm_cross_entropy (bool): compute the cross entropy on 16-bit logits.
        parallel_output (bool): keep the logits split across the TP group.
        share_embeddings_and_output_weights (bool): tie the LM head to the word embedding.
        position_embedding_type: 'learned_absolute' or 'rope'.
        rotary_percent (float): fraction of each head rotated by RoPE.
        seq_len_interpolation_factor (float, optional): RoPE position interpolation.
        add_encoder (bool, optional): this stage runs (part of) the encoder. None (the default):
            derived from the pipeline split, True on the stages before
            `pipeline_model_parallel_split_rank` (always with one stage). Megatron core_r0.8.0's
            T5Model has no such argument and builds both stacks on every stage, so its own
            pretrain_t5.py, which does not pass it, gets the right stage here.
        add_decoder (bool, optional): this stage runs (part of) the decoder. None: True on the
            stages from the split rank on (always with one stage).
        pg_collection (ProcessGroupCollection, optional): the groups of this model (tp splits
            every layer, pp places the stages, embd / pos_embd tie the embedding copies and the
            LM head); None fields fall back to the global groups.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_encoder_layer_spec: TransformerBlockSubmodules,
        transformer_decoder_layer_spec: TransformerBlockSubmodules,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal['learned_absolute', 'rope'] = 'learned_absolute',
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: Optional[float] = None,
        add_encoder: Optional[bool] = None,
        add_decoder: Optional[bool] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        # LanguageModule resolves tp, pp and embd; the split-rank stage also ties its position
        # table to stage 0's over the position-embedding group.
        self.pg_collection = resolve_process_groups(self.pg_collection, ("pos_embd",))
        if add_encoder is None or add_decoder is None:
            before, after = _stage_side_of_split(self.pg_collection.pp)
            add_encoder = before if add_encoder is None else add_encoder
            add_decoder = after if add_decoder is None else add_decoder
        if vocab_size % config.tensor_model_parallel_size != 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be a multiple of tensor_model_parallel_size "
                f"({config.tensor_model_parallel_size}); pad the vocabulary first."
            )
        if position_embedding_type not in ('learned_absolute', 'rope'):
            raise ValueError(
                "T5 position_embedding_type must be 'learned_absolute' or 'rope', got "
                f"{position_embedding_type!r}"
            )
        if not (add_encoder or add_decoder):
            raise ValueError("T5Model: a stage needs add_encoder or add_decoder")

        self.model_type = ModelType.encoder_and_decoder
        self.encoder_block_spec, self.decoder_block_spec = (
            transformer_encoder_layer_spec,
            transformer_decoder_layer_spec,
        )
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        # Set by set_input_tensor on a decoder stage that does not run the encoder itself.
        self.encoder_hidden_state = None

        # Build order fixes the draws from the init RNG: embedding, encoder, decoder, head.
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=self.config,
                pg_collection=self.pg_collection,
                vocab_size=vocab_size,
                position_embedding_type=position_embedding_type,
                max_sequence_length=max_sequence_length,
            )
        if position_embedding_type == 'rope':
            # No parameters: one rotary table serves encoder and decoder alike.
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=self.config.kv_channels,
                rotary_interleaved=self.config.rotary_interleaved,
                rotary_percent=rotary_percent,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
            )

        if self.add_encoder:
            self.encoder = TransformerBlock(
                config=self.config,
                spec=_stage_block_spec(
                    transformer_encoder_layer_spec,
                    'encoder num_layers',
                    'encoder',
                    self.pg_collection.pp,
                ),
                pre_process=self.pre_process,
                post_process=self.post_process,
                pg_collection=self.pg_collection,
            )
        else:
            self.encoder = None

        if self.add_decoder:
            # The decoder's own depth sets its stage offsets (the config carries the encoder's).
            decoder_config = dataclasses.replace(
                self.config, num_layers=len(transformer_decoder_layer_spec.layer_specs)
            )
            self.decoder = TransformerBlock(
                config=decoder_config,
                spec=_stage_block_spec(
                    transformer_decoder_layer_spec,
                    'decoder num_layers',
                    'decoder',
                    self.pg_collection.pp,
                ),
                pre_process=self.pre_process,
                post_process=self.post_process,
                pg_collection=self.pg_collection,
            )
        else:
            self.decoder = None

        if self.post_process and self.add_decoder:
            self.lm_head = T5LMHead(
                config=config,
                vocab_size=vocab_size,
                parallel_output=parallel_output,
                share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                pre_process=pre_process,
                tp_group=self.pg_collection.tp,
            )
            # Megatron registers the head's linear a second time under this name.
            self.output_layer = self.lm_head.output_layer

        if self.pre_process or (self.post_process and self.add_decoder):
            self._setup_embeddings_and_output_layer()

    @property
    def _has_lm_head(self) -> bool:
        return self.post_process and self.add_decoder

    def _setup_embeddings_and_output_layer(self) -> None:
        """Tag and tie the embedding copies (see the module docstring).

        Stage 0 owns the embedding. The split-rank stage's copy is zeroed, then the word table is
        all-reduced over the embedding group (stage 0, split rank, last stage) and the position
        table over the position-embedding group (stage 0, split rank), which copies stage 0's
        values. A tied last stage without the embedding holds a zero-filled output weight that
        the same all-reduce fills.
        """
        if self.pre_process:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self._has_lm_head and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True

        if self.share_embeddings_and_output_weights and self.pre_process and self._has_lm_head:
            # The head reads the embedding table of this stage: its fused weight-gradient
            # accumulation must leave autograd a zero tensor, so that the DDP hook still adds the
            # embedding lookup's gradient (one stage, or a split rank that is also the last).
            self.shared_embedding_or_output_weight().zero_out_wgrad = True
        if self.pg_collection.pp.size() == 1:
            return

        # Stage 0 of the pipeline group; no virtual-pipeline check is needed since the
        # interleaved schedule is rejected for encoder-decoder models.
        first_stage = self.pg_collection.pp.rank() == 0
        if self.pre_process and not first_stage:
            self.embedding.zero_parameters()
        if self.share_embeddings_and_output_weights and first_stage:
            self.shared_embedding_or_output_weight().shared_embedding = True
        if self.share_embeddings_and_output_weights and self._has_lm_head and not self.pre_process:
            self.output_layer.weight.data.fill_(0)
            self.output_layer.weight.shared = True
            self.output_layer.weight.shared_embedding = True

        if not torch.distributed.is_initialized():
            return
        holds_word_table = self.pre_process or (
            self._has_lm_head and self.share_embeddings_and_output_weights
        )
        # The embedding groups are None on ranks that are not members.
        if holds_word_table and self.pg_collection.embd is not None:
            if self.share_embeddings_and_output_weights:
                torch.distributed.all_reduce(
                    self.shared_embedding_or_output_weight().data, group=self.pg_collection.embd
                )
        if self.pre_process and self.pg_collection.pos_embd is not None:
            if not self.share_embeddings_and_output_weights:
                # Untied: the two input-embedding copies still start equal.
                torch.distributed.all_reduce(
                    self.embedding.word_embeddings.weight.data,
                    group=self.pg_collection.pos_embd,
                )
            if self.embedding.add_position_embedding:
                torch.distributed.all_reduce(
                    self.embedding.position_embeddings.weight.data,
                    group=self.pg_collection.pos_embd,
                )

    def shared_embedding_or_output_weight(self) -> Optional[Tensor]:
        """The word-embedding weight where this stage has the embedding, else the LM head's."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self._has_lm_head:
            return self.output_layer.weight
        return None

    def output_logits(self, hidden_states: Tensor) -> Tensor:
        """Logits [s_dec, b, v/p] of hidden_states [s_dec, b, h] through the LM head (with its bias
        when tied to the word embedding)."""
        return self.lm_head(hidden_states, word_embeddings_weight=self.tied_output_weight())

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint: `embedding.*`, `encoder.*`, `decoder.*` and `output_layer.*`
        (the head under its second name, never `lm_head.*`).

        Each stack's layers are stored with a layer axis of that stack's own depth. The
        split-rank stage's copy of the embedding is a non-main replica of stage 0's (read,
        never written); a tied head on a stage without the embedding likewise (see
        LanguageModule).
        """
        from megatron.core.dist_checkpointing.utils import (
            set_replica_pipeline_slot,
            sharded_state_dict_default,
        )

        assert not sharded_offsets, 'Unexpected sharded offsets'
        sharded_state_dict = {}
        for name, child in self._modules.items():
            if name == 'lm_head' or child is None:
                continue
            child_sd = sharded_state_dict_default(child, f'{prefix}{name}.', (), metadata)
            if name == 'embedding' and not parallel_state.is_pipeline_first_stage():
                set_replica_pipeline_slot(child_sd, 1)
            sharded_state_dict.update(child_sd)
        self._tie_output_layer_sharded_state_dict(sharded_state_dict, prefix)
        return sharded_state_dict

    def set_input_tensor(self, input_tensor) -> None:
        """Set this stage's pipeline input.

        Encoder stage: [encoder hidden states]. First decoder stage: [encoder output]. Later decoder
        stages: [decoder hidden states, encoder output]. One stage holding both: [None].
        """
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]

        if self.add_encoder:
            # Whatever else the stage holds, its one input feeds the encoder.
            if self.add_decoder:
                message = 'input_tensor should be length 1 (encoder and decoder)'
            else:
                message = 'input_tensor should be length 1 for an encoder stage'
            assert len(input_tensor) == 1, message
            self.encoder.set_input_tensor(input_tensor[0])
            return
        if not self.add_decoder:
            return
        if len(input_tensor) not in (1, 2):
            raise Exception('input_tensor must have either length 1 or 2')
        # The encoder output always travels last; a first decoder stage gets nothing else.
        *decoder_input, self.encoder_hidden_state = input_tensor
        self.decoder.set_input_tensor(decoder_input[0] if decoder_input else None)

    def _rotary_pos_emb(self, block, block_input):
        if self.position_embedding_type != 'rope':
            return None
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, block, block_input, self.config)
        return self.rotary_pos_emb(seq_len)

    def forward(
        self,
        encoder_input_ids: Tensor,
        decoder_input_ids: Tensor,
        encoder_attn_mask: Tensor,
        decoder_attn_mask: Tensor,
        encoder_decoder_attn_mask: Tensor,
        lm_labels: Tensor = None,
        encoder_hidden_states: Tensor = None,
        output_encoder_hidden_only: bool = False,
        inference_params=None,
    ) -> Tensor:
        """Run this stage.

        Args:
            encoder_input_ids: [b, s_enc] token ids (stage 0).
            decoder_input_ids: [b, s_dec] token ids (split-rank stage).
            encoder_attn_mask: bool [b, s_enc, s_enc], True = masked out.
            decoder_attn_mask: bool [b, s_dec, s_dec] (causal and padding), True = masked out.
            encoder_decoder_attn_mask: bool [b, s_dec, s_enc], True = masked out.
            lm_labels: [b, s_dec] targets; when given the per-token loss is returned.
            encoder_hidden_states: [s_enc, b, h] precomputed encoder output (skips the encoder).
            output_encoder_hidden_only: return the encoder output.
            inference_params: KV cache (not supported).

        Returns:
            Encoder stages: the encoder hidden states [s_enc, b, h]. Decoder stages before the
            last: decoder hidden states [s_dec, b, h]. Last stage: the loss [b, s_dec] (fp32) with
            labels, else logits [b, s_dec, v/p].
        """
        (encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask) = (
            t5_extended_attention_mask(
                [encoder_attn_mask, decoder_attn_mask, encoder_decoder_attn_mask]
            )
        )

        if encoder_hidden_states is None and self.add_encoder:
            if self.pre_process:
                encoder_input = self.embedding(
                    input_ids=encoder_input_ids, position_ids=t5_position_ids(encoder_input_ids)
                )
            else:
                encoder_input = None  # from set_input_tensor
            encoder_hidden_states = self.encoder(
                hidden_states=encoder_input,
                attention_mask=encoder_attn_mask,
                inference_params=inference_params,
                rotary_pos_emb=self._rotary_pos_emb(self.encoder, encoder_input),
            )

        if output_encoder_hidden_only or not self.add_decoder:
            return encoder_hidden_states
        if encoder_hidden_states is None:
            # A decoder-only stage: the encoder output arrived through set_input_tensor.
            encoder_hidden_states = self.encoder_hidden_state

        if self.pre_process:
            decoder_input = self.embedding(
                input_ids=decoder_input_ids, position_ids=t5_position_ids(decoder_input_ids)
            )
        else:
            decoder_input = None  # from set_input_tensor

        # Cross-attention reads the encoder output as its keys and values.
        decoder_hidden_states = self.decoder(
            hidden_states=decoder_input,
            rotary_pos_emb=self._rotary_pos_emb(self.decoder, decoder_input),
            attention_mask=decoder_attn_mask,
            inference_params=inference_params,
            context_mask=encoder_decoder_attn_mask,
            context=encoder_hidden_states,
        )

        if not self.post_process:
            return decoder_hidden_states

        return self.logits_or_loss(self.output_logits(decoder_hidden_states), lm_labels)
