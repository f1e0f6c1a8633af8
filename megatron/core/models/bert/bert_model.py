"""BertModel: embedding (+ token types) -> pre-LN TransformerBlock -> masked-LM head and output
layer, plus the pooler and binary (sentence-order) head, as megatron-core builds BERT.

Notation: b batch, s sequence, h hidden size, v padded vocabulary, p tensor-parallel size.
"""

from typing import Literal, Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.bert.bert_lm_head import BertLMHead
from megatron.core.models.bert.pooler import Pooler
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import get_linear_layer


def bert_extended_attention_mask(attention_mask: Tensor) -> Tensor:
    """Padding mask [b, s] (1 = real token, 0 = pad) -> bool [b, 1, s, s], True = masked out.

    A (query, key) pair is visible only when both are real tokens, so the rows of pad queries are
    fully masked too (their scores are all filled with the same value; their outputs are unused).
    """
    attention_mask_b1s = attention_mask.unsqueeze(1)  # [b, 1, s]
    attention_mask_bs1 = attention_mask.unsqueeze(2)  # [b, s, 1]
    attention_mask_bss = attention_mask_b1s * attention_mask_bs1  # [b, s, s]
    extended_attention_mask = attention_mask_bss.unsqueeze(1)  # [b, 1, s, s]
    return extended_attention_mask < 0.5


def bert_position_ids(token_ids: Tensor) -> Tensor:
    """Positions 0..s-1 for every row of token_ids [b, s]."""
    seq_length = token_ids.size(1)
    position_ids = torch.arange(seq_length, dtype=torch.long, device=token_ids.device)
    return position_ids.unsqueeze(0).expand_as(token_ids)  # [b, s]


class BertModel(LanguageModule):
    """BERT with megatron-core's layout: no LayerNorm after the embeddings, pre-LN layers, a final
    LayerNorm, then the LM head transform and a tied (by default) output layer with a bias.

    The output layer is a ColumnParallelLinear [h -> v] split along v with a bias split the same
    way: each rank produces v/p logits (no communication in forward, all-reduce of the input
    gradient in backward; `parallel_output=False` all-gathers the logits). With
    `share_embeddings_and_output_weights` it reads the word-embedding table (same stage) or a copy
    kept in sync over the embedding group (last stage when pp > 1). The pooler and the binary head
    ([b, 2] logits, class 1 = "segments swapped") are replicated plain linear layers.

    Megatron also refuses to build BERT unless flash attention is disabled through the
    NVTE_* environment; there is no flash attention here, so no such check.

    Args:
        config (TransformerConfig): the model config.
        num_tokentypes (int): rows of the token-type table (2 with the binary head, 0 for none).
        transformer_layer_spec (ModuleSpec): the layer spec (e.g. bert_layer_local_spec).
        vocab_size (int): padded vocabulary size (a multiple of p).
        max_sequence_length (int): rows of the learned position table.
        pre_process (bool): this stage holds the embedding (first pipeline stage).
        post_process (bool): this stage holds the heads (last pipeline stage).
        fp16_lm_cross_entropy (bool): stored for API parity; BERT's loss is always computed on
            fp32 logits, as in megatron-core.
        parallel_output (bool): keep the logits split across the TP group.
        share_embeddings_and_output_weights (bool): tie word embeddings and output layer.
        position_embedding_type: 'learned_absolute' or 'rope'.
        rotary_percent (float): fraction of each head rotated by RoPE.
        seq_len_interpolation_factor (float, optional): RoPE position interpolation.
        add_binary_head (bool): add the pooler and the binary head.
        return_embeddings (bool): return mean-pooled sentence embeddings instead of logits.
        pg_collection (ProcessGroupCollection, optional): the groups of this model (tp splits
            every layer and gathers the sequence for the pooler, pp / embd tie the embedding and
            output weights); None fields fall back to the global groups.
    """

    # megatron-core's BERT ignores fp16_lm_cross_entropy: the loss is taken on fp32 logits.
    lm_loss_on_fp32_logits = True

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
        transformer_layer_spec: ModuleSpec,
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
        add_binary_head: bool = True,
        return_embeddings: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config, pg_collection=pg_collection)

        if vocab_size % config.tensor_model_parallel_size != 0:
            raise ValueError(
                f"vocab_size ({vocab_size}) must be a multiple of tensor_model_parallel_size "
                f"({config.tensor_model_parallel_size}); pad the vocabulary first."
            )
        if position_embedding_type not in ('learned_absolute', 'rope'):
            raise ValueError(
                "BertModel position_embedding_type must be 'learned_absolute' or 'rope', got "
                f"{position_embedding_type!r}"
            )
        if return_embeddings and not post_process:
            raise ValueError("return_embeddings=True needs post_process=True (the last stage)")

        self.config: TransformerConfig = config
        # The pipeline schedules pick their send/recv pattern from this.
        self.model_type = ModelType.encoder_or_decoder
        self.transformer_layer_spec: ModuleSpec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.num_tokentypes = num_tokentypes
        self.position_embedding_type = position_embedding_type
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.add_binary_head, self.return_embeddings = add_binary_head, return_embeddings

        # Build order fixes the draws from the init RNG: embedding, encoder, then the heads.
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config=config,
                pg_collection=self.pg_collection,
                vocab_size=vocab_size,
                num_tokentypes=num_tokentypes,
                position_embedding_type=position_embedding_type,
                max_sequence_length=max_sequence_length,
            )
        if position_embedding_type == 'rope':
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_interleaved=config.rotary_interleaved,
                rotary_percent=rotary_percent,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
            )
        self.encoder = TransformerBlock(
            config=config,
            spec=transformer_layer_spec,
            pg_collection=self.pg_collection,
            pre_process=pre_process,
            post_process=post_process,
        )
        self.binary_head = None
        if post_process:
            self._build_heads(config, pre_process and share_embeddings_and_output_weights)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def _build_heads(self, config: TransformerConfig, borrow_output_weight: bool) -> None:
        """LM head, output layer and (optionally) binary head + pooler of the last stage.

        The output layer is a ColumnParallelLinear [h -> v] split along v with its own bias of
        v/p per rank (backward all-reduces the input gradient over tp); with tied weights on a
        stage that also holds the embedding it allocates no weight and borrows the embedding's.
        """
        self.lm_head = BertLMHead(config.hidden_size, config)
        self.output_layer = tensor_parallel.ColumnParallelLinear(
            config.hidden_size,
            self.vocab_size,
            config=config,
            tp_group=self.pg_collection.tp,
            gather_output=not self.parallel_output,
            init_method=config.init_method,
            skip_weight_param_allocation=borrow_output_weight,
            bias=True,
            skip_bias_add=False,
        )
        if not self.add_binary_head:
            return
        # Next-sentence classifier [h -> 2], then the pooler over the first token.
        self.binary_head = get_linear_layer(
            config.hidden_size, 2, config.init_method, config.perform_initialization
        )
        self.pooler = Pooler(
            config.hidden_size,
            config.init_method,
            config,
            config.sequence_parallel,
            tp_group=self.pg_collection.tp,
        )

    def set_input_tensor(self, input_tensor) -> None:
        """Set the input of this pipeline stage (the previous stage's output [s, b, h]).

        The schedule passes a list with one tensor (or a tensor).
        """
        if not isinstance(input_tensor, list):
            input_tensor = [input_tensor]
        assert len(input_tensor) == 1, 'input_tensor should only be length 1 for bert'
        self.encoder.set_input_tensor(input_tensor[0])

    def _rope_table(self, inference_params, encoder_input) -> Optional[Tensor]:
        """Rotary frequencies for this pass, or None with learned absolute positions."""
        if self.position_embedding_type != 'rope':
            return None
        length = self.rotary_pos_emb.get_rotary_seq_len(
            inference_params, self.encoder, encoder_input, self.config
        )
        return self.rotary_pos_emb(length)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor,
        tokentype_ids: Optional[Tensor] = None,
        lm_labels: Optional[Tensor] = None,
        inference_params=None,
    ):
        """Run this stage.

        Args:
            input_ids: [b, s] token ids (read on the first stage).
            attention_mask: [b, s] padding mask, 1 = real token, 0 = pad (every stage).
            tokentype_ids: [b, s] segment ids (0/1); required iff num_tokentypes > 0.
            lm_labels: [b, s] masked-LM targets; when given the per-token loss is returned.
            inference_params: KV cache (not supported).

        Returns:
            Not the last stage: hidden states [s, b, h] ([s/p, b, h] under sequence parallelism).
            Last stage: (logits [b, s, v/p], binary_logits [b, 2] or None) without labels,
            (loss [b, s] fp32, binary_logits) with labels; with return_embeddings, the
            mean-pooled embeddings [b, h] (fp32).
        """
        extended_attention_mask = bert_extended_attention_mask(attention_mask)

        # Later stages take their input from set_input_tensor, so they embed nothing.
        encoder_input = (
            self.embedding(
                input_ids=input_ids,
                tokentype_ids=tokentype_ids,
                position_ids=bert_position_ids(input_ids),
            )
            if self.pre_process
            else None
        )
        hidden_states = self.encoder(
            hidden_states=encoder_input,
            rotary_pos_emb=self._rope_table(inference_params, encoder_input),
            attention_mask=extended_attention_mask,
            inference_params=inference_params,
        )
        if not self.post_process:
            return hidden_states

        if self.return_embeddings:
            return self._mean_pooled_embeddings(hidden_states, attention_mask)

        pooled_output = None
        if self.add_binary_head:
            pooled_output = self.pooler(hidden_states, 0)

        # [s, b, h] -> [s, b, v/p]
        logits = self.output_logits(self.lm_head(hidden_states=hidden_states))

        binary_logits = None
        if self.binary_head is not None:
            binary_logits = self.binary_head(pooled_output)  # [b, 2]

        return self.logits_or_loss(logits, lm_labels), binary_logits

    def _mean_pooled_embeddings(self, hidden_states: Tensor, attention_mask: Tensor) -> Tensor:
        """Per sample, the mean of the final hidden states over positions 1 .. n-2 (dropping
        [CLS] and the last [SEP]; n = number of real tokens) -> [b, h] fp32."""
        if self.config.sequence_parallel:
            # [s/p, b, h] -> [s, b, h]
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False, group=self.pg_collection.tp
            )
        embeddings = hidden_states.transpose(0, 1)  # [s, b, h] -> [b, s, h]
        lengths = attention_mask.sum(dim=1)  # [b]
        output = torch.zeros(
            embeddings.shape[0], embeddings.shape[2], dtype=torch.float32, device=embeddings.device
        )
        for i, (embedding, length) in enumerate(zip(embeddings, lengths)):
            output[i, :] = torch.mean(embedding[1 : int(length) - 1].float(), dim=0)
        return output
