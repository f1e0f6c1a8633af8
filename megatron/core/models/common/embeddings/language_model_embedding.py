"""Word (+ learned position, + token type) embeddings of a language model's first stage.

Notation: b batch, s sequence, h hidden size, v vocabulary, p tensor-parallel size.
"""

from typing import Literal, Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


class LanguageModelEmbedding(MegatronModule):
    """Embedding of token ids into [s, b, h] (or [s/p, b, h] under sequence parallelism).

    The word embedding is a VocabParallelEmbedding: the table [v, h] is split along v across the
    TP group, each rank looks up the ids in its range and the partial results are all-reduced
    (or reduce-scattered along s when the embedding does the sequence-parallel scatter itself).
    Learned position embeddings [max_sequence_length, h] are replicated.

    Args:
        config (TransformerConfig): the model config.
        vocab_size (int): vocabulary size (padded to a multiple of the TP size).
        max_sequence_length (int): number of learned positions.
        position_embedding_type: 'learned_absolute', 'rope' or 'none' (the last two add no
            position embedding here).
        num_tokentypes (int): token type embeddings (BERT); 0 for none.
        pg_collection (ProcessGroupCollection, optional): its `tp` group splits the vocabulary
            (default: the global tensor model parallel group).
    """

    def __init__(
        self,
        config: TransformerConfig,
        vocab_size: int,
        max_sequence_length: int,
        position_embedding_type: Literal['learned_absolute', 'rope', 'none'] = 'learned_absolute',
        num_tokentypes: int = 0,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ):
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp",))
        if position_embedding_type not in ('learned_absolute', 'rope', 'none'):
            raise ValueError(
                "position_embedding_type must be 'learned_absolute', 'rope' or 'none', got "
                f"{position_embedding_type!r}"
            )
        self.config = config
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        # 'rope' and 'none' leave positions to the attention layers (or to nobody).
        self.add_position_embedding = position_embedding_type == 'learned_absolute'
        self.num_tokentypes = num_tokentypes

        # Built in this order, which is the order of their weight-init draws.
        # [v, h] split along v: [v/p, h] per rank.
        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            self.vocab_size,
            self.config.hidden_size,
            config=self.config,
            init_method=self.config.init_method,
            tp_group=self.pg_collection.tp,
        )
        if self.add_position_embedding:
            self.position_embeddings = self._replicated_table(self.max_sequence_length)
        self.tokentype_embeddings = None
        if self.num_tokentypes > 0:
            self.tokentype_embeddings = self._replicated_table(self.num_tokentypes)

        self.embedding_dropout = torch.nn.Dropout(self.config.hidden_dropout)

    def _replicated_table(self, rows: int) -> torch.nn.Embedding:
        """A [rows, h] table held whole on every TP rank, drawn from config.init_method."""
        table = torch.nn.Embedding(
            rows,
            self.config.hidden_size,
            dtype=self.config.params_dtype,
            device=get_current_device(),
        )
        if self.config.perform_initialization:
            self.config.init_method(table.weight)
        return table

    def _tables(self):
        """The embedding tables this module holds."""
        tables = [self.word_embeddings]
        if self.add_position_embedding:
            tables.append(self.position_embeddings)
        if self.num_tokentypes > 0:
            tables.append(self.tokentype_embeddings)
        return tables

    def zero_parameters(self):
        """Zero all embedding parameters (and mark them shared)."""
        for table in self._tables():
            table.weight.data.fill_(0)
            table.weight.shared = True

    def _add_tokentypes(self, embeddings: Tensor, tokentype_ids: Optional[Tensor]) -> Tensor:
        """Add the token-type embedding; ids must be given exactly when the module has types."""
        if tokentype_ids is None:
            if self.tokentype_embeddings is not None:
                raise ValueError(
                    f"num_tokentypes is {self.num_tokentypes} but no tokentype_ids were given"
                )
            return embeddings
        if self.tokentype_embeddings is None:
            raise ValueError("tokentype_ids given but the embedding has num_tokentypes == 0")
        # [b, s, h] -> [s, b, h]
        return embeddings + self.tokentype_embeddings(tokentype_ids).permute(1, 0, 2)

    def _dropout(self, embeddings: Tensor) -> Tensor:
        """Embedding dropout; under sequence parallelism first scatter [s, b, h] -> [s/p, b, h]."""
        if not self.config.sequence_parallel:
            return self.embedding_dropout(embeddings)
        local = tensor_parallel.scatter_to_sequence_parallel_region(
            embeddings, group=self.pg_collection.tp
        )
        # The scattered slice is a view of the whole tensor; a copy lets the whole one be freed.
        if self.config.clone_scatter_output_in_embedding:
            local = local.clone()
        # The ranks hold different positions, so their masks come from the model-parallel RNG.
        with tensor_parallel.get_cuda_rng_tracker().fork():
            return self.embedding_dropout(local)

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor] = None,
        tokentype_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """input_ids [b, s] (and position_ids [b, s], default 0..s-1) -> [s, b, h]
        ([s/p, b, h] under sequence parallelism)."""
        embeddings = self.word_embeddings(input_ids)  # [b, s, h]
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device)[None]
            embeddings = embeddings + self.position_embeddings(position_ids)
        # The transformer works sequence-first: [b, s, h] -> [s, b, h]
        embeddings = self._add_tokentypes(embeddings.transpose(0, 1).contiguous(), tokentype_ids)
        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()
        return self._dropout(embeddings)
