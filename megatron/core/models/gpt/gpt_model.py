"""GPTModel: embedding (first stage) -> TransformerBlock -> output layer and loss (last stage).

Notation: b batch, s sequence, h hidden size, v padded vocabulary, p tensor-parallel size.
"""

from typing import Dict, Literal, Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(LanguageModule):
    """Decoder-only transformer language model.

    The output layer is a ColumnParallelLinear [h -> v] split along v: each rank produces v/p
    logits (no communication in forward, all-reduce of the input gradient in backward), unless
    `parallel_output=False` gathers them. With `share_embeddings_and_output_weights` the output
    layer reuses the word-embedding table (on the same stage) or a synchronised copy of it (on
    the last stage when pp > 1, see LanguageModule.setup_embeddings_and_output_layer).

    Args:
        config (TransformerConfig): the model config.
        transformer_layer_spec (ModuleSpec): the layer spec (e.g. get_gpt_layer_local_spec()).
        vocab_size (int): padded vocabulary size.
        max_sequence_length (int): maximum sequence length (learned position embeddings).
        pre_process (bool): this stage holds the embedding (first pipeline stage).
        post_process (bool): this stage holds the output layer (last pipeline stage).
        fp16_lm_cross_entropy (bool): compute the cross entropy on 16-bit logits.
        parallel_output (bool): keep the logits split across the TP group.
        share_embeddings_and_output_weights (bool): tie input embedding and output layer.
        position_embedding_type: 'learned_absolute', 'rope' or 'none'.
        rotary_percent (float): fraction of each head rotated by RoPE.
        rotary_base (int): RoPE base.
        seq_len_interpolation_factor (float, optional): RoPE position interpolation.
        rope_scaling (bool): Llama-3.1 frequency scaling of RoPE (later Megatron's name).
        rope_scaling_factor (float): its factor.
        pg_collection (ProcessGroupCollection, optional): the groups of this model (tp splits
            every layer, pp / embd tie the embedding and output weights); None fields fall back
            to the global groups.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: Literal['learned_absolute', 'rope', 'none'] = 'learned_absolute',
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        seq_len_interpolation_factor: Optional[float] = None,
        pg_collection: Optional[ProcessGroupCollection] = None,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
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

        # Constructor options kept as attributes: the schedules, checkpoint converters and
        # exporters read them under these names.
        self.transformer_layer_spec: ModuleSpec = transformer_layer_spec
        options = {
            'vocab_size': vocab_size,
            'max_sequence_length': max_sequence_length,
            'pre_process': pre_process,
            'post_process': post_process,
            'fp16_lm_cross_entropy': fp16_lm_cross_entropy,
            'parallel_output': parallel_output,
            'share_embeddings_and_output_weights': share_embeddings_and_output_weights,
            'position_embedding_type': position_embedding_type,
            # Names TensorRT-LLM export expects.
            'max_position_embeddings': max_sequence_length,
            'rotary_percent': rotary_percent,
        }
        for name, value in options.items():
            setattr(self, name, value)
        # The pipeline schedules pick their communication pattern from the model type.
        self.model_type = ModelType.encoder_or_decoder

        # The stage that runs multi-token prediction (the last) embeds the rolled ids itself:
        # with pipeline parallelism it holds its own copy of the word embedding (Megatron's
        # `mtp_process`), kept equal to the first stage's over the embedding group.
        self.mtp_process = bool(self.post_process and config.mtp_num_layers)

        # Submodules in the order of their weight-init draws: embedding, decoder, output layer.
        if self.pre_process or self.mtp_process:
            self.embedding = LanguageModelEmbedding(
                self.config,
                vocab_size,
                max_sequence_length,
                position_embedding_type,
                pg_collection=self.pg_collection,
            )

        # Multi-latent attention rotates its decoupled part itself (YaRN included).
        self.use_gpt_rotary = position_embedding_type == 'rope' and not getattr(
            config, 'multi_latent_attention', False
        )
        if self.use_gpt_rotary:
            rope_options = {
                'rotary_interleaved': self.config.rotary_interleaved,
                'seq_len_interpolation_factor': seq_len_interpolation_factor,
                'rotary_base': rotary_base,
                'rope_scaling': rope_scaling,
                'rope_scaling_factor': rope_scaling_factor,
            }
            self.rotary_pos_emb = RotaryEmbedding(
                self.config.kv_channels,
                rotary_percent,
                cp_group=self.pg_collection.cp,
                **rope_options,
            )

        self.decoder = TransformerBlock(
            config=self.config,
            spec=transformer_layer_spec,
            pre_process=self.pre_process,
            post_process=self.post_process,
            pg_collection=self.pg_collection,
        )

        if self.post_process:
            # [s, b, h] -> [s, b, v/p]. With tied weights on the embedding stage the layer owns
            # no weight: forward borrows the word-embedding table.
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

        self.mtp = None
        if self.post_process and config.mtp_num_layers:
            from megatron.core.transformer.multi_token_prediction import (
                MultiTokenPredictionBlock,
            )

            # The MTP layers take the last decoder layer's spec.
            layer_spec = getattr(transformer_layer_spec, 'layer_specs', None)
            layer_spec = layer_spec[-1] if layer_spec else transformer_layer_spec
            self.mtp = MultiTokenPredictionBlock(config, layer_spec, self.pg_collection)
            if not self.pre_process and self.share_embeddings_and_output_weights:
                # Tied: the MTP embedding reads the last stage's copy of the table itself.
                del self.embedding.word_embeddings.weight
                self.embedding.word_embeddings.weight = self.output_layer.weight

        if self.pre_process or self.post_process:
            self.setup_embeddings_and_output_layer()

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint (see LanguageModule); the output layer's empty extra state is
        not stored, as in Megatron."""
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        extra = sharded_state_dict.pop(f'{prefix}output_layer._extra_state', None)
        assert extra is None or extra.data is None, 'output layer extra state is not empty'
        return sharded_state_dict

    def set_input_tensor(self, input_tensor) -> None:
        """Set the input of this pipeline stage (the previous stage's output [s, b, h]).

        The schedule passes a list with one tensor (or a tensor).
        """
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        assert len(input_tensor) == 1, 'input_tensor should only be length 1 for gpt'
        self.decoder.set_input_tensor(input_tensor[0])

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Tensor,
        attention_mask: Optional[Tensor],
        decoder_input: Tensor = None,
        labels: Tensor = None,
        inference_params=None,
        packed_seq_params: Optional[PackedSeqParams] = None,
        extra_block_kwargs: Optional[Dict] = None,
        loss_mask: Optional[Tensor] = None,
    ) -> Tensor:
        """Run this stage.

        Args:
            input_ids: [b, s] token ids (first stage).
            position_ids: [b, s] positions (learned_absolute; None = 0..s-1, or the positions
                after the cached ones with inference_params).
            attention_mask: bool [b, 1, s, s], True = masked out; None = causal.
            decoder_input: [s, b, h] precomputed embedding output (skips the embedding).
            labels: [b, s] targets; when given, the per-token loss is returned.
            inference_params (InferenceParams): KV cache for autoregressive inference: the
                tokens of this call follow the `sequence_len_offset` cached positions.
            packed_seq_params: packed sequences (PackedSeqParams over the batch-major b * s
                stream): each segment attends only to itself and its rotary positions restart
                at its start (learned absolute positions come from position_ids).
            extra_block_kwargs: extra keyword arguments for the TransformerBlock.
            loss_mask: [b, s] loss mask of the multi-token-prediction losses (None = every
                token); MTP runs only when labels are given.

        Returns:
            Last stage: the loss [b, s] (fp32) when labels are given, else logits [b, s, v/p]
            ([b, s, v] with parallel_output=False). Other stages: hidden states [s, b, h]
            ([s/p, b, h] under sequence parallelism).
        """
        if inference_params is not None and self.config.context_parallel_size > 1:
            raise ValueError(
                f"inference / text generation with context_parallel_size "
                f"({self.config.context_parallel_size}) > 1 is not supported; load the checkpoint "
                "with --context-parallel-size 1 (checkpoints do not depend on it)"
            )
        # Decoder embedding.
        if decoder_input is not None:
            pass
        elif self.pre_process:
            if position_ids is None and inference_params is not None:
                offset = inference_params.sequence_len_offset
                position_ids = torch.arange(
                    offset, offset + input_ids.size(1), device=input_ids.device
                ).unsqueeze(0)
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        else:
            # Intermediate stage of the pipeline: the decoder takes its input from
            # set_input_tensor.
            decoder_input = None

        # Rotary positional embeddings (embedding is None for PP intermediate devices).
        rotary_pos_emb = None
        if self.use_gpt_rotary:
            rotary_seq_len = self.rotary_pos_emb.get_rotary_seq_len(
                inference_params, self.decoder, decoder_input, self.config
            )
            if packed_seq_params is not None:
                rotary_pos_emb = self.rotary_pos_emb.packed_angles(
                    rotary_seq_len, packed_seq_params
                )
            else:
                rotary_pos_emb = self.rotary_pos_emb(rotary_seq_len)

        # Intermediate pipeline stages pass decoder_input=None: the block reads its input tensor.
        block_kwargs = dict(extra_block_kwargs or {})
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            rotary_pos_emb=rotary_pos_emb,
            attention_mask=attention_mask,
            inference_params=inference_params,
            packed_seq_params=packed_seq_params,
            **block_kwargs,
        )

        if not self.post_process:
            return hidden_states

        if self.mtp is not None and labels is not None:
            hidden_states = self.mtp(
                hidden_states,
                input_ids=input_ids,
                position_ids=position_ids,
                labels=labels,
                loss_mask=loss_mask,
                embedding=self.embedding,
                token_losses=lambda h, y: self.compute_language_model_loss(
                    y, self.output_logits(h)
                ),
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
                packed_seq_params=packed_seq_params,
            )
        hidden_states = _inference_logit_positions(hidden_states, inference_params, labels)
        return self.logits_or_loss(self.output_logits(hidden_states), labels)


def _inference_logit_positions(
    hidden_states: Tensor, inference_params, labels: Optional[Tensor]
) -> Tensor:
    """The positions of hidden_states [s, b, h] that inference needs logits of (all in training)."""
    if inference_params is not None and inference_params.is_dynamic_batching():
        # Packed requests: logits only where the engine samples or scores.
        return inference_params.select_logit_positions(hidden_states)
    if (
        inference_params is not None
        and getattr(inference_params, 'materialize_only_last_token_logits', False)
        and labels is None
    ):
        # Sampling needs the last position only: skip the output layer elsewhere.
        return hidden_states[-1:, :, :]  # [s, b, h] -> [1, b, h]
    return hidden_states
