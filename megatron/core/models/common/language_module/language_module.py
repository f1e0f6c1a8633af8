"""Base class of language models: the output layer and loss tail, and the tying of input
embedding and output layer."""

import logging
from typing import Optional

import torch
from torch import Tensor

from megatron.core import parallel_state, tensor_parallel
from megatron.core.process_groups_config import ProcessGroupCollection, resolve_process_groups
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig

logger = logging.getLogger(__name__)


class LanguageModule(MegatronModule):
    """Base language module: the output layer and loss tail, and tied embeddings.

    Subclasses set `pre_process`, `post_process`, `share_embeddings_and_output_weights`,
    `embedding` (first stage) and `output_layer` (last stage), then call
    `setup_embeddings_and_output_layer()`. Their last stage ends with
    `self.logits_or_loss(self.output_logits(hidden_states), labels)`, after what differs
    (BERT's LM-head transform, T5's head with its bias, GPT's inference logit positions).

    Args:
        config (TransformerConfig): the model config.
        pg_collection (ProcessGroupCollection, optional): `tp` (loss over the vocabulary
            split), `pp` (stage count) and `embd` (tied weights) groups; None fields fall back
            to the global groups. Stored resolved as `self.pg_collection` for subclasses.
    """

    #: Take the loss on fp32 logits even with `fp16_lm_cross_entropy` (megatron-core's BERT).
    lm_loss_on_fp32_logits: bool = False

    def __init__(
        self, config: TransformerConfig, pg_collection: Optional[ProcessGroupCollection] = None
    ) -> None:
        super().__init__(config=config)
        self.pg_collection = resolve_process_groups(pg_collection, ("tp", "pp", "embd"))

    def output_logits(self, hidden_states: Tensor) -> Tensor:
        """The output layer's logits, reading the shared word-embedding table when tied.

        Args:
            hidden_states: [s, b, h] final hidden states (after any head transform).

        Returns:
            [s, b, v/p] vocab-parallel logits ([s, b, v] when the output layer gathers them).
        """
        logits, _ = self.output_layer(hidden_states, weight=self.tied_output_weight())
        return logits

    def tied_output_weight(self) -> Optional[Tensor]:
        """The weight the output layer reads instead of its own: the shared word-embedding table
        (or this last stage's synchronised copy) when tied, else None."""
        if not self.share_embeddings_and_output_weights:
            return None
        return self.shared_embedding_or_output_weight()

    def logits_or_loss(self, logits: Tensor, labels: Optional[Tensor]) -> Tensor:
        """The last stage's output: the logits batch-first without labels, else the loss.

        Args:
            logits: [s, b, v/p] from `output_logits`.
            labels: [b, s] target ids, or None.

        Returns:
            logits [b, s, v/p] when labels is None, else the per-token loss [b, s]
            (`compute_language_model_loss`).
        """
        if labels is None:
            # [s, b, v/p] -> [b, s, v/p]
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(labels, logits)

    def compute_language_model_loss(self, labels: Tensor, logits: Tensor) -> Tensor:
        """Per-token cross entropy.

        Args:
            labels: [b, s] target ids.
            logits: [s, b, v/p] vocab-parallel logits (split across the TP group).

        Returns:
            [b, s] loss (fp32 unless fp16_lm_cross_entropy keeps the logits in 16 bits). fp32
            `logits` are overwritten (with their softmax), as in Megatron: the models pass logits
            that nothing else reads.
        """
        # [b, s] -> [s, b]
        labels = labels.transpose(0, 1).contiguous()
        if self.lm_loss_on_fp32_logits or not getattr(self, 'fp16_lm_cross_entropy', False):
            logits = logits.float()
        # Softmax statistics are all-reduced across the TP group inside.
        loss = tensor_parallel.vocab_parallel_cross_entropy(
            logits, labels, group=self.pg_collection.tp, inplace=True
        )
        # [s, b] -> [b, s]
        loss = loss.transpose(0, 1).contiguous()
        return loss

    def setup_embeddings_and_output_layer(self) -> None:
        """Tag embedding/output parameters and tie them across pipeline stages.

        With shared embeddings and more than one pipeline stage, the first stage owns the word
        embedding and the last stage holds a separate `output_layer.weight`: it is zero-filled
        and all-reduced over the embedding group (first and last stage) so it starts equal to
        the first stage's table; `finalize_model_grads` keeps the two in sync by all-reducing
        their gradients over the same group. Both copies are marked `shared_embedding = True`.
        """
        self._tag_embedding_and_output_weights()
        if not self.ties_word_embedding_across_stages():
            return
        if self.pg_collection.pp.size() == 1:
            # One stage holds both ends: the output layer reads the embedding weight directly.
            if self.share_embeddings_and_output_weights:
                self.shared_embedding_or_output_weight().zero_out_wgrad = True
            return
        if getattr(self, 'mtp_process', False) and self.share_embeddings_and_output_weights:
            # The last stage's copy is also its MTP embedding table: a second use of the weight
            # in the graph, whose gradient autograd must keep (see zero_out_wgrad above).
            self.shared_embedding_or_output_weight().zero_out_wgrad = True
        self._mark_tied_copies()
        self._synchronise_tied_copies()

    def ties_word_embedding_across_stages(self) -> bool:
        """Whether the first and last pipeline stages each hold a copy of the word embedding
        that must stay equal: tied output weights, or multi-token prediction, whose last stage
        embeds the rolled ids with its own copy when the output layer is untied."""
        return bool(
            self.share_embeddings_and_output_weights or getattr(self.config, 'mtp_num_layers', None)
        )

    def _tag_embedding_and_output_weights(self) -> None:
        """Flag the vocabulary-sized weights this stage holds (the optimizer setup reads it)."""
        tagged = []
        if self.pre_process:
            tagged.append(self.embedding.word_embeddings.weight)
        if self.post_process and self.output_layer.weight is not None:
            tagged.append(self.output_layer.weight)
        if getattr(self, 'mtp_process', False) and not self.pre_process:
            tagged.append(self.embedding.word_embeddings.weight)
        for weight in tagged:
            weight.is_embedding_or_output_parameter = True

    def _mark_tied_copies(self) -> None:
        """With pp > 1 the first stage's table and the last stage's own copy of it are the two
        halves of one tied weight; the copy starts at zero so that the all-reduce that follows
        leaves it equal to the table."""
        if parallel_state.is_pipeline_first_stage() and self.pre_process and not self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
        if not self.post_process or self.pre_process:
            return
        assert not parallel_state.is_pipeline_first_stage()
        copy = self.shared_embedding_or_output_weight()
        copy.data.fill_(0)
        copy.shared = True
        copy.shared_embedding = True

    def _synchronise_tied_copies(self) -> None:
        """Sum the two copies over the embedding group (first and last stage): the zeroed copy
        takes the table's values. Their gradients are summed over the same group each step
        (finalize_model_grads), so they stay equal."""
        if not torch.distributed.is_initialized():
            if not getattr(LanguageModule, "embedding_warning_printed", False):
                logger.warning(
                    "Distributed processes aren't initialized, so the output layer is not "
                    "initialized with weights from the word embeddings. If you are just "
                    "manipulating a model this is fine, but this needs to be handled manually. "
                    "If you are training something is definitely wrong."
                )
                LanguageModule.embedding_warning_printed = True
            return
        # Only a chunk holding an end of the model joins (virtual pipeline: not the middle ones).
        if self.pg_collection.embd is None or not (self.pre_process or self.post_process):
            return
        weight = self.shared_embedding_or_output_weight()
        torch.distributed.all_reduce(weight.data, group=self.pg_collection.embd)

    def sharded_state_dict(self, prefix: str = '', sharded_offsets: tuple = (), metadata=None):
        """Distributed checkpoint with the output layer tied as Megatron stores it.

        Tied weights: a stage holding both ends stores only the embedding; a last stage without
        the embedding stores its copy under `embedding.word_embeddings.weight` as a non-main
        replica (replica id (1, 0, dp)): it is never written and is read from the first
        stage's table. Vocabulary-sized tensors allow another padded vocabulary on load.
        """
        assert not sharded_offsets, 'Unexpected sharded offsets'
        sharded_state_dict = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        self._tie_output_layer_sharded_state_dict(sharded_state_dict, prefix)
        return sharded_state_dict

    def _tie_output_layer_sharded_state_dict(self, sharded_state_dict, prefix: str) -> None:
        from megatron.core.dist_checkpointing.utils import make_tp_sharded_tensor_for_checkpoint

        weight_key = f'{prefix}output_layer.weight'
        bias_key = f'{prefix}output_layer.bias'
        if not self.post_process:
            return
        self._mtp_embedding_as_replica(sharded_state_dict, prefix)
        if bias_key in sharded_state_dict:
            sharded_state_dict[bias_key].allow_shape_mismatch = True
        if not self.share_embeddings_and_output_weights:
            if weight_key in sharded_state_dict:
                sharded_state_dict[weight_key].allow_shape_mismatch = True
            return
        if self.pre_process:
            sharded_state_dict.pop(weight_key, None)  # the embedding is stored already
            return
        if weight_key not in sharded_state_dict:  # a last stage without the head (T5 encoder)
            return
        tensor = sharded_state_dict.pop(weight_key).data
        sharded_state_dict[weight_key] = make_tp_sharded_tensor_for_checkpoint(
            tensor,
            f'{prefix}embedding.word_embeddings.weight',
            replica_id=(1, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True)),
            allow_shape_mismatch=True,
        )

    def _mtp_embedding_as_replica(self, sharded_state_dict, prefix: str) -> None:
        """A last stage's MTP copy of the word embedding is never written: tied, it is the
        output layer's weight (stored below as a replica); untied, it becomes a non-main replica
        of the first stage's table (replica id (1, 0, dp)), read from it on load."""
        key = f'{prefix}embedding.word_embeddings.weight'
        if self.pre_process or not getattr(self, 'mtp_process', False):
            return
        entry = sharded_state_dict.pop(key, None)
        if entry is None or self.share_embeddings_and_output_weights:
            return
        from megatron.core.dist_checkpointing.utils import make_tp_sharded_tensor_for_checkpoint

        sharded_state_dict[key] = make_tp_sharded_tensor_for_checkpoint(
            entry.data,
            key,
            replica_id=(1, 0, parallel_state.get_data_parallel_rank(with_context_parallel=True)),
            allow_shape_mismatch=True,
        )

    def shared_embedding_or_output_weight(self) -> Tensor:
        """The word-embedding weight on the first stage, the output-layer weight on the last
        stage without embedding, else None."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        elif self.post_process:
            if getattr(self, 'mtp_process', False) and not self.share_embeddings_and_output_weights:
                # Untied: the copy kept equal to the first stage's is the MTP embedding's table.
                return self.embedding.word_embeddings.weight
            return self.output_layer.weight
        return None
