"""The `--sft` and `--fim-*` rows of docs/errors.md: each bad input stops pretrain_gpt.py with its
one `error:` line (exit 1, no traceback) before the first training step. Argument errors stop
before torch.distributed is initialized (this process); data errors stop when the datasets are
built (one gloo rank, one job for the cases run through pretrain_gpt.py; the other data errors
are raised by the dataset or tokenizer directly, the same ValueError the entry point prints)."""

import re

import numpy
import pytest
import torch

from tests.functional_tests.test_error_catalogue import _main, _one_error_line
from tests.unit_tests.data.sft_utils import CHATML, FIM, build_chat_tokenizer, write_jsonl
from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")

TINY = [
    '--num-layers',
    '1',
    '--hidden-size',
    '16',
    '--num-attention-heads',
    '2',
    '--seq-length',
    '32',
    '--max-position-embeddings',
    '32',
    '--micro-batch-size',
    '1',
    '--global-batch-size',
    '1',
    '--lr',
    '1e-3',
    '--train-iters',
    '1',
    '--eval-iters',
    '0',
    '--log-interval',
    '1',
    '--distributed-backend',
    'gloo',
    '--num-workers',
    '0',
    '--make-vocab-size-divisible-by',
    '8',
]
GOOD = [
    {'role': 'system', 'content': 'Be brief.'},
    {'role': 'user', 'content': 'What is 6*7?'},
    {'role': 'assistant', 'content': 'The answer is 42.'},
]


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp('sft_errors')
    tok = build_chat_tokenizer(root / 'tok', CHATML, extra_special=FIM)
    bare = build_chat_tokenizer(root / 'bare', None)
    rows = {
        'good': [{'messages': GOOD}] * 4,
        'no_messages': [{'messages': GOOD}, {'text': 'hello'}],
        'bad_role': [{'messages': GOOD}, {'messages': [{'role': 'bot', 'content': 'x'}]}],
        'no_assistant': [{'messages': GOOD[:2]}],
        'long': [{'messages': GOOD + [GOOD[1], {'role': 'assistant', 'content': 'x ' * 40}]}],
    }
    paths = {k: write_jsonl(root / f'{k}.jsonl', v) for k, v in rows.items()}
    return dict(root=root, tok=tok, bare=bare, **paths)


def _sft(files, data, tok=None, fmt='default', extra=()):
    return TINY + [
        '--sft',
        '--tokenizer-type',
        'SFTTokenizer',
        '--tokenizer-model',
        tok or files['tok'],
        '--sft-tokenizer-prompt-format',
        fmt,
        '--data-path',
        files[data],
        '--split',
        '1',
        '--data-cache-path',
        str(files['root'] / 'cache'),
        *extra,
    ]


def test_argument_errors(files):
    gpt2 = [
        '--vocab-file',
        'data/gpt2/gpt2-vocab.json',
        '--merge-file',
        'data/gpt2/gpt2-merges.txt',
    ]
    cases = [
        (
            _sft(files, 'good', fmt='chatml'),
            "error: --sft-tokenizer-prompt-format 'chatml' is not a prompt format; choose one of "
            'nemotron-h-aligned, nemotron-nano-v2, identity, default',
        ),
        (
            TINY + ['--sft', '--data-path', files['good'], '--split', '1'] + gpt2,
            'error: --sft needs --tokenizer-type SFTTokenizer with --tokenizer-model (a Hugging '
            'Face tokenizer directory); got --tokenizer-type GPT2BPETokenizer',
        ),
        (
            _sft(files, 'good', extra=['--reset-position-ids']),
            'error: --sft cannot be combined with --reset-position-ids: SFT samples carry their '
            'own positions, attention boundaries and loss mask (chat JSONL from --data-path)',
        ),
        (
            TINY + ['--fim-data', '--fim-split-sample', '.', '--data-path', 'x'] + gpt2,
            "error: --fim-split-sample '.' needs --fim-fragment-rate (the probability of FIM on "
            'each fragment)',
        ),
        (
            TINY + ['--fim-data', '--fim-rate', '1.5', '--data-path', 'x'] + gpt2,
            'error: --fim-rate must be a probability in [0, 1], got 1.5',
        ),
    ]
    for argv, line in cases:
        code, out, err = _main(argv)
        assert code == 1, err[-2000:]
        assert _one_error_line(err) == line
        assert not torch.distributed.is_initialized()


def _data_cases(files, gpt2_data):
    f = files
    cases = {
        'no_messages': (
            _sft(f, 'no_messages'),
            rf"^error: {f['no_messages']} line 2: no 'messages' list of \{{role, content\}} "
            r"objects \(found \['text'\]\)$",
        ),
        'fim_sentinel': (
            TINY
            + ['--fim-data', '--data-path', gpt2_data, '--split', '1']
            + ['--vocab-file', 'data/gpt2/gpt2-vocab.json', '--merge-file']
            + ['data/gpt2/gpt2-merges.txt'],
            r"^error: --fim-prefix-token '<fim_prefix>' is not a token of the vocabulary of "
            r'--tokenizer-type GPT2BPETokenizer; add it to the tokenizer',
        ),
    }
    return cases


def _unit_cases(files):
    """Data errors raised by the dataset or tokenizer themselves (the same ValueError reaches the
    `error:` line as in the cases run through pretrain_gpt.py)."""
    f = files
    return {
        'bad_role': (
            _sft(f, 'bad_role'),
            rf"^error: {f['bad_role']} line 2: message 0 has unknown role 'bot'; roles are system, "
            r'user, assistant, tool$',
        ),
        'no_assistant': (
            _sft(f, 'no_assistant'),
            rf"^error: {f['no_assistant']} line 1: a conversation has no assistant turn \(roles: "
            r'system, user\): nothing to train$',
        ),
        'format_unrenderable': (
            _sft(f, 'good', fmt='nemotron-h-aligned'),
            r'^error: --sft-tokenizer-prompt-format nemotron-h-aligned needs <SPECIAL_10> as one '
            rf"token, but the tokenizer of --tokenizer-model {f['tok']} has no such token; use "
            r'--sft-tokenizer-prompt-format default \(its own chat template\) or identity$',
        ),
        'no_template': (
            _sft(f, 'good', tok=f['bare']),
            r"^error: --sft-tokenizer-prompt-format default renders with the tokenizer's chat "
            rf"template, but the tokenizer of --tokenizer-model {f['bare']} has none; ",
        ),
        'too_long': (
            _sft(f, 'long', extra=['--sft-long-conversations', 'error']),
            rf"^error: {f['long']} line 1: a conversation of \d+ tokens does not fit --seq-length "
            rf"32 \+ 1 \(1 such in {f['long']}\); raise --seq-length, shorten the data, or pass "
            r'--sft-long-conversations truncate$',
        ),
    }


def test_data_errors_raised_by_dataset_and_tokenizer(files):
    from megatron.core.datasets.utils import Split
    from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig
    from megatron.training.run_control.errors import format_user_error
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

    for name, (argv, pattern) in _unit_cases(files).items():
        tok, fmt = (
            argv[argv.index('--tokenizer-model') + 1],
            argv[argv.index('--sft-tokenizer-prompt-format') + 1],
        )
        path = argv[argv.index('--data-path') + 1]
        policy = 'error' if '--sft-long-conversations' in argv else 'truncate'
        with pytest.raises(ValueError) as info:
            config = SFTDatasetConfig(
                random_seed=1,
                sequence_length=32,
                blend=([path], None),
                split='1',
                tokenizer=SFTTokenizer(tok, fmt),
                long_conversations=policy,
                path_to_cache=str(files['root'] / 'unit_cache'),
            )
            rows = SFTDataset.build_low_level_dataset(path, config)
            SFTDataset(rows, path, numpy.arange(len(rows)), None, Split.train, config)
        assert re.search(pattern, format_user_error(info.value)), (name, str(info.value))


def _run_cases(cases):
    return {name: _main(argv) for name, (argv, _) in cases.items()}


def test_data_errors_before_the_first_step(files, tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    prefix = str(tmp_path / 'docs_text_document')
    builder = IndexedDatasetBuilder(prefix + '.bin', dtype=numpy.uint16)
    for i in range(20):
        builder.add_document(list(range(1, 40 + i)), [39 + i])
    builder.finalize(prefix + '.idx')
    cases = _data_cases(files, prefix)
    results = run_distributed(_run_cases, world_size=1, args=(cases,), timeout=600)[0]
    for name, (code, out, err) in results.items():
        assert code == 1, (name, err[-3000:])
        assert re.search(cases[name][1], _one_error_line(err)), (name, err[-3000:])
        assert 'iteration        1/' not in out, name
    # The default policy truncates, with a warning and a count, and trains.
    code, out, err = run_distributed(_main, world_size=1, args=(_sft(files, 'long'),))[0]
    assert code == 0, err[-3000:]
    assert re.search(
        rf"WARNING: 1 conversation\(s\) of {files['long']} \(train split\) are longer than "
        r'--seq-length 32 \+ 1 and were truncated \(\d+ tokens dropped, longest \d+\); '
        r'--sft-long-conversations error refuses them',
        out,
    ), out[-3000:]


def test_notes_instead_of_silence(files, capsys):
    """--sft takes a HuggingFaceTokenizer as SFTTokenizer and implies no dataloader mask; FIM or
    SFT flags given without their switch are reported as having no effect."""
    from megatron.training.arguments import parse_args, validate_args

    def validate(argv):
        args = parse_args(args_list=argv)
        args.rank, args.world_size = 0, 1
        return validate_args(args, {'tokenizer_type': 'GPT2BPETokenizer'})

    argv = _sft(files, 'good')
    argv[argv.index('SFTTokenizer')] = 'HuggingFaceTokenizer'
    args = validate(argv)
    assert args.tokenizer_type == 'SFTTokenizer' and not args.create_attention_mask_in_dataloader
    assert (
        'NOTE: --sft: --tokenizer-type HuggingFaceTokenizer -> SFTTokenizer'
        in capsys.readouterr().out
    )
    validate(TINY + ['--mock-data', '--fim-rate', '0.9', '--sft-one-row-per-sample'])
    out = capsys.readouterr().out
    assert 'NOTE: --sft-one-row-per-sample has no effect without --sft' in out
    assert 'NOTE: --fim-rate has no effect without --fim-data' in out
