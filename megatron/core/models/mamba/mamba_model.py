"""MambaModel: embedding (first stage) -> MambaStack (hybrid Mamba / attention / MLP layers) ->
output layer and loss (last stage).

Notation: b batch, s sequence, H hidden size, v padded vocabulary, p tensor-parallel size.
"""

from typing import Literal, Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.ssm.mamba_context_parallel import check_packed_offsets
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_config import TransformerConfig


def seq_idx_from_packed(packed_seq_params: PackedSeqParams, b: int, s: int) -> Tensor:
    """Document ids [b, s] of a packed batch-major stream (segment k of the stream -> id k)."""
    offsets = packed_seq_params.segment_offsets().to(torch.long)
    positions = torch.arange(b * s, device=offsets.device)
    ids = torch.bucketize(positions, offsets[1:], right=True)  # [b * s]
    return ids.view(b, s)


def seq_idx_from_eod(tokens: Tensor, eod: int, cp_group=None) -> Tensor:
    """Document ids [b, s] of token rows [b, s]: a new document starts after each
    end-of-document token (the boundaries of --reset-attention-mask).

    Under context parallelism (`cp_group` of size P > 1) `tokens` [b, s/P] is this rank's
    dual-chunk slice: the end markers are all-gathered over the group, counted along the whole
    row and this rank's slice of the global ids is returned ([b, s/P], what the Mamba mixer's
    all-to-all expects)."""
    ends = (tokens == eod).to(torch.long)
    if cp_group is None or cp_group.size() == 1:
        return torch.cumsum(ends, dim=1) - ends
    from megatron.core.transformer.context_parallel.layout import (
        gather_from_cp_layout,
        slice_for_cp_rank,
    )

    parts = [torch.empty_like(ends) for _ in range(cp_group.size())]
    torch.distributed.all_gather(parts, ends.contiguous(), group=cp_group)
    full = gather_from_cp_layout(parts, 1)  # [b, s] in sequence order
    ids = torch.cumsum(full, dim=1) - full
    return slice_for_cp_rank(ids, 1, cp_group.size(), cp_group.rank())


class MambaModel(LanguageModule):
    """Hybrid Mamba-2 / attention / MLP language model (Megatron's `MambaModel`).

    The output layer is a ColumnParallelLinear [H -> v] split along v (each rank computes v/p
    logits; backward all-reduces the input gradient over tp) unless `parallel_output=False`
    gathers them; with `share_embeddings_and_output_weights` it reads the word-embedding table.

    Args:
        config (TransformerConfig): the model config (mamba_* fields size the mixers).
        mamba_stack_spec (ModuleSpec): the MambaStack spec (mamba_layer_specs.mamba_stack_spec).
        vocab_size: padded vocabulary size.
        max_sequence_length: positions of learned absolute embeddings.
        pre_process / post_process: first / last pipeline stage.
        hybrid_attention_ratio, hybrid_mlp_ratio, hybrid_override_pattern: the layer allocation
            (mamba_hybrid_layer_allocation.allocate_layers).
        fp16_lm_cross_entropy: cross entropy on 16-bit logits.
        parallel_output: keep the logits split across tp.
        share_embeddings_and_output_weights: tie the output layer to the embedding.
        position_embedding_type: 'learned_absolute', 'rope' or 'none' (Mamba layers use none).
        rotary_percent, rotary_base, seq_len_interpolation_factor: RoPE of attention layers.
        pg_collection (ProcessGroupCollection, optional): the groups of this model.
    """

    def __init__(
        self,
        config: TransformerConfig,
        mamba_stack_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        hybrid_attention_ratio: float = 0.0,
        hybrid_mlp_ratio: float = 0.0,
        hybrid_override_pattern: Optional[str] = None,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal['learned_absolute', 'rope', 'none'] = 'none',
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        seq_len_interpolation_factor: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=config, pg_collection=pg_collection)
        if vocab_size % config.tensor_model_parallel_size != 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be a multiple of tensor_model_parallel_size "
                f"({config.tensor_model_parallel_size}); pad the vocabulary first."
            )
        if position_embedding_type not in ('learned_absolute', 'rope', 'none'):
            raise ValueError(
                "position_embedding_type must be 'learned_absolute', 'rope' or 'none', got "
                f"{position_embedding_type!r}"
            )
        # Constructor options kept as attributes under the names other code reads.
        self.mamba_stack_spec = mamba_stack_spec
        options = {
            'vocab_size': vocab_size,
            'max_sequence_length': max_sequence_length,
            'pre_process': pre_process,
            'post_process': post_process,
            'hybrid_attention_ratio': hybrid_attention_ratio,
            'hybrid_mlp_ratio': hybrid_mlp_ratio,
            'hybrid_override_pattern': hybrid_override_pattern,
            'fp16_lm_cross_entropy': fp16_lm_cross_entropy,
            'parallel_output': parallel_output,
            'share_embeddings_and_output_weights': share_embeddings_and_output_weights,
            'position_embedding_type': position_embedding_type,
        }
        for name, value in options.items():
            setattr(self, name, value)
        self.model_type = ModelType.encoder_or_decoder

        # Submodules in the order of their weight-init draws: embedding, stack, output layer.
        if self.pre_process:
            self.embedding = LanguageModelEmbedding(
                self.config,
                vocab_size,
                max_sequence_length,
                position_embedding_type,
                pg_collection=self.pg_collection,
            )
        if self.position_embedding_type == 'rope':
            # Angles for the attention layers of the stack; the Mamba layers ignore them.
            self.rotary_pos_emb = RotaryEmbedding(
                self.config.kv_channels,
                rotary_percent,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rotary_interleaved=self.config.rotary_interleaved,
                cp_group=self.pg_collection.cp,
            )
        layout = {
            name: options[name]
            for name in ('hybrid_attention_ratio', 'hybrid_mlp_ratio', 'hybrid_override_pattern')
        }
        self.decoder = build_module(
            mamba_stack_spec,
            self.config,
            pre_process=self.pre_process,
            post_process=self.post_process,
            pg_collection=self.pg_collection,
            **layout,
        )
        if self.post_process:
            # [s, b, H] -> [s, b, v/p]; with tied weights on the embedding stage the layer owns
            # no weight and borrows the word-embedding table.
            borrows_weight = self.pre_process and self.share_embeddings_and_output_weights
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                self.vocab_size,
                gather_output=not self.parallel_output,
                skip_weight_param_allocation=borrows_weight,
                config=config,
                init_method=config.init_method,
                bias=False,
                skip_bias_add=False,
                tp_group=self.pg_collection.tp,
            )
        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint (see LanguageModule); the output layer's empty extra state is
        not stored."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        extra = sharded_state_dict.pop(f'{prefix}output_layer._extra_state', None)
        assert extra is None or extra.data is None, 'output layer extra state is not empty'
        return sharded_state_dict

    def set_input_tensor(self, input_tensor) -> None:
        """The previous pipeline stage's output [s, b, H] (a tensor or a one-element list)."""
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        assert len(input_tensor) == 1, 'input_tensor should only be length 1 for mamba'
        self.decoder.set_input_tensor(input_tensor[0])

    def _embed(self, input_ids, position_ids, inference_params):
        """input_ids [b, s] -> embeddings [s, b, H]; during decoding the default positions
        continue after the cached ones."""
        if position_ids is None and inference_params is not None:
            first = inference_params.sequence_len_offset
            steps = torch.arange(first, first + input_ids.size(1), device=input_ids.device)
            position_ids = steps.unsqueeze(0)  # [1, s]
        return self.embedding(input_ids=input_ids, position_ids=position_ids)

    def _rotary_angles(self, inference_params, decoder_input, packed_seq_params):
        """RoPE angles [s, 1, 1, d] for the attention layers of the stack ([s, b, 1, d]
        restarting at every segment of packed sequences), or None."""
        if self.position_embedding_type != 'rope':
            return None
        length = self.rotary_pos_emb.get_rotary_seq_len(
            inference_params, self.decoder, decoder_input, self.config
        )
        if packed_seq_params is not None:
            return self.rotary_pos_emb.packed_angles(length, packed_seq_params)
        return self.rotary_pos_emb(length)

    def _mamba_under_cp(self) -> bool:
        """Whether this model runs Mamba layers over a context parallel group of size > 1."""
        from megatron.core.ssm.mamba_block import layer_is_mamba

        layers = [layer for layer in self.decoder.layers if layer_is_mamba(layer)]
        return any(getattr(layer.mixer, 'cp', None) is not None for layer in layers)

    def _stage_shape(self, input_ids, decoder_input):
        """(b, s) of this micro-batch on any pipeline stage (the full s under SP)."""
        if input_ids is not None:
            return tuple(input_ids.shape)
        block_input = decoder_input if self.pre_process else self.decoder.input_tensor
        s, b = block_input.shape[:2]  # [s, b, H], [s/tp, b, H] under SP
        if self.config.sequence_parallel:
            s *= self.config.tensor_model_parallel_size
        return b, s

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Optional[Tensor],
        decoder_input: Tensor = None,
        labels: Tensor = None,
        inference_params=None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        seq_idx: Optional[Tensor] = None,
    ) -> Tensor:
        """Run this stage.

        Args:
            input_ids: [b, s] token ids (first stage).
            position_ids: [b, s] positions (learned_absolute).
            attention_mask: bool [b, 1, s, s] for the attention layers (True = masked), or None.
            decoder_input: [s, b, H] precomputed embedding output.
            labels: [b, s] targets; when given the per-token loss is returned.
            inference_params (InferenceParams or DynamicInferenceContext): KV and conv / SSM
                state caches (static batch, or the dynamic engine's packed step).
            packed_seq_params: packed sequences over the batch-major stream (--sft): Mamba
                layers get their segment ids (conv and scan restart per segment), attention
                layers attend within each segment, RoPE positions restart per segment. Under
                context parallelism: this rank's share of the per-sequence split
                (get_thd_batch_on_this_cp_rank), which the Mamba layers reorder by.
            seq_idx: [b, s] document ids for the Mamba layers (instead of packed_seq_params);
                under context parallelism [b, s/cp], this rank's slice of the global ids.

        Returns:
            Last stage: the loss [b, s] with labels, else logits [b, s, v/p]. Other stages:
            hidden states [s, b, H].
        """
        if decoder_input is None and self.pre_process:
            decoder_input = self._embed(input_ids, position_ids, inference_params)
        # Otherwise: a precomputed embedding, or None on later stages (set_input_tensor).

        if packed_seq_params is not None and self._mamba_under_cp():
            # The mixers reorder by the segment offsets of the per-sequence split and restart
            # at the segments of the whole sequence (MambaMixer.forward).
            if seq_idx is not None:
                raise ValueError(
                    "seq_idx with packed_seq_params under context_parallel_size > 1: the Mamba "
                    "layers take the documents from packed_seq_params (give one)"
                )
            b, s = self._stage_shape(input_ids, decoder_input)
            check_packed_offsets(packed_seq_params.segment_offsets(), b, s)
        elif seq_idx is None and packed_seq_params is not None:
            # Every stage's Mamba layers restart at the segment starts.
            seq_idx = seq_idx_from_packed(
                packed_seq_params, *self._stage_shape(input_ids, decoder_input)
            )

        rotary_pos_emb = self._rotary_angles(inference_params, decoder_input, packed_seq_params)
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            seq_idx=seq_idx,
            rotary_pos_emb=rotary_pos_emb,
            attention_mask=attention_mask,
            inference_params=inference_params,
            packed_seq_params=packed_seq_params,
        )
        if not self.post_process:
            return hidden_states
        if inference_params is not None and inference_params.is_dynamic_batching():
            # The dynamic engine's packed requests: logits only where it samples or scores.
            hidden_states = inference_params.select_logit_positions(hidden_states)
        elif (
            inference_params is not None
            and labels is None
            and getattr(inference_params, 'materialize_only_last_token_logits', False)
        ):
            hidden_states = hidden_states[-1:]  # [s, b, H] -> [1, b, H]
        return self.logits_or_loss(self.output_logits(hidden_states), labels)
