"""The error catalogue of docs/errors.md: every row is exercised here (or in the test file the row
names) and its one-line message and exit code asserted, so messages change only on purpose.

Errors found while the arguments are checked run in this process (they stop before
torch.distributed is initialized); the others run pretrain() on one gloo rank."""

import contextlib
import io
import os
import re
import shutil
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
    **{
        case: 'tests/functional_tests/test_vision_classify.py'
        for case in ('vision-patch', 'vision-classes', 'vision-channels', 'vision-backbone')
        + ('vision-pipeline',)
    },
    'image-file-bad': 'tests/unit_tests/data/test_image_data.py',
    'tp-comm-overlap-sp': 'tests/unit_tests/tensor_parallel/test_tp_comm_overlap.py',
    **{
        case: 'tests/functional_tests/test_pretrain_vlm.py'
        for case in ('vlm-vision-model-type', 'vlm-patch', 'vlm-seq-length', 'vlm-image-bad')
        + ('vlm-null-tokenizer-words', 'vlm-freeze-lm-pipeline', 'vlm-interleaved')
    },
    'image-folder-bad': 'tests/unit_tests/data/test_image_data.py',
    **{
        case: 'tests/functional_tests/test_convert_llava.py'
        for case in ('convert-llava-pipeline', 'convert-llava-tp')
    },
    # issue 33 part 1 (the round-4 probe)
    'dist-ckpt-metadata-objects': 'tests/unit_tests/dist_checkpointing/test_metadata_unpickler.py',
    'fim-same-sentinel': 'tests/unit_tests/data/test_fim.py',
    'chat-message-rules': 'tests/unit_tests/tokenizer/test_chat_template.py',
    'dist-ckpt-truncated': 'tests/unit_tests/dist_checkpointing/test_damaged_files.py',
    'dist-ckpt-corrupt-record': 'tests/unit_tests/dist_checkpointing/test_damaged_files.py',
    'float-not-finite': 'tests/unit_tests/training/test_float_flags.py',
    'float-range': 'tests/unit_tests/training/test_float_flags.py',
    'server-untokenizable': 'tests/unit_tests/inference/test_server_routing.py',
    'server-v1-404-405': 'tests/unit_tests/inference/test_server_routing.py',
    'tracker-negative': 'tests/unit_tests/checkpointing/test_small_slips.py',
    'convert-moe-extra-expert': 'tests/unit_tests/checkpointing/test_small_slips.py',
    'wandb-broken': 'tests/unit_tests/checkpointing/test_small_slips.py',
    **{
        case: 'tests/unit_tests/training/test_rerun_state_machine.py'
        for case in ('rerun-transient', 'rerun-reproducible', 'rerun-same-device')
        + ('rerun-other-device',)
    },
    **{
        case: 'tests/unit_tests/training/test_resilience_arguments.py'
        for case in ('error-injection-disabled', 'non-persistent-type', 'non-persistent-save')
        + ('non-persistent-local-dir', 'cpu-offload', 'decrease-batch-size')
    },
    'fp16-real-nan': 'tests/functional_tests/test_fp16_default_loss_scale.py',
    'frozen-rank': 'tests/functional_tests/test_faults_torchrun.py',
    'launcher-dead': 'tests/functional_tests/test_faults_torchrun.py',
    'async-save-legacy': 'tests/functional_tests/test_dist_ckpt_errors.py',
    'dist-ckpt-zarr': 'tests/functional_tests/test_dist_ckpt_errors.py',
    'dist-optim-reshard': 'tests/functional_tests/test_dist_ckpt_errors.py',
    'dist-ckpt-moe-extended-tp': 'tests/functional_tests/test_dist_ckpt_errors.py',
    'dist-ckpt-incomplete': 'tests/unit_tests/dist_checkpointing/test_serialization.py',
    'dist-ckpt-planted': 'tests/unit_tests/dist_checkpointing/test_serialization.py',
    'dist-ckpt-absent-model-keys': 'tests/functional_tests/test_fsdp2_dist_ckpt_resume.py',
    'fsdp2-legacy-checkpoint-load': 'tests/unit_tests/checkpointing/test_checkpointing.py',
    **{
        case: 'tests/unit_tests/training/test_fsdp_arguments.py'
        for case in (
            'fsdp2-pipeline',
            'fsdp2-moe-extended-tp',
            'fsdp2-hsdp-needs-fsdp2',
            'fsdp2-hsdp-divides',
            'fsdp2-distributed-optimizer',
            'fsdp2-fp16',
            'fsdp2-legacy-checkpoint',
            'fsdp2-bf16-reduce-needs-bf16',
            'fsdp2-option-alone',
            'fsdp-both',
            'megatron-fsdp-strategy',
        )
    },
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
            'moe-cp-capacity',
            'moe-cp-sinkhorn',
            'moe-ep-stage-without-experts',
        )
    },
    **{
        case: 'tests/unit_tests/training/test_mamba_args.py'
        for case in (
            'mamba-outside',
            'mamba-legacy',
            'mamba-pattern',
            'mamba-ratios',
            'mamba-tp',
            'mamba-pp',
            'mamba-cp',
        )
    },
    'refusal-under-torchrun': 'tests/functional_tests/test_faults_torchrun.py',
    'mixed-layout': 'tests/functional_tests/test_convert_overwrite.py',
    'convert-t5-split-rank': 'tests/functional_tests/test_convert_t5.py',
    'wandb-missing': 'tests/functional_tests/test_observability.py',
    'profile-needs-cuda': 'tests/functional_tests/test_observability.py',
    'inference-prompt-too-long': 'tests/unit_tests/inference/test_dynamic_engine.py',
    'inference-kv-cache-too-small': 'tests/unit_tests/inference/test_dynamic_engine.py',
    'inference-moe-capacity': 'tests/unit_tests/inference/test_engine_moe.py',
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
    **{
        f'cp-{case}': 'tests/unit_tests/test_context_parallel_layout.py'
        for case in (
            'seq-length',
            'a2a-heads',
            'comm-type',
            'comm-type-count',
            'hierarchy-missing',
            'hierarchy-sizes',
            'reset-attention-mask',
            'tp-pp-dp-mapping',
            'sequence-parallel',
            'entry-point',
        )
    },
    'cp-mask-type': 'tests/unit_tests/transformer/test_context_parallel_attention.py',
}
#: Rows of the other entry points, exercised by the tests at the end of this file.
OTHER_ENTRY_POINTS = {
    'checkpoint-args-missing',
    'checkpoint-args-no-load',
    'server-tokenizer-files',
    'server-no-weights',
    'server-queue-limits',
    'server-batch-size',
    'server-port',
    'server-unreachable',
    'convert-target-size',
    'convert-save-dir-file',
    'convert-hf-shape',
    'convert-truncated',
    'convert-hf-tokenizer',
    'preprocess-output-dir',
    'preprocess-output-collision',
    'task-no-checkpoint',
    'task-empty-data',
    'lambada-one-word',
    't5-extra-ids',
}


def _main(argv):
    """pretrain_gpt's entry point (run_main(pretrain, ...)) -> (exit code, stdout, stderr)."""
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_gpt
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.run_control.errors import run_main
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
    here = (
        set(PRE_INIT)
        | {
            'bin-larger',
            'bin-truncated',
            'cache-corrupt',
            'checkpoint-planted',
            'empty-train-split',
            'train-iters-0',
        }
        | OTHER_ENTRY_POINTS
    )
    assert set(ids) == here | set(ELSEWHERE), sorted(set(ids) ^ (here | set(ELSEWHERE)))
    for case, path in ELSEWHERE.items():
        assert os.path.isfile(os.path.join(REPO, path)), path


# ---------------------------------------------------------------------------------------------
# the other entry points: the text generation server and its CLI, convert.py,
# preprocess_data.py, tasks/main.py, pretrain_t5.py


def _entry(main, *args, **kwargs):
    """(exit code, stdout, stderr) of run_main(main, ...), as the entry scripts call it."""
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.run_control.errors import run_main

    destroy_global_vars()
    out, err = io.StringIO(), io.StringIO()
    code = 0
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            run_main(main, *args, **kwargs)
    except SystemExit as exc:
        code = exc.code
    finally:
        destroy_global_vars()
    return code, out.getvalue(), err.getvalue()


def _server_main(argv):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        '_catalogue_server', os.path.join(REPO, 'tools', 'run_text_generation_server.py')
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return _entry(module.main, argv)


def test_server_start_up_errors(tmp_path):
    missing = str(tmp_path / 'missing')
    code, _, err = _server_main(['--use-checkpoint-args', '--load', missing])
    assert code == 1
    assert _one_error_line(err) == (
        f'error: --use-checkpoint-args: no checkpoint in --load {missing} (no '
        f'latest_checkpointed_iteration.txt there) to take --num-layers, --hidden-size, '
        f'--num-attention-heads, --max-position-embeddings from; check the --load path, or give '
        f'those flags'
    )
    code, _, err = _server_main(['--use-checkpoint-args'])
    assert (code, _one_error_line(err)) == (1, 'error: --use-checkpoint-args requires --load')
    # server-tokenizer-files: GPT-2 BPE (the server's default tokenizer) without its files.
    code, _, err = _server_main(TINY[:10] + ['--micro-batch-size', '1'])
    assert code == 1
    assert (
        _one_error_line(err)
        == 'error: --vocab-file is required for --tokenizer-type GPT2BPETokenizer'
    )
    assert not torch.distributed.is_initialized()


def test_cli_against_a_server_that_is_down():
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port = sock.getsockname()[1]  # nothing listens there once the socket is closed
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, 'tools', 'text_generation_cli.py'),
            f'127.0.0.1:{port}',
        ],
        input='Hello\n3\n',
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 1
    assert _one_error_line(proc.stderr) == (
        f'error: cannot reach the text generation server at http://127.0.0.1:{port}/api: '
        f'Connection refused; is it running?'
    )


def _convert_error(capsys, *flags):
    if os.path.join(REPO, 'tools', 'checkpoint') not in sys.path:
        sys.path.insert(0, os.path.join(REPO, 'tools', 'checkpoint'))
    import convert

    code = convert.main(['--model-type', 'GPT', *flags])
    out, err = capsys.readouterr()
    assert code == 2 and 'Starting saver' not in out, out + err
    return _one_error_line(err)


@pytest.fixture(scope='module')
def hf_dirs(tmp_path_factory):
    """A tiny Hugging Face GPT-2 directory, one with a mis-shaped c_fc.weight, one truncated, and
    a tiny Llama without tokenizer files."""
    transformers = pytest.importorskip('transformers')
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp('hf_inputs')
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=8, n_layer=1, n_head=2)
    good = str(root / 'gpt2')
    transformers.GPT2LMHeadModel(config).save_pretrained(good, safe_serialization=True)
    dirs = {'good': good}
    for name in ('shape', 'truncated'):
        dirs[name] = str(root / name)
        shutil.copytree(good, dirs[name])
    weights = os.path.join(dirs['shape'], 'model.safetensors')
    tensors = load_file(weights)
    tensors['transformer.h.0.mlp.c_fc.weight'] = torch.zeros(8, 30)
    save_file(tensors, weights, metadata={'format': 'pt'})
    weights = os.path.join(dirs['truncated'], 'model.safetensors')
    blob = open(weights, 'rb').read()
    open(weights, 'wb').write(blob[: len(blob) // 2])
    llama = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=16,
    )
    dirs['llama'] = str(root / 'llama')
    transformers.LlamaForCausalLM(llama).save_pretrained(dirs['llama'], safe_serialization=True)
    return dirs


def test_convert_errors(capsys, hf_dirs, tmp_path):
    hf = ['--loader', 'hf', '--saver', 'mcore']
    out = str(tmp_path / 'out')
    assert _convert_error(
        capsys, *hf, '--load-dir', hf_dirs['good'], '--save-dir', out,
        '--target-tensor-parallel-size', '0',
    ) == 'error: --target-tensor-parallel-size must be at least 1, got 0'  # fmt: skip
    a_file = tmp_path / 'a_file'
    a_file.write_text('')
    assert _convert_error(
        capsys, *hf, '--load-dir', hf_dirs['good'], '--save-dir', str(a_file)
    ) == (f'error: --save-dir {a_file} is a file, not a directory')
    shape_dir = hf_dirs['shape']
    assert _convert_error(capsys, *hf, '--load-dir', shape_dir, '--save-dir', out) == (
        f'error: {shape_dir}/model.safetensors: tensor h.0.mlp.c_fc.weight has shape [8, 30] but '
        f'{shape_dir}/config.json describes [8, 32]'
    )
    truncated = hf_dirs['truncated']
    assert re.fullmatch(
        rf'error: {truncated}/model.safetensors: cannot be read as safetensors \(truncated or '
        rf'corrupt\?\): .+',
        _convert_error(capsys, *hf, '--load-dir', truncated, '--save-dir', out),
    )
    llama = hf_dirs['llama']
    assert _convert_error(capsys, *hf, '--load-dir', llama, '--save-dir', out) == (
        f'error: --load-dir {llama} holds no tokenizer files (tokenizer.json, '
        f'tokenizer_config.json, tokenizer.model, or vocab.json + merges.txt): copy the model\'s '
        f'tokenizer files there, or pass --hf-tokenizer-type (e.g. --hf-tokenizer-type '
        f'GPT2BPETokenizer, then give --vocab-file and --merge-file when you start from the '
        f'checkpoint)'
    )
    assert not os.path.exists(out)


def test_convert_truncated_checkpoint_file(capsys, tmp_path):
    ckpt = str(tmp_path / 'ckpt')
    name = os.path.join(ckpt, 'iter_0000001', 'mp_rank_00', 'model_optim_rng.pt')
    os.makedirs(os.path.dirname(name))
    buffer = io.BytesIO()
    torch.save({'model': {'w': torch.zeros(1000)}, 'iteration': 1}, buffer)
    open(name, 'wb').write(buffer.getvalue()[:700])
    _tracker(ckpt, 1)
    line = _convert_error(
        capsys, '--loader', 'mcore', '--saver', 'mcore', '--load-dir', ckpt,
        '--save-dir', str(tmp_path / 'out'),
    )  # fmt: skip
    assert re.fullmatch(
        rf'error: checkpoint file {name} cannot be read \(truncated, corrupt, or not tensors and '
        rf'plain data\): .+',
        line,
    ), line


def test_preprocess_output_errors(tmp_path):
    from tests.unit_tests.data.test_preprocess_data import preprocess

    src = tmp_path / 'in.jsonl'
    src.write_text('{"text": "hello world"}\n')
    base = ['--input', str(src), '--tokenizer-type', 'GPT2BPETokenizer', '--vocab-file', VOCAB]
    base += ['--merge-file', MERGES, '--workers', '1']
    a_file = tmp_path / 'a_file'
    a_file.write_text('')
    (tmp_path / 'taken_text_document.bin').mkdir()
    cases = [
        (['--output-prefix', str(tmp_path / 'nodir' / 'out')],
         f'error: --output-prefix {tmp_path}/nodir/out: {tmp_path}/nodir does not exist'),
        (['--output-prefix', f'{a_file}/out'],
         f'error: --output-prefix {a_file}/out: {a_file} is not a directory'),
        (['--output-prefix', str(tmp_path / 'taken')],
         f'error: --output-prefix {tmp_path}/taken: {tmp_path}/taken_text_document.bin is a '
         f'directory'),
        (['--output-prefix', str(tmp_path / 'twice'), '--json-keys', 'text', 'text'],
         'error: --json-keys text text: a key is repeated, its datasets would overwrite each '
         'other'),
    ]  # fmt: skip
    for flags, message in cases:
        with pytest.raises(SystemExit) as info:
            preprocess.main(base + flags)
        assert str(info.value.code) == message
    # No temporary (nor final) file is left anywhere.
    leftovers = [p for p in os.listdir(tmp_path) if 'tmp-preprocess' in p or p.startswith('twice')]
    assert not leftovers


def _zero_shot_data(tmp_path):
    empty_wiki = tmp_path / 'wiki.test.tokens'
    empty_wiki.write_text('')
    one_word = tmp_path / 'lambada_test.jsonl'
    one_word.write_text('{"text": "The cat sat on the mat"}\n{"text": "Hello"}\n')
    return str(empty_wiki), str(one_word)


TASK_FLAGS = TINY[:10] + ['--micro-batch-size', '1', '--vocab-file', VOCAB, '--merge-file', MERGES]


def _tasks_main(argv):
    from tasks.main import main

    return _entry(main, argv)


def test_tasks_refuse_to_evaluate_random_weights(tmp_path):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    wiki, _ = _zero_shot_data(tmp_path)
    task = ['--task', 'WIKITEXT103', '--valid-data', wiki]
    code, _, err = _tasks_main(task + TASK_FLAGS)
    assert (code, _one_error_line(err)) == (
        1,
        'error: --task WIKITEXT103 evaluates a model, but no checkpoint is given: pass it with '
        '--load, or --random-weights to evaluate random weights',
    )
    missing = str(tmp_path / 'nothing')
    code, _, err = _tasks_main(task + TASK_FLAGS + ['--load', missing])
    assert (code, _one_error_line(err)) == (
        1,
        f'error: --task WIKITEXT103 evaluates a model, but --load {missing} holds no checkpoint '
        f'(no latest_checkpointed_iteration.txt); give the checkpoint to evaluate, or pass '
        f'--random-weights to evaluate random weights',
    )
    assert not torch.distributed.is_initialized()


def _tasks_in_rank(argv):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    return _tasks_main(argv)


def _t5_in_rank(argv):
    if REPO not in sys.path:
        sys.path.insert(0, REPO)
    import pretrain_t5
    from megatron.core.enums import ModelType
    from megatron.training.training import pretrain

    return _entry(
        pretrain,
        pretrain_t5.train_valid_test_datasets_provider,
        pretrain_t5.model_provider,
        ModelType.encoder_and_decoder,
        pretrain_t5.forward_step,
        args_defaults={'tokenizer_type': 'BertWordPieceLowerCase'},
        args_list=argv,
    )


def test_bad_data_and_t5_sentinels_fail_before_the_model_runs(tmp_path):
    from tests.functional_tests.t5_utils import BERT_VOCAB

    wiki, lambada = _zero_shot_data(tmp_path)
    random = TASK_FLAGS + ['--random-weights', '--distributed-backend', 'gloo']
    argv = ['--task', 'WIKITEXT103', '--valid-data', wiki] + random
    code, out, err = run_distributed(_tasks_in_rank, world_size=1, args=(argv,), timeout=600)[0]
    assert (code, _one_error_line(err)) == (
        1,
        f'error: --valid-data {wiki}: 1 word(s), 0 token(s); a perplexity needs at least 2 of each',
    )
    assert 'building GPT model' not in out
    argv = ['--task', 'LAMBADA', '--valid-data', lambada] + random
    code, out, err = run_distributed(_tasks_in_rank, world_size=1, args=(argv,), timeout=600)[0]
    assert (code, _one_error_line(err)) == (
        1,
        f"error: {lambada}: row 2: passage 'Hello' has no context before its target; a LAMBADA "
        f"passage needs at least one word before the last",
    )
    t5 = [
        '--encoder-num-layers', '1', '--decoder-num-layers', '1', '--hidden-size', '16',
        '--num-attention-heads', '2', '--encoder-seq-length', '64', '--decoder-seq-length', '32',
        '--max-position-embeddings', '64', '--micro-batch-size', '1', '--global-batch-size', '1',
        '--lr', '1e-3', '--train-iters', '1', '--vocab-file', BERT_VOCAB, '--vocab-extra-ids',
        '2', '--data-path', str(tmp_path / 'none'), '--distributed-backend', 'gloo',
    ]  # fmt: skip
    code, out, err = run_distributed(_t5_in_rank, world_size=1, args=(t5,), timeout=600)[0]
    assert (code, _one_error_line(err)) == (
        1,
        'error: --vocab-extra-ids (2) is fewer than the masked spans a T5 sample can have: up to '
        'ceil(--mask-prob 0.15 x (--encoder-seq-length 64 - 2)) = 10, one sentinel each; pass '
        '--vocab-extra-ids 10 or more (Megatron uses 100)',
    )


def _server_in_rank(argv, hold_port):
    import socket

    with socket.socket() as busy:
        busy.bind(('127.0.0.1', 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        if hold_port:
            argv = argv + ['--port', str(port)]
        return port, _server_main(argv)


def test_server_without_weights_or_port(tmp_path_factory):
    from tests.unit_tests.inference import hf_checkpoints as hc

    pytest.importorskip('transformers')
    pytest.importorskip('flask_restful')
    flags = hc.server_flags(hc.converted_checkpoint('gpt2', 1, 1, tmp_path_factory))
    no_load = flags[2:] + ['--num-layers', '1', '--hidden-size', '8', '--num-attention-heads', '2',
                           '--max-position-embeddings', '16', '--seq-length', '16']  # fmt: skip
    no_load.remove('--use-checkpoint-args')
    _, (code, _, err) = run_distributed(_server_in_rank, world_size=1, args=(no_load, False))[0]
    assert (code, _one_error_line(err)) == (
        1,
        'error: the text generation server needs --load (the checkpoint to serve); pass '
        '--random-weights to serve randomly initialized weights',
    )
    # server-queue-limits, server-batch-size: checked before the model is built.
    for extra, message in (
        (
            ['--max-waiting-requests', '4', '--max-prompts', '8'],
            'error: --max-waiting-requests (4) must be at least --max-prompts (8): a request of '
            'that many prompts must fit the queue',
        ),
        (
            ['--max-batch-size', '4', '--inference-dynamic-batching-max-requests', '8'],
            'error: --max-batch-size (4) and --inference-dynamic-batching-max-requests (8) '
            'disagree; give one of them',
        ),
    ):
        _, (code, _, err) = run_distributed(
            _server_in_rank, world_size=1, args=(flags + extra, False)
        )[0]
        assert (code, _one_error_line(err)) == (1, message)
    port, (code, _, err) = run_distributed(
        _server_in_rank, world_size=1, args=(flags + ['--host', '127.0.0.1'], True), timeout=600
    )[0]
    assert (code, _one_error_line(err)) == (
        1,
        f'error: --host 127.0.0.1 --port {port}: cannot serve there (Address already in use)',
    )
