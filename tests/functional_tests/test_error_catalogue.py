"""The error catalogue of docs/errors.md: every row is exercised here (or in the test file the row
names) and its one-line message and exit code asserted, so messages change only on purpose.

Errors found while the arguments are checked run in this process (they stop before
torch.distributed is initialized); the others run pretrain() on one gloo rank."""

import contextlib
import io
import os
import re
import sys

import numpy
import pytest
import torch

from tests.functional_tests.gpt_utils import MERGES, REPO, VOCAB
from tests.unit_tests.dist_utils import run_distributed

DOC = os.path.join(REPO, 'docs', 'errors.md')
TINY = [
    '--num-layers',
    '2',
    '--hidden-size',
    '32',
    '--num-attention-heads',
    '4',
    '--seq-length',
    '16',
    '--max-position-embeddings',
    '16',
    '--micro-batch-size',
    '2',
    '--global-batch-size',
    '2',
    '--lr',
    '1e-3',
    '--vocab-file',
    VOCAB,
    '--merge-file',
    MERGES,
    '--make-vocab-size-divisible-by',
    '64',
    '--log-interval',
    '1',
    '--eval-iters',
    '1',
    '--eval-interval',
    '1000',
    '--train-iters',
    '2',
    '--distributed-backend',
    'gloo',
    '--num-workers',
    '0',
    '--save-interval',
    '1000',
]
#: Rows exercised by other test files (the row names the file).
ELSEWHERE = {
    'fp16-real-nan': 'tests/functional_tests/test_fp16_default_loss_scale.py',
    'frozen-rank': 'tests/functional_tests/test_faults_torchrun.py',
    'launcher-dead': 'tests/functional_tests/test_faults_torchrun.py',
    **{
        case: 'tests/unit_tests/training/test_moe_arguments.py'
        for case in (
            'moe-topk',
            'moe-ep-experts',
            'moe-ep-dp',
            'moe-ep-tp-sp',
            'moe-tp-sp',
            'moe-capacity',
            'moe-legacy',
            'moe-dispatcher',
            'moe-config',
        )
    },
    'sft-no-messages': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-unknown-role': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-no-assistant': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-prompt-format': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-format-tokens': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-no-chat-template': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-too-long': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-truncated': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-tokenizer': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-incompatible': 'tests/functional_tests/test_sft_fim_errors.py',
    'fim-split-no-rate': 'tests/functional_tests/test_sft_fim_errors.py',
    'fim-rate': 'tests/functional_tests/test_sft_fim_errors.py',
    'fim-sentinel': 'tests/functional_tests/test_sft_fim_errors.py',
    'sft-bad-json': 'tests/unit_tests/data/test_sft_dataset.py',
    'fim-tokenizer': 'tests/unit_tests/data/test_fim.py',
}


def _main(argv):
    """pretrain_gpt's entry point (run_main(pretrain, ...)) -> (exit code, stdout, stderr)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.errors import run_main
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_main(
                pretrain,
                pretrain_gpt.train_valid_test_datasets_provider,
                pretrain_gpt.model_provider,
                ModelType.encoder_or_decoder,
                pretrain_gpt.forward_step,
                args_defaults={'tokenizer_type': 'GPT2BPETokenizer'},
                args_list=argv,
            )
    except SystemExit as exc:
        code = exc.code
    finally:
        destroy_global_vars()
    return code, out.getvalue(), err.getvalue()


def _one_error_line(err):
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if 'error:' in line]
    assert len(errors) == 1, err
    assert 'Traceback' not in err, err
    return errors[0]


def _tracker(path, iteration):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, 'latest_checkpointed_iteration.txt'), 'w') as f:
        f.write(str(iteration))


@pytest.fixture(scope='module')
def data(tmp_path_factory):
    """A small GPT-2-token dataset, plus a .bin too large and a .bin truncated for its .idx."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    root = tmp_path_factory.mktemp('catalogue')
    rng = numpy.random.default_rng(0)
    prefix = str(root / 'docs_text_document')
    builder = IndexedDatasetBuilder(prefix + '.bin', dtype=numpy.uint16)
    for _ in range(200):
        ids = rng.integers(0, 50000, rng.integers(20, 60)).tolist()
        builder.add_document(ids, [len(ids)])
    builder.finalize(prefix + '.idx')
    blob = open(prefix + '.bin', 'rb').read()
    for name, content in (('larger', blob + b'\0' * 64), ('truncated', blob[: len(blob) // 2])):
        other = str(root / f'{name}_text_document')
        open(other + '.bin', 'wb').write(content)
        open(other + '.idx', 'wb').write(open(prefix + '.idx', 'rb').read())
    return root


# ---------------------------------------------------------------------------------------------
# errors found while checking the arguments (this process, before torch.distributed)


def _pre_init_cases(tmp_path):
    a_file = tmp_path / 'a_file'
    a_file.write_text('')
    foreign, behind = str(tmp_path / 'foreign'), str(tmp_path / 'behind')
    _tracker(foreign, 4)
    _tracker(behind, 4)
    mock = ['--mock-data']
    return {
        'unknown-flag': (mock + ['--foo'], 2, r'^\S+: error: unrecognized arguments: --foo$'),
        'world-size': (
            mock + ['--tensor-model-parallel-size', '2'],
            1,
            r'^error: world size \(1\) is not divisible by --tensor-model-parallel-size '
            r'\(2\) x --pipeline-model-parallel-size \(1\) x --context-parallel-size '
            r'\(1\) = 2$',
        ),
        'save-foreign': (
            mock + ['--save', foreign],
            1,
            rf'^error: --save {foreign} already holds a checkpoint \(iteration 4\) '
            rf'that this run does not load \(--load None\); resume it with --load '
            rf'{foreign}, or choose another --save directory$',
        ),
        'save-backwards': (
            mock + ['--save', behind, '--load', behind, '--ckpt-step', '2'],
            1,
            rf'^error: --save {behind} holds checkpoints up to iteration 4 but this '
            rf'run starts at iteration 2 \(--ckpt-step 2\): its saves would replace '
            rf'newer checkpoints and move latest_checkpointed_iteration.txt '
            rf'backwards; choose another --save directory$',
        ),
        'save-not-writable': (
            mock + ['--save', f'{a_file}/ckpt'],
            1,
            rf'^error: --save {a_file}/ckpt is not a writable directory '
            rf'\(Not a directory\)$',
        ),
        'cache-not-writable': (
            ['--data-path', str(tmp_path / 'x'), '--data-cache-path', f'{a_file}/cache'],
            1,
            rf'^error: --data-cache-path {a_file}/cache is not a writable '
            rf'directory \(Not a directory\)$',
        ),
        'merge-is-json': (
            mock + ['--merge-file', VOCAB],
            1,
            rf'^error: --merge-file {VOCAB} is a JSON file, not a BPE merges file '
            rf'\(swapped --vocab-file and --merge-file\?\)$',
        ),
        'vocab-not-json': (
            mock + ['--vocab-file', MERGES],
            1,
            rf'^error: --vocab-file {MERGES} is not a JSON vocabulary: .* '
            rf'\(it looks like a BPE merges file: swapped --vocab-file and '
            rf'--merge-file\?\)$',
        ),
    }


PRE_INIT = [
    'unknown-flag',
    'world-size',
    'save-foreign',
    'save-backwards',
    'save-not-writable',
    'cache-not-writable',
    'merge-is-json',
    'vocab-not-json',
]


@pytest.mark.parametrize('case', PRE_INIT)
def test_argument_phase_errors(tmp_path, case):
    argv, code, pattern = _pre_init_cases(tmp_path)[case]
    got_code, out, err = _main(TINY + argv)
    assert got_code == code, (got_code, err[-2000:])
    assert re.search(pattern, _one_error_line(err)), err
    assert not torch.distributed.is_initialized()
    if case in ('save-foreign', 'save-backwards'):
        # Nothing was written into the other run's directory.
        directory = argv[argv.index('--save') + 1]
        assert sorted(os.listdir(directory)) == ['latest_checkpointed_iteration.txt']
        assert open(os.path.join(directory, 'latest_checkpointed_iteration.txt')).read() == '4'


def test_preprocess_refuses_vocab_json_as_merge_file(tmp_path):
    from tests.unit_tests.data.test_preprocess_data import preprocess

    src = tmp_path / 'in.jsonl'
    src.write_text('{"text": "hello world"}\n')
    with pytest.raises(SystemExit) as info:
        preprocess.main(
            [
                '--input',
                str(src),
                '--output-prefix',
                str(tmp_path / 'out'),
                '--tokenizer-type',
                'GPT2BPETokenizer',
                '--vocab-file',
                VOCAB,
                '--merge-file',
                VOCAB,
                '--workers',
                '1',
            ]
        )
    assert str(info.value.code) == (
        f'error: --merge-file {VOCAB} is a JSON file, not a BPE merges file (swapped --vocab-file '
        f'and --merge-file?)'
    )
    assert not [p for p in os.listdir(tmp_path) if p.startswith('out')]


# ---------------------------------------------------------------------------------------------
# errors found after start-up (one gloo rank)


def _in_rank(argv):
    return _main(argv)


def _run(argv):
    return run_distributed(_in_rank, world_size=1, args=(TINY + argv,), timeout=600)[0]


def test_data_and_checkpoint_errors(data, tmp_path):
    cache = str(tmp_path / 'cache')
    base = [
        '--data-path',
        str(data / 'docs_text_document'),
        '--data-cache-path',
        cache,
        '--split',
        '90,5,5',
    ]

    # train-iters-0: evaluation only, exit 0.
    code, out, err = _run(base + ['--train-iters', '0'])
    assert code == 0, err[-3000:]
    assert ' validation loss at iteration 0 on 2-sample draw from validation set |' in out
    assert 'consumed samples:' not in out

    # cache-corrupt: a planted object array where the train split's index was cached.
    names = [n for n in os.listdir(cache) if n.endswith('-train-document_index.npy')]
    target = os.path.join(cache, names[0])
    numpy.save(target, numpy.array([{'x': 1}], dtype=object), allow_pickle=True)
    code, out, err = _run(base + ['--train-iters', '0'])
    assert code == 1
    assert re.search(
        rf'^error: dataset cache file {target} is corrupt or was not written by '
        rf'Megatron \(not a plain numpy array: .*\); delete it \(or its cache '
        rf'directory {cache}\) so the indices are rebuilt$',
        _one_error_line(err),
    ), err

    # empty-train-split.
    code, out, err = _run(
        [
            '--data-path',
            str(data / 'docs_text_document'),
            '--data-cache-path',
            cache,
            '--split',
            '0,100,0',
        ]
    )
    assert code == 1
    assert _one_error_line(err) == (
        'error: the training data yields no samples (--split 0,100,0), but --train-iters 2 asks '
        'for training; give the training split a share of the data, or use --skip-train to only '
        'evaluate'
    )

    # bin-larger / bin-truncated.
    for name, pattern in (
        (
            'larger',
            r'^error: {p}\.bin has \d+ bytes but its index {p}\.idx describes \d+: the '
            r'\.bin and \.idx come from different preprocessing runs$',
        ),
        ('truncated', r'^error: {p}\.bin: truncated data file \(\d+ bytes, the index needs \d+\)$'),
    ):
        prefix = str(data / f'{name}_text_document')
        code, out, err = _run(['--data-path', prefix, '--data-cache-path', cache])
        assert code == 1
        assert re.search(pattern.format(p=re.escape(prefix)), _one_error_line(err)), err

    # checkpoint-planted: a checkpoint holding an object that is not plain data.
    ckpt = str(tmp_path / 'ckpt')
    name = os.path.join(ckpt, 'iter_0000002', 'mp_rank_00', 'model_optim_rng.pt')
    os.makedirs(os.path.dirname(name))
    torch.save({'args': io.StringIO('not data'), 'iteration': 2}, name)
    _tracker(ckpt, 2)
    code, out, err = _run(['--mock-data', '--load', ckpt])
    assert code == 1
    assert re.search(
        rf'^error: checkpoint file {name} cannot be loaded as weights only \(tensors '
        rf'and plain data\): .*GLOBAL',
        _one_error_line(err),
    ), err


# ---------------------------------------------------------------------------------------------
# the document and the tests agree


def test_every_documented_row_is_exercised():
    ids = set(re.findall(r'^\| ([a-z0-9-]+) \|', open(DOC).read(), flags=re.M)) - {'id'}
    here = set(PRE_INIT) | {
        'bin-larger',
        'bin-truncated',
        'cache-corrupt',
        'checkpoint-planted',
        'empty-train-split',
        'train-iters-0',
    }
    assert set(ids) == here | set(ELSEWHERE), sorted(set(ids) ^ (here | set(ELSEWHERE)))
    for case, path in ELSEWHERE.items():
        assert os.path.isfile(os.path.join(REPO, path)), path
