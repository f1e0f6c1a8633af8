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
        self.add_position_embedding = position_embedding_type == 'learned_absolute'
        self.num_tokentypes = num_tokentypes

        self.word_embeddings = tensor_parallel.VocabParallelEmbedding(
            num_embeddings=self.vocab_size,
            embedding_dim=self.config.hidden_size,
            init_method=self.config.init_method,
            config=self.config,
            tp_group=self.pg_collection.tp,
        )

        if self.add_position_embedding:
            self.position_embeddings = torch.nn.Embedding(
                self.max_sequence_length,
                self.config.hidden_size,
                device=get_current_device(),
                dtype=self.config.params_dtype,
            )
            if self.config.perform_initialization:
                self.config.init_method(self.position_embeddings.weight)

        if self.num_tokentypes > 0:
            self.tokentype_embeddings = torch.nn.Embedding(
                self.num_tokentypes,
                self.config.hidden_size,
                device=get_current_device(),
                dtype=self.config.params_dtype,
            )
            if self.config.perform_initialization:
                self.config.init_method(self.tokentype_embeddings.weight)
        else:
            self.tokentype_embeddings = None

        self.embedding_dropout = torch.nn.Dropout(self.config.hidden_dropout)

    def zero_parameters(self):
        """Zero all embedding parameters (and mark them shared)."""
        self.word_embeddings.weight.data.fill_(0)
        self.word_embeddings.weight.shared = True
        if self.add_position_embedding:
            self.position_embeddings.weight.data.fill_(0)
            self.position_embeddings.weight.shared = True
        if self.num_tokentypes > 0:
            self.tokentype_embeddings.weight.data.fill_(0)
            self.tokentype_embeddings.weight.shared = True

    def forward(
        self,
        input_ids: Tensor,
        position_ids: Optional[Tensor] = None,
        tokentype_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """input_ids [b, s] (and position_ids [b, s], default 0..s-1) -> [s, b, h]
        ([s/p, b, h] under sequence parallelism)."""
        word_embeddings = self.word_embeddings(input_ids)  # [b, s, h]
        if self.add_position_embedding:
            if position_ids is None:
                position_ids = torch.arange(input_ids.size(1), device=input_ids.device).unsqueeze(0)
            position_embeddings = self.position_embeddings(position_ids)
            embeddings = word_embeddings + position_embeddings
        else:
            embeddings = word_embeddings

        # [b, s, h] -> [s, b, h]: the transformer works sequence-first.
        embeddings = embeddings.transpose(0, 1).contiguous()

        if tokentype_ids is not None:
            if self.tokentype_embeddings is None:
                raise ValueError("tokentype_ids given but the embedding has num_tokentypes == 0")
            # [b, s, h] -> [s, b, h]
            embeddings = embeddings + self.tokentype_embeddings(tokentype_ids).permute(1, 0, 2)
        elif self.tokentype_embeddings is not None:
            raise ValueError(
                f"num_tokentypes is {self.num_tokentypes} but no tokentype_ids were given"
            )

        if self.config.fp32_residual_connection:
            embeddings = embeddings.float()

        if self.config.sequence_parallel:
            # [s, b, h] -> [s/p, b, h]
            embeddings = tensor_parallel.scatter_to_sequence_parallel_region(
                embeddings, group=self.pg_collection.tp
            )
            # The scatter output is a view of the full embeddings: clone it so that the full
            # tensor can be freed.
            if self.config.clone_scatter_output_in_embedding:
                embeddings = embeddings.clone()
            # Each TP rank holds a different slice of the sequence: use the model-parallel RNG.
            with tensor_parallel.get_cuda_rng_tracker().fork():
                embeddings = self.embedding_dropout(embeddings)
        else:
            embeddings = self.embedding_dropout(embeddings)

        return embeddings
