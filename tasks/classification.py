"""BERT with a classification or multiple-choice head for fine-tuning.

Megatron has these heads only as legacy models (megatron/legacy/model/classification.py and
multiple_choice.py); megatron-core has none, so they live here, on the core BertModel: the same
embedding, encoder and pooler (so a pretrained BERT checkpoint loads into them by name), with the
masked-LM head and the sentence-order head replaced by dropout + Linear(h, n).
"""

import torch

from megatron.core.models.bert.bert_model import (
    BertModel,
    bert_extended_attention_mask,
    bert_position_ids,
)
from megatron.core.transformer.utils import get_linear_layer

#: Checkpoint keys of the heads, as in Megatron.
CLASSIFICATION_HEAD = 'classification_head'
MULTICHOICE_HEAD = 'multichoice_head'


class BertWithHead(BertModel):
    """BertModel whose last stage ends in pooler -> dropout -> Linear(h, num_outputs).

    The head's Linear is replicated on every tensor-parallel rank (like the pooler); its weight
    uses the config's init method and its bias starts at zero. No collective beyond the encoder's.

    Args:
        config, transformer_layer_spec, vocab_size, max_sequence_length, pre_process,
            post_process: as for BertModel (2 token types, learned positions).
        num_outputs (int): classes (classification) or 1 (multiple choice).
        head_name (str): CLASSIFICATION_HEAD or MULTICHOICE_HEAD.
    """

    def __init__(
        self,
        config,
        transformer_layer_spec,
        vocab_size,
        max_sequence_length,
        num_outputs,
        head_name,
        pre_process=True,
        post_process=True,
    ):
        super().__init__(
            config=config,
            num_tokentypes=2,
            transformer_layer_spec=transformer_layer_spec,
            vocab_size=vocab_size,
            max_sequence_length=max_sequence_length,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            add_binary_head=True,
        )
        self.num_outputs = num_outputs
        self.head_name = head_name
        if self.post_process:
            del self.lm_head
            del self.output_layer
            self.binary_head = None
            self.head_dropout = torch.nn.Dropout(config.hidden_dropout)
            setattr(
                self,
                head_name,
                get_linear_layer(
                    config.hidden_size,
                    num_outputs,
                    config.init_method,
                    config.perform_initialization,
                ),
            )

    def forward(self, input_ids, attention_mask, tokentype_ids=None):
        """input_ids/attention_mask/tokentype_ids [b, s] -> logits [b, num_outputs] (last stage),
        hidden states [s, b, h] elsewhere."""
        extended_attention_mask = bert_extended_attention_mask(attention_mask)
        encoder_input = None
        if self.pre_process:
            encoder_input = self.embedding(
                input_ids=input_ids,
                position_ids=bert_position_ids(input_ids),
                tokentype_ids=tokentype_ids,
            )
        hidden_states = self.encoder(
            hidden_states=encoder_input, attention_mask=extended_attention_mask
        )
        if not self.post_process:
            return hidden_states
        pooled_output = self.pooler(hidden_states, 0)  # [b, h]
        pooled_output = self.head_dropout(pooled_output)
        return getattr(self, self.head_name)(pooled_output)  # [b, n]


class Classification(BertWithHead):
    """BERT + pooler + Linear(h, num_classes): logits [b, num_classes]."""

    def __init__(
        self,
        config,
        transformer_layer_spec,
        vocab_size,
        max_sequence_length,
        num_classes,
        pre_process=True,
        post_process=True,
    ):
        super().__init__(
            config,
            transformer_layer_spec,
            vocab_size,
            max_sequence_length,
            num_classes,
            CLASSIFICATION_HEAD,
            pre_process,
            post_process,
        )


class MultipleChoice(BertWithHead):
    """BERT + pooler + Linear(h, 1) over each choice: [b, k, s] inputs -> logits [b, k]."""

    def __init__(
        self,
        config,
        transformer_layer_spec,
        vocab_size,
        max_sequence_length,
        pre_process=True,
        post_process=True,
    ):
        super().__init__(
            config,
            transformer_layer_spec,
            vocab_size,
            max_sequence_length,
            1,
            MULTICHOICE_HEAD,
            pre_process,
            post_process,
        )

    def forward(self, input_ids, attention_mask, tokentype_ids=None):
        num_choices = attention_mask.shape[1]
        # [b, k, s] -> [b * k, s]
        attention_mask = attention_mask.reshape(-1, attention_mask.shape[-1])
        if input_ids is not None:
            input_ids = input_ids.reshape(-1, input_ids.shape[-1])
        if tokentype_ids is not None:
            tokentype_ids = tokentype_ids.reshape(-1, tokentype_ids.shape[-1])
        output = super().forward(input_ids, attention_mask, tokentype_ids)
        if not self.post_process:
            return output
        return output.view(-1, num_choices)  # [b * k, 1] -> [b, k]
