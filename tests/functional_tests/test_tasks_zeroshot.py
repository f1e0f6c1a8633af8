"""Zero-shot GPT evaluation through tasks/main.py against an independent computation.

A random tiny GPT-2 is built with transformers (no downloads), imported with
tools/checkpoint/convert.py at TP1 and at TP2xPP2, and evaluated with `--task WIKITEXT103` and
`--task LAMBADA` (strict and not). The expected numbers are computed in this file from the
transformers model with plain PyTorch: every target's log-probability given the context its
window gives it, and LAMBADA's all-target-tokens-argmax rule. The fixture files come from
tasks/make_fixture_data.py: they test the code paths, not language ability.
"""

import json
import math
import os

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.functional_tests.tasks_utils import result_fields, run_task
from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip('transformers')

VOCAB_FILE = os.path.join(cu.REPO, 'data', 'gpt2', 'gpt2-vocab.json')
MERGE_FILE = os.path.join(cu.REPO, 'data', 'gpt2', 'gpt2-merges.txt')
SEQ = 32
STRIDE = 8


def _tokenizer():
    from megatron.training.tokenizer.tokenizer import _GPT2BPETokenizer

    return _GPT2BPETokenizer(VOCAB_FILE, MERGE_FILE)


def make_hf_model():
    """A random tiny GPT-2 on the GPT-2 vocabulary."""
    config = transformers.GPT2Config(
        vocab_size=50257,
        n_positions=SEQ,
        n_embd=32,
        n_layer=2,
        n_head=4,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config).eval()


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
    """(HF model, {layout: checkpoint dir}, data dir, {layout: vocabulary padding rows})."""
    import sys

    sys.path.insert(0, cu.REPO)
    from tasks.make_fixture_data import build_all

    tmp = tmp_path_factory.mktemp('zeroshot')
    hf = make_hf_model()
    hf_dir = str(tmp / 'hf')
    hf.save_pretrained(hf_dir, safe_serialization=True)
    dirs = {'tp1': str(tmp / 'tp1'), 'tp2pp2': str(tmp / 'tp2pp2')}
    cu.convert(
        '--loader', 'hf', '--saver', 'mcore', '--load-dir', hf_dir, '--save-dir', dirs['tp1']
    )
    cu.convert(
        '--loader',
        'hf',
        '--saver',
        'mcore',
        '--load-dir',
        hf_dir,
        '--save-dir',
        dirs['tp2pp2'],
        '--target-tensor-parallel-size',
        '2',
        '--target-pipeline-parallel-size',
        '2',
    )
    # The embedding rows that pad the vocabulary (to a multiple of 128 x TP) at each layout.
    pad_rows = {
        k: cu.full_model(d)[0]['embedding.word_embeddings.weight'][50257:] for k, d in dirs.items()
    }
    data = build_all(
        str(tmp / 'data'),
        n_train=3,
        n_dev=3,
        race_train_docs=3,
        race_dev_docs=3,
        lambada=0,
        wiki_paragraphs=12,
    )
    _write_lambada(hf, os.path.join(data, 'lambada_test.jsonl'))
    return hf, dirs, data, pad_rows


def _write_lambada(hf, path):
    """Passages from Moby Dick; for every other one the word the model predicts is appended, so
    the expected accuracy is neither 0 nor 1."""
    tok = _tokenizer()
    with open(os.path.join(cu.REPO, 'data', 'corpus', 'mobydick.jsonl')) as f:
        f.readline()
        words = json.loads(f.readline())['text'].split()
    lines, made = [], 0
    for i in range(24):
        text = ' '.join(words[i * 12 : (i + 1) * 12])
        if i % 2 == 0:
            ids = tok.tokenize(text)
            with torch.no_grad():
                pred = int(hf(torch.tensor([ids])).logits[0, -1].argmax())
            piece = tok.detokenize([pred])
            if piece.startswith(' ') and piece[1:].isalpha():
                candidate = text + piece
                if tok.tokenize(candidate) == ids + [pred]:
                    text, made = candidate, made + 1
        lines.append(json.dumps({'text': text}))
    assert made >= 2, 'fixture should hold passages the model gets right'
    with open(path, 'w') as f:
        f.write('\n'.join(lines) + '\n')


def _log_probs(hf, ids, pad_rows):
    """Log-probabilities over the padded vocabulary: Megatron's softmax also runs over the rows
    that pad the vocabulary (the converter fills them with the mean embedding), so their logits,
    final hidden state x padding row, join the transformers logits."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_hidden_states=True)
    hidden = out.hidden_states[-1][0].double()  # after the final LayerNorm
    logits = torch.cat([out.logits[0].double(), hidden @ pad_rows.double().t()], -1)
    return torch.log_softmax(logits, -1)


def expected_wikitext(hf, path, pad_rows):
    """Megatron's WikiText numbers, computed target by target: target t (1..N-1) is predicted
    from tokens[start:t], where start = 0 for t <= L, else the smallest multiple of the stride
    with t - start <= L."""
    from tasks.zeroshot_gpt.detokenizer import wikitext_detokenizer  # input preparation only

    raw = open(path, encoding='utf-8').read()
    num_words = len(raw.strip().split(' '))
    ids = _tokenizer().tokenize(wikitext_detokenizer(raw))
    nll = 0.0
    cache = {}
    for t in range(1, len(ids)):
        start = 0 if t <= SEQ else STRIDE * math.ceil((t - SEQ) / STRIDE)
        if start not in cache:
            cache[start] = _log_probs(hf, ids[start : start + SEQ], pad_rows)
        nll -= float(cache[start][t - 1 - start, ids[t]])
    avg = nll / (len(ids) - 1)
    ratio = (len(ids) - 1) / (num_words - 1)
    return {
        'avg loss': avg,
        'ppl': math.exp(min(20, avg)),
        'adjusted ppl': math.exp(min(20, avg * ratio)),
        'token ratio': ratio,
    }


def expected_lambada(hf, path, strict, pad_rows):
    """(number correct, total): every target token must be the argmax given the text before it."""
    tok = _tokenizer()
    correct = total = 0
    for line in open(path):
        text = json.loads(line)['text']
        if strict:
            word = text.split()[-1]
            context = tok.tokenize(text[: text.rfind(word)].strip())
            target = tok.tokenize(' ' + word)
        else:
            ids = tok.tokenize(text)
            context, target = ids[:-1], ids[-1:]
        lp = _log_probs(hf, context + target, pad_rows)
        preds = lp.argmax(-1)[len(context) - 1 : len(context) - 1 + len(target)].tolist()
        correct += int(preds == target)
        total += 1
    return correct, total


def _args(load, task, path, extra=()):
    return [
        '--task',
        task,
        '--valid-data',
        path,
        '--load',
        load,
        '--use-checkpoint-args',
        '--micro-batch-size',
        '3',
        '--tokenizer-type',
        'GPT2BPETokenizer',
        '--vocab-file',
        VOCAB_FILE,
        '--merge-file',
        MERGE_FILE,
        '--num-workers',
        '0',
        '--no-load-rng',
        '--no-load-optim',
        '--log-interval',
        '100',
        *extra,
    ]


def _result(load, layout, args):
    tp, pp = (1, 1) if layout == 'tp1' else (2, 2)
    outs = run_distributed(run_task, world_size=tp * pp, tp=tp, pp=pp, args=(args,), timeout=600)
    stdout = outs[-1][1]  # the last rank prints the result block
    line = [x for x in stdout.splitlines() if x.startswith(' validation results on ')]
    assert len(line) == 1, stdout
    dashes = stdout.splitlines()[stdout.splitlines().index(line[0]) - 1]
    assert dashes == '-' * (len(line[0]) + 1)
    return outs[-1][0], result_fields(line[0]), line[0]


@pytest.mark.parametrize('layout', ['tp1', 'tp2pp2'])
def test_wikitext_perplexity(setup, layout):
    hf, dirs, data, pad_rows = setup
    path = os.path.join(data, 'wiki.test.tokens')
    result, fields, line = _result(
        dirs[layout],
        layout,
        _args(dirs[layout], 'WIKITEXT103', path, ['--overlapping-eval', str(STRIDE)]),
    )
    expected = expected_wikitext(hf, path, pad_rows[layout])
    assert line.startswith(' validation results on WIKITEXT103 | avg loss: ')
    assert result['avg loss'] == pytest.approx(expected['avg loss'], rel=1e-5)
    for key in ('avg loss', 'ppl', 'adjusted ppl'):
        # the printed values carry 5 significant digits
        assert fields[key] == pytest.approx(expected[key], rel=1e-4), key
    assert fields['token ratio'] == pytest.approx(expected['token ratio'], rel=1e-12)


@pytest.mark.parametrize('layout,strict', [('tp2pp2', False), ('tp1', True)])
def test_lambada_accuracy(setup, layout, strict):
    hf, dirs, data, pad_rows = setup
    path = os.path.join(data, 'lambada_test.jsonl')
    extra = ['--strict-lambada'] if strict else []
    _, fields, line = _result(dirs[layout], layout, _args(dirs[layout], 'LAMBADA', path, extra))
    correct, total = expected_lambada(hf, path, strict, pad_rows[layout])
    assert 0 < correct < total
    assert fields['number correct'] == correct
    assert fields['total examples'] == total
    assert fields['avg accuracy'] == pytest.approx(correct / total, rel=1e-4)
