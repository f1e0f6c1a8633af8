"""Shared pieces of the T5 end-to-end tests: the tiny model's flags, the preprocessed corpus,
reference weights that every TP/PP layout can load, and the worker function that runs `pretrain()`
from pretrain_t5.py inside a `run_distributed` rank.
"""

import fcntl
import os
import subprocess
import sys
import zlib

import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BERT_VOCAB = os.path.join(REPO, 'data', 'bert', 'bert-vocab.txt')

ENC_SEQ, DEC_SEQ = 32, 16
#: Quotations of data/corpus/fortunes.jsonl used by the T5 tests (short documents: one T5 sample
#: each, most of them shorter than ENC_SEQ).
NUM_FORTUNES = 3000

#: A tiny T5 on the bundled BERT WordPiece vocabulary with 100 sentinels: 2 + 2 layers, hidden 64.
#: The padded vocabulary (30522 + [BOS], [EOS] + 100 -> 30720) is the same at TP=1 and TP=2.
TINY_T5_ARGS = [
    '--encoder-num-layers',
    '2',
    '--decoder-num-layers',
    '2',
    '--hidden-size',
    '64',
    '--num-attention-heads',
    '4',
    '--kv-channels',
    '16',
    '--ffn-hidden-size',
    '128',
    '--encoder-seq-length',
    str(ENC_SEQ),
    '--decoder-seq-length',
    str(DEC_SEQ),
    '--max-position-embeddings',
    str(ENC_SEQ),
    '--attention-dropout',
    '0.0',
    '--hidden-dropout',
    '0.0',
    '--lr',
    '3e-3',
    '--min-lr',
    '3e-4',
    '--lr-decay-style',
    'cosine',
    '--lr-warmup-iters',
    '2',
    '--weight-decay',
    '0.01',
    '--clip-grad',
    '1.0',
    '--seed',
    '1234',
    '--vocab-file',
    BERT_VOCAB,
    '--vocab-extra-ids',
    '100',
    '--transformer-impl',
    'local',
    '--split',
    '98,2,0',
    '--num-workers',
    '0',
    '--log-interval',
    '1',
    '--eval-interval',
    '1000',
    '--distributed-backend',
    'gloo',
]


def prepare_t5_data(work_dir):
    """Preprocess the first NUM_FORTUNES quotations of data/corpus/fortunes.jsonl with the bundled
    BERT vocabulary (lower case) into work_dir once; returns the data prefix.

    Safe to call from several processes: a file lock serialises the build.
    """
    os.makedirs(work_dir, exist_ok=True)
    prefix = os.path.join(work_dir, 'fortunes_text_document')
    with open(os.path.join(work_dir, '.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(prefix + '.idx'):
            subset = os.path.join(work_dir, 'fortunes.jsonl')
            with (
                open(os.path.join(REPO, 'data', 'corpus', 'fortunes.jsonl')) as src,
                open(subset, 'w') as dst,
            ):
                for _, line in zip(range(NUM_FORTUNES), src):
                    dst.write(line)
            subprocess.run(
                [
                    sys.executable,
                    os.path.join(REPO, 'tools', 'preprocess_data.py'),
                    '--input',
                    subset,
                    '--output-prefix',
                    os.path.join(work_dir, 'fortunes'),
                    '--tokenizer-type',
                    'BertWordPieceLowerCase',
                    '--vocab-file',
                    BERT_VOCAB,
                    '--workers',
                    '1',
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        fcntl.flock(lock, fcntl.LOCK_UN)
    return prefix


def _global_name(model, name):
    parts = name.split('.')
    if parts[0] in ('encoder', 'decoder') and parts[1] == 'layers':
        block = model.encoder if parts[0] == 'encoder' else model.decoder
        parts[2] = str(block.layers[int(parts[2])].layer_number - 1)
        return '.'.join(parts)
    if parts[0] == 'lm_head':
        name = '.'.join(parts[1:])
    if name == 'output_layer.weight' and model.share_embeddings_and_output_weights:
        return 'embedding.word_embeddings.weight'
    return name


def set_t5_reference_weights(model):
    """Overwrite every parameter with values that depend only on its *global* name.

    Layer indices come from the layers' own (stack-relative) layer numbers, the head's tied weight
    maps to the word embedding, and TP ranks take their slice along `partition_dim`, so every
    TP/PP layout (both embedding copies included) starts from the same model.
    """
    from megatron.core import parallel_state as mpu

    tp = mpu.get_tensor_model_parallel_world_size()
    tp_rank = mpu.get_tensor_model_parallel_rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            global_name = _global_name(model, name)
            full_shape = list(param.shape)
            partitioned = getattr(param, 'tensor_model_parallel', False)
            if partitioned:
                full_shape[param.partition_dim] *= tp
            gen = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
            full = torch.randn(full_shape, generator=gen) * 0.02
            if 'norm' in global_name and global_name.endswith('weight'):
                full = 1.0 + 5.0 * full
            if partitioned:
                full = torch.chunk(full, tp, dim=param.partition_dim)[tp_rank]
            param.copy_(full.to(param.dtype))


def _reference_model_provider(
    pre_process=True, post_process=True, add_encoder=True, add_decoder=True
):
    import pretrain_t5

    model = pretrain_t5.model_provider(pre_process, post_process, add_encoder, add_decoder)
    set_t5_reference_weights(model)
    return model


def run_pretrain_t5(extra_args, reference_weights=False, capture_stdout=False):
    """Run pretrain_t5's pretrain() on this rank (called inside a run_distributed worker).

    Args:
        extra_args: flags added to TINY_T5_ARGS.
        reference_weights: start from `set_t5_reference_weights` instead of Megatron's init.
        capture_stdout: return what this rank printed as result['stdout'].

    Returns pretrain()'s result dict (losses are filled on the last rank).
    """
    import contextlib
    import io

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_t5
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    buffer = io.StringIO()
    redirect = contextlib.redirect_stdout(buffer) if capture_stdout else contextlib.nullcontext()
    try:
        with redirect:
            result = pretrain(
                pretrain_t5.train_valid_test_datasets_provider,
                _reference_model_provider if reference_weights else pretrain_t5.model_provider,
                ModelType.encoder_and_decoder,
                pretrain_t5.forward_step,
                args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
                args_list=TINY_T5_ARGS + list(extra_args),
            )
    finally:
        destroy_global_vars()
    if capture_stdout:
        result['stdout'] = buffer.getvalue()
    return result
