"""Checks of BERT pretraining inputs that Megatron leaves to fail late (or silently).

Each check raises a one-line `ValueError` naming the flag or file, before any training step:
- the tokenizer has no [MASK] token (e.g. a GPT-2 BPE tokenizer): masking would write -1 ids;
- the sequence length exceeds the position table (the BERT model always uses learned absolute
  positions, whatever --position-embedding-type says);
- --mock-data (Megatron has no mock BERT dataset);
- the binary (sentence-order) head is on but a data file is document-level: every document is one
  sequence, so Megatron's sample mapping, which needs two sentences per sample, finds no samples.
"""

from megatron.core.datasets.indexed_dataset import IndexedDataset
from megatron.core.datasets.utils import get_blend_from_list


def _data_prefixes(args):
    prefixes = []
    for flag, value in (
        ('--data-path', args.data_path),
        ('--train-data-path', args.train_data_path),
        ('--valid-data-path', args.valid_data_path),
        ('--test-data-path', args.test_data_path),
    ):
        blend = get_blend_from_list(value)
        if blend is not None:
            prefixes.extend((flag, prefix) for prefix in blend[0])
    return prefixes


def _check_sentence_split(flag, prefix):
    if not IndexedDataset.exists(prefix):
        raise ValueError(f'{flag} {prefix}: no {prefix}.idx / {prefix}.bin found')
    dataset = IndexedDataset(prefix)
    num_documents = len(dataset.document_indices) - 1
    num_sequences = len(dataset.sequence_lengths)
    if num_documents > 0 and num_sequences <= num_documents:
        raise ValueError(
            f'{flag} {prefix}: every one of its {num_documents} documents is a single sequence '
            '(document-level data), but the BERT binary head needs sentence-split data: '
            'preprocess with tools/preprocess_data.py --split-sentences (a *_text_sentence '
            'prefix), or pass --bert-no-binary-head'
        )


def check_bert_pretraining_inputs(args, tokenizer) -> None:
    """Raise a one-line ValueError for BERT inputs that cannot train (see the module docstring).

    Args:
        args: the parsed Megatron args.
        tokenizer: the Megatron tokenizer built from them.
    """
    try:
        mask_id = tokenizer.mask
    except (AttributeError, NotImplementedError):
        mask_id = None
    if mask_id is None or mask_id < 0:
        raise ValueError(
            f'--tokenizer-type {args.tokenizer_type} (--vocab-file {args.vocab_file}): the '
            'vocabulary has no [MASK] token, which BERT masking needs; use a BERT WordPiece '
            'vocabulary with BertWordPieceLowerCase or BertWordPieceCase'
        )
    if args.seq_length > args.max_position_embeddings:
        raise ValueError(
            f'--seq-length ({args.seq_length}) exceeds --max-position-embeddings '
            f'({args.max_position_embeddings}), the rows of BERT\'s position table'
        )
    if getattr(args, 'mock_data', False):
        raise ValueError('--mock-data: there is no mock BERT dataset; pass --data-path')
    if args.bert_binary_head:
        for flag, prefix in _data_prefixes(args):
            _check_sentence_split(flag, prefix)
