"""--use-checkpoint-args restores the tokenizer: type and model file (a SentencePiece / HF model
is not derivable from the other flags), unless the run names other tokenizer files itself."""

import os

import torch

from megatron.training.arguments import parse_args
from megatron.training.checkpointing import load_args_from_checkpoint

_MODEL = ['--num-layers', '2', '--hidden-size', '32', '--num-attention-heads', '4']
_MODEL += ['--seq-length', '16', '--max-position-embeddings', '16', '--micro-batch-size', '1']


def _checkpoint(tmp_path, tokenizer_dir):
    recorded = parse_args(
        args_list=_MODEL
        + ['--tokenizer-type', 'HuggingFaceTokenizer', '--tokenizer-model', tokenizer_dir]
    )
    recorded.padded_vocab_size = 128
    load = tmp_path / 'ckpt'
    os.makedirs(load / 'iter_0000001' / 'mp_rank_00')
    state = {'args': recorded, 'checkpoint_version': 3.0, 'iteration': 1}
    torch.save(state, load / 'iter_0000001' / 'mp_rank_00' / 'model_optim_rng.pt')
    (load / 'latest_checkpointed_iteration.txt').write_text('1')
    return str(load)


def _restored(load, *flags):
    args = parse_args(args_list=['--load', load, '--use-checkpoint-args', *flags])
    load_args_from_checkpoint(args)
    return args.tokenizer_type, args.tokenizer_model


def test_tokenizer_model_comes_back(tmp_path):
    tokenizer_dir = str(tmp_path / 'hf_tokenizer')
    os.makedirs(tokenizer_dir)
    load = _checkpoint(tmp_path, tokenizer_dir)
    expected = ('HuggingFaceTokenizer', tokenizer_dir)
    assert _restored(load) == expected
    assert _restored(load, '--tokenizer-type', 'HuggingFaceTokenizer') == expected
    other = str(tmp_path / 'other')
    assert _restored(load, '--tokenizer-model', other) == ('HuggingFaceTokenizer', other)
