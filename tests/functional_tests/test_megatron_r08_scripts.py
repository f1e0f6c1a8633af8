"""Entry scripts written against core_r0.8.0's entry-script surface train on this package and give
the same losses as this repository's pretrain_gpt.py, pretrain_bert.py and pretrain_t5.py.

The contract scripts (tests/functional_tests/r08_contract/, written here) use every import,
constructor keyword, args attribute and callback protocol that Megatron's r0.8 pretrain_gpt.py,
pretrain_bert.py and pretrain_t5.py use, the way those scripts use them. They run through their
own `__main__` block (`runpy`, as `python gpt.py <flags>` would) on two gloo ranks,
each on a layout that exercises its data path: GPT with TP=2 on GPT-2 BPE data (the script's
default tokenizer), BERT with TP=2 (`--spec local`, binary head), T5 with an encoder stage and a
decoder stage (`--pipeline-model-parallel-split-rank 1`, which r0.8's T5Model could not run).
The same flags through this repository's pretrain_*.py must print the same losses.
"""

import contextlib
import io
import os
import re
import runpy
import sys

import pytest

from tests.functional_tests.bert_utils import BERT_VOCAB
from tests.functional_tests.gpt_utils import MERGES, REPO, VOCAB
from tests.unit_tests.dist_utils import run_distributed

R08_SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'r08_contract')

_COMMON = [
    '--hidden-size', '32', '--num-attention-heads', '4', '--micro-batch-size', '2',
    '--global-batch-size', '4', '--train-iters', '3', '--lr', '1e-3', '--eval-iters', '1',
    '--eval-interval', '2', '--log-interval', '1', '--num-workers', '0',
    '--distributed-backend', 'gloo', '--split', '98,2,0', '--attention-dropout', '0.0',
    '--hidden-dropout', '0.0',
]  # fmt: skip


def _flags(script, data_prefix):
    if script == 'pretrain_gpt':
        model = ['--num-layers', '2', '--seq-length', '16', '--max-position-embeddings', '16']
        model += ['--vocab-file', VOCAB, '--merge-file', MERGES]  # r0.8's default TE impl
        model += ['--tensor-model-parallel-size', '2', '--make-vocab-size-divisible-by', '64']
    elif script == 'pretrain_bert':
        model = ['--num-layers', '2', '--seq-length', '32', '--max-position-embeddings', '32']
        model += ['--vocab-file', BERT_VOCAB, '--spec', 'local']
        model += ['--tensor-model-parallel-size', '2', '--make-vocab-size-divisible-by', '32']
    else:
        model = ['--num-layers', '2', '--decoder-num-layers', '2', '--encoder-seq-length', '32']
        model += ['--decoder-seq-length', '16', '--max-position-embeddings', '32']
        model += ['--vocab-file', BERT_VOCAB, '--vocab-extra-ids', '100']
        model += ['--transformer-impl', 'local', '--pipeline-model-parallel-size', '2']
        model += ['--pipeline-model-parallel-split-rank', '1']
    return _COMMON + model + ['--data-path', data_prefix]


def _run_as_main(path, argv):
    """`python path argv` inside this rank: the script's own `__main__` block; returns stdout."""
    from megatron.training.global_vars import destroy_global_vars

    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    destroy_global_vars()
    saved_argv = sys.argv
    sys.argv = [path] + list(argv)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(path, run_name='__main__')
    finally:
        sys.argv = saved_argv
        destroy_global_vars()
    return out.getvalue()


def _both_scripts(script, argv):
    contract = script.replace('pretrain_', '')
    megatron_out = _run_as_main(os.path.join(R08_SCRIPTS, contract + '.py'), argv)
    ours_out = _run_as_main(os.path.join(REPO, script + '.py'), argv)
    return megatron_out, ours_out


_LOSS = re.compile(r'iteration +(\d+)/ +\d+ \|.*? lm loss: (\S+) \|')


def _losses(stdout):
    return {int(it): float(v) for it, v in _LOSS.findall(stdout)}


@pytest.mark.parametrize('script', ['pretrain_gpt', 'pretrain_bert', 'pretrain_t5'])
def test_r08_contract_script_matches_ours(
    script, gpt_data_prefix, bert_data_prefix, t5_data_prefix
):
    prefix = {
        'pretrain_gpt': gpt_data_prefix,
        'pretrain_bert': bert_data_prefix,
        'pretrain_t5': t5_data_prefix,
    }[script]
    outs = run_distributed(
        _both_scripts, world_size=2, args=(script, _flags(script, prefix)), timeout=150
    )
    megatron_out, ours_out = outs[-1]  # the last rank prints the training log
    losses = _losses(megatron_out)
    assert sorted(losses) == [1, 2, 3], megatron_out[-3000:]
    assert all(0.0 < v < 20.0 for v in losses.values())
    assert 'validation loss at iteration 2' in megatron_out
    if script == 'pretrain_bert':
        assert ' sop loss: ' in megatron_out  # the 2-tuple loss with the binary head's dict
    assert losses == _losses(ours_out)
