"""Shared pieces of the BERT end-to-end tests: sentence-split data, the tiny BERT's flags, and the
worker function that runs pretrain_bert.py's `pretrain()` inside a `run_distributed` rank (the GPT
helpers of gpt_utils.py, pointed at pretrain_bert)."""

import os

from tests.functional_tests.gpt_utils import REPO, preprocess_once, run_pretrain

BERT_VOCAB = os.path.join(REPO, 'data', 'bert', 'bert-vocab.txt')

#: A tiny BERT on the bundled uncased WordPiece vocabulary: 2 layers, hidden 64, seq 32.
#: 30522 + [BOS], [EOS] = 30524 ids; --make-vocab-size-divisible-by 32 pads them to 30528 at TP=1
#: and at TP=2 (a multiple of 64), so layouts are comparable. Seed 1236: with seed 1234 the
#: training samples 18 and 19 (one micro-batch of 2) are both too short to get a masked token.
TINY_BERT_ARGS = [
    '--num-layers',
    '2',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '32',
    '--max-position-embeddings',
    '64',
    '--attention-dropout',
    '0.0',
    '--hidden-dropout',
    '0.0',
    '--make-vocab-size-divisible-by',
    '32',
    '--spec',
    'local',
    '--lr',
    '1e-2',
    '--min-lr',
    '1e-3',
    '--lr-decay-style',
    'cosine',
    '--lr-warmup-iters',
    '2',
    '--weight-decay',
    '0.01',
    '--clip-grad',
    '1.0',
    '--seed',
    '1236',
    '--vocab-file',
    BERT_VOCAB,
    '--split',
    '98,2,0',
    '--num-workers',
    '0',
    '--log-interval',
    '1',
    '--eval-interval',
    '1000',
]


def prepare_bert_data(work_dir):
    """Preprocess data/corpus/mobydick.jsonl once, split into sentences with the bundled BERT
    vocabulary (offline Punkt); returns the `..._text_sentence` prefix."""
    return preprocess_once(
        work_dir,
        'mobydick',
        'sentence',
        [
            '--tokenizer-type',
            'BertWordPieceLowerCase',
            '--vocab-file',
            BERT_VOCAB,
            '--split-sentences',
        ],
    )


def run_bert_pretrain(extra_args, reference_weights=False, capture_stdout=False):
    """pretrain_bert's pretrain() on this rank with TINY_BERT_ARGS + extra_args (see
    gpt_utils.run_pretrain). Returns pretrain()'s result dict (losses on the last rank)."""
    return run_pretrain(
        extra_args,
        reference_weights=reference_weights,
        capture_stdout=capture_stdout,
        script='pretrain_bert',
        base_args=TINY_BERT_ARGS,
        args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
    )
