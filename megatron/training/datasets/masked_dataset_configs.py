"""BERT and T5 dataset configs from the command line (the one place args become these configs).

Megatron's pretrain_bert.py / pretrain_t5.py build the same configs inline: random_seed=--seed,
the blend from --data-path (or --train/valid/test-data-path), --split, --data-cache-path,
masking probability --mask-prob, short-sequence probability --short-seq-prob, whole-word masking,
no permutation, and N-gram settings fixed per model (BERT: up to 3-grams weighted 1/N; T5: spans of
geometric length clipped at 10).
"""

from typing import Optional

from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.megatron_tokenizer import MegatronTokenizer
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list


def _common_fields(args, tokenizer: Optional[MegatronTokenizer]) -> dict:
    if tokenizer is None:
        from megatron.training.global_vars import get_tokenizer

        tokenizer = get_tokenizer()
    return dict(
        random_seed=args.seed,
        blend=get_blend_from_list(args.data_path),
        blend_per_split=[
            get_blend_from_list(args.train_data_path),
            get_blend_from_list(args.valid_data_path),
            get_blend_from_list(args.test_data_path),
        ],
        renormalize_blend_weights=args.renormalize_blend_weights,
        split=args.split,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=tokenizer,
        masking_probability=args.mask_prob,
        short_sequence_probability=args.short_seq_prob,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
    )


def core_bert_dataset_config_from_args(
    args, tokenizer: Optional[MegatronTokenizer] = None
) -> BERTMaskedWordPieceDatasetConfig:
    """BERTMaskedWordPieceDatasetConfig as pretrain_bert.py builds it.

    sequence_length = --seq-length; classification_head = not --bert-no-binary-head.
    `tokenizer` defaults to the global one (megatron.training.get_tokenizer()).
    """
    return BERTMaskedWordPieceDatasetConfig(
        sequence_length=args.seq_length,
        masking_max_ngram=3,
        masking_use_geometric_distribution=False,
        classification_head=args.bert_binary_head,
        **_common_fields(args, tokenizer),
    )


def core_t5_dataset_config_from_args(
    args, tokenizer: Optional[MegatronTokenizer] = None
) -> T5MaskedWordPieceDatasetConfig:
    """T5MaskedWordPieceDatasetConfig as pretrain_t5.py builds it.

    sequence_length = --encoder-seq-length (= --seq-length), sequence_length_decoder =
    --decoder-seq-length; the tokenizer needs sentinels (--vocab-extra-ids > 0).
    """
    return T5MaskedWordPieceDatasetConfig(
        sequence_length=args.encoder_seq_length,
        sequence_length_decoder=args.decoder_seq_length,
        masking_max_ngram=10,
        masking_use_geometric_distribution=True,
        **_common_fields(args, tokenizer),
    )
