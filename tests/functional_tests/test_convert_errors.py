"""tools/checkpoint/convert.py refuses bad requests in one line, before any process starts or
any tensor is read: target TP not dividing the heads, target PP not dividing the layers, a
partial source, an unsupported Hugging Face architecture, a save directory that already holds a
checkpoint (unless --overwrite), vocabulary sizes that disagree with the checkpoint's table.
"""

import json
import os
import shutil
import sys

import pytest

from tests.functional_tests import convert_utils as cu

sys.path.insert(0, os.path.join(cu.REPO, 'tools', 'checkpoint'))
import convert  # noqa: E402


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    path = str(tmp_path_factory.mktemp('convert_errors') / 'src')
    layout = ['--tensor-model-parallel-size', '2', '--pipeline-model-parallel-size', '2']
    cu.make_source_checkpoint(path, cu.GPT_ARCH, layout, world_size=4, tp=2, pp=2, iters=2)
    return path


def _error(capsys, *flags):
    code = convert.main(['--model-type', 'GPT', *flags])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert 'Starting saver' not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


def test_target_layout_errors(capsys, source, tmp_path):
    save = ['--load-dir', source, '--save-dir', str(tmp_path / 'out')]
    assert _error(
        capsys, '--loader', 'mcore', '--saver', 'mcore', *save, '--target-tensor-parallel-size', '8'
    ) == (
        'error: --target-tensor-parallel-size 8 does not divide the number of attention heads (4)'
    )
    assert _error(capsys, *save, '--target-pipeline-parallel-size', '3') == (
        'error: --target-pipeline-parallel-size 3 does not divide the number of layers (4)'
    )
    assert not os.path.exists(tmp_path / 'out')


def test_partial_source(capsys, source, tmp_path):
    partial = str(tmp_path / 'partial')
    shutil.copytree(source, partial)
    os.remove(os.path.join(partial, 'iter_0000002', 'mp_rank_01_001', 'model_optim_rng.pt'))
    line = _error(capsys, '--load-dir', partial, '--save-dir', str(tmp_path / 'out'))
    assert line == (
        'error: --load-dir {}: partial checkpoint, 1 of 4 rank files of its TP2 x PP2 '
        'layout are missing: iter_0000002/mp_rank_01_001/model_optim_rng.pt'
    ).format(partial)
    assert _error(capsys, '--load-dir', str(tmp_path), '--save-dir', str(tmp_path / 'o')) == (
        f'error: --load-dir {tmp_path}: no checkpoint there (no latest_checkpointed_iteration.txt)'
    )


def test_existing_save_dir_needs_overwrite(capsys, source, tmp_path):
    assert _error(capsys, '--load-dir', source, '--save-dir', source) == (
        f'error: --save-dir {source} already holds a checkpoint '
        f'(latest_checkpointed_iteration.txt); pass --overwrite to replace it'
    )


def test_vocab_size_disagreeing_with_the_checkpoint(capsys, source, tmp_path):
    save = ['--load-dir', source, '--save-dir', str(tmp_path / 'out')]
    assert _error(capsys, *save, '--true-vocab-size', '5000') == (
        'error: --true-vocab-size gives a vocabulary of 5000, which pads to 5120 at TP 2 '
        '(--make-vocab-size-divisible-by 128), but the checkpoint\'s embedding table has 4096 rows'
    )
    vocab = str(tmp_path / 'vocab.json')
    with open(vocab, 'w') as f:
        json.dump({'a': 0, 'b': 1}, f)
    assert _error(capsys, *save, '--vocab-file', vocab).startswith(
        f'error: --vocab-file {vocab} gives a vocabulary of 2, which pads to 256 at TP 2'
    )


def test_unsupported_hf_architecture(capsys, tmp_path):
    hf_dir = tmp_path / 'bert'
    hf_dir.mkdir()
    (hf_dir / 'config.json').write_text(
        json.dumps({'model_type': 'bert', 'architectures': ['BertForMaskedLM']})
    )
    assert _error(
        capsys,
        '--loader',
        'hf',
        '--saver',
        'mcore',
        '--load-dir',
        str(hf_dir),
        '--save-dir',
        str(tmp_path / 'out'),
    ) == (
        "error: Hugging Face config: unsupported architecture model_type='bert' "
        "(architectures ['BertForMaskedLM']); supported: gpt2, llama, mistral, qwen2, qwen3, "
        "mixtral, qwen2_moe, qwen3_moe, deepseek_v3"
    )


def test_unknown_plugin(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        convert.main(
            [
                '--model-type',
                'GPT',
                '--loader',
                'nope',
                '--load-dir',
                str(tmp_path),
                '--save-dir',
                str(tmp_path),
            ]
        )
    assert str(exc.value) == 'Unable to load loader plugin nope. Exiting.'


def _saver_args(source, save_dir, checking=True):
    parser = convert.build_parser()
    import loader_mcore
    import saver_mcore

    loader_mcore.add_arguments(parser)
    saver_mcore.add_arguments(parser)
    argv = ['--model-type', 'GPT', '--load-dir', source, '--save-dir', save_dir]
    args = parser.parse_args(argv + ([] if checking else ['--no-checking']))
    return args, loader_mcore.check_arguments(args), saver_mcore


def test_saver_checks_message_names_and_leftover_keys(capsys, source, tmp_path):
    """Megatron's saver-side protocol checks, on a queue filled by hand."""
    import queue

    import torch

    args, md, saver = _saver_args(source, str(tmp_path / 'out'))
    q = queue.Queue()
    q.put(md)
    q.put({'name': 'transformer layer 0'})
    with pytest.raises(SystemExit) as exc:
        saver.save_checkpoint(q, args)
    assert exc.value.code == 1
    assert capsys.readouterr().out.strip().splitlines()[-1] == (
        'Unexpected message. Expecting "embeddings" but got "transformer layer 0". Exiting saver.'
    )

    q = queue.Queue()
    q.put(md)
    q.put({'name': 'embeddings', 'word embeddings': torch.zeros(4096, 32),
           'position embeddings': torch.zeros(16, 32), 'stray': torch.zeros(1)})  # fmt: skip
    with pytest.raises(SystemExit):
        saver.save_checkpoint(q, args)
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-3:] == [
        'Unexpected values in embeddings:',
        '   stray',
        'Exiting. If you want to ignore this, use the argument --no-checking.',
    ]

    q = queue.Queue()
    q.put('exit')
    with pytest.raises(SystemExit):
        saver.save_checkpoint(q, args)
    assert capsys.readouterr().out.strip().splitlines()[-1] == 'Loader exited, exiting saver'
    assert not os.path.exists(tmp_path / 'out' / 'latest_checkpointed_iteration.txt')


def test_saver_stops_when_its_loader_process_is_gone(capsys, monkeypatch):
    """A loader killed outright sends no "exit": the waiting saver notices that its parent is
    gone (here: a loader pid that is not its parent) and exits instead of waiting forever."""
    import queue

    import utils  # tools/checkpoint/utils.py

    monkeypatch.setattr(utils, 'LOADER_POLL_S', 0.05)
    monkeypatch.setattr(utils, '_LOADER_PID', os.getppid() + 1)
    with pytest.raises(SystemExit) as exc:
        utils.queue_get(queue.Queue(), 'embeddings')
    assert exc.value.code == 1
    assert capsys.readouterr().out.strip().endswith('is gone, exiting saver')
    # The loader alive (it is this process's parent): the saver keeps waiting, then reads.
    monkeypatch.setattr(utils, '_LOADER_PID', os.getppid())
    q = queue.Queue()
    q.put({'name': 'embeddings'})
    assert utils.queue_get(q, 'embeddings') == {'name': 'embeddings'}
