"""tools/checkpoint/convert.py --overwrite never leaves a stale or mixed checkpoint.

- Overwriting a checkpoint of another layout leaves only the new layout's rank folders (the old
  `mp_rank_00` used to stay beside the new `mp_rank_00_000`/`_001`, and every loader read it:
  the OLD model).
- A conversion killed during an overwrite (after its first stage file is written) leaves the old
  checkpoint whole (it used to leave stage 0 new and stage 1 old under a valid tracker).
- A loader that finds rank folders of two layouts in one iteration refuses with one line.

The source is the tiny GPT-2 converted from Hugging Face; the "old" checkpoints are copies of it
with every weight shifted by 0.5, so that old and new are told apart tensor by tensor.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.inference import hf_checkpoints as hc

pytest.importorskip("transformers")


def _shift_weights(ckpt_dir, delta=0.5):
    """Add `delta` to every floating-point tensor of every rank file (in place)."""
    from megatron.training.checkpoint.checkpoint_conversion import torch_load_weights_only

    for root, _, files in os.walk(ckpt_dir):
        for name in files:
            if name == 'model_optim_rng.pt':
                path = os.path.join(root, name)
                state = torch_load_weights_only(path, mmap=False)
                for key, tensor in state['model'].items():
                    if isinstance(tensor, torch.Tensor) and tensor.is_floating_point():
                        state['model'][key] = tensor + delta
                torch.save(state, path)


def _same_model(a, b):
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def _rank_folders(ckpt_dir):
    return sorted(os.listdir(os.path.join(ckpt_dir, 'iter_0000001')))


def _overwrite(source, target, pp):
    return (
        '--loader', 'mcore', '--saver', 'mcore', '--load-dir', source, '--save-dir', target,
        '--target-tensor-parallel-size', '1', '--target-pipeline-parallel-size', str(pp),
        '--overwrite',
    )  # fmt: skip


@pytest.fixture(scope='module')
def source(tmp_path_factory):
    """(the converted TP1 checkpoint, its full model, the same model converted to PP2)."""
    path = hc.converted_checkpoint('gpt2', 1, 1, tmp_path_factory)
    pp2 = str(tmp_path_factory.mktemp('overwrite') / 'pp2')
    cu.convert(*_overwrite(path, pp2, pp=2)[:-1])
    return path, cu.full_model(path)[0], pp2


def test_overwrite_with_another_layout_leaves_only_the_new_one(source, tmp_path):
    src, new_model, _ = source
    target = str(tmp_path / 'ckpt')
    shutil.copytree(src, target)
    _shift_weights(target)  # the old model, TP1 x PP1 (mp_rank_00)
    old_model = cu.full_model(target)[0]
    assert not _same_model(old_model, new_model)

    cu.convert(*_overwrite(src, target, pp=2))
    assert _rank_folders(target) == ['mp_rank_00_000', 'mp_rank_00_001']
    assert sorted(os.listdir(target)) == ['iter_0000001', 'latest_checkpointed_iteration.txt']
    got, reader = cu.full_model(target)
    assert reader.pp == 2
    got.pop('output_layer.weight (copy)')
    assert _same_model(got, new_model)


def _stage0_files(root):
    for path, _, files in os.walk(root):
        if os.path.basename(path) == 'mp_rank_00_000' and 'model_optim_rng.pt' in files:
            yield os.path.join(path, 'model_optim_rng.pt')


def test_conversion_killed_during_an_overwrite_leaves_the_old_checkpoint(source, tmp_path):
    src, new_model, pp2 = source
    target = str(tmp_path / 'ckpt')
    shutil.copytree(pp2, target)
    _shift_weights(target)  # the old model, PP2
    old_model, _ = cu.full_model(target)
    old_stage0 = {os.stat(p).st_ino for p in _stage0_files(target)}

    proc = subprocess.Popen(
        [sys.executable, cu.CONVERT, '--model-type', 'GPT', *_overwrite(src, target, pp=2)],
        cwd=cu.REPO,
        env=dict(os.environ, PYTHONPATH=cu.REPO),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.time() + 300
        # Kill it as soon as the first new stage file exists (stage 1 is not written yet).
        while time.time() < deadline and proc.poll() is None:
            if any(os.stat(p).st_ino not in old_stage0 for p in _stage0_files(target)):
                break
            time.sleep(0.001)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(30)

    # A reader sees the old checkpoint or the new one, whole: never stage 0 new, stage 1 old.
    got, _ = cu.full_model(target)
    got.pop('output_layer.weight (copy)')
    old_model.pop('output_layer.weight (copy)', None)
    assert _same_model(got, old_model) or _same_model(got, new_model)
    # A later conversion clears what the killed one left behind.
    cu.convert(*_overwrite(src, target, pp=2))
    assert sorted(os.listdir(target)) == ['iter_0000001', 'latest_checkpointed_iteration.txt']


def test_loaders_refuse_rank_folders_of_two_layouts(source, tmp_path, capsys):
    from megatron.training.checkpointing import load_args_from_checkpoint

    sys.path.insert(0, os.path.join(cu.REPO, 'tools', 'checkpoint'))
    import convert

    src, _, pp2 = source
    mixed = str(tmp_path / 'mixed')
    shutil.copytree(pp2, mixed)
    shutil.copytree(
        os.path.join(src, 'iter_0000001', 'mp_rank_00'),
        os.path.join(mixed, 'iter_0000001', 'mp_rank_00'),
    )
    message = (
        f'checkpoint directory {mixed}/iter_0000001 holds rank folders of more than one parallel '
        f'layout (mp_rank_00, mp_rank_00_000, mp_rank_00_001); its args record TP1 x PP1 (1 rank '
        f'folders): another layout was written over it in place, so its files mix two models; '
        f'write the checkpoint again into an empty directory'
    )
    # The converter (before any process starts) ...
    flags = ['--loader', 'mcore', '--saver', 'mcore', '--load-dir', mixed]
    code = convert.main(['--model-type', 'GPT', *flags, '--save-dir', str(tmp_path / 'out')])
    assert code == 2 and capsys.readouterr().err.strip() == 'error: ' + message
    # ... and the training / server loader (--use-checkpoint-args reads the rank-0 file).
    args = argparse.Namespace(load=mixed, ckpt_step=None)
    with pytest.raises(ValueError) as info:
        load_args_from_checkpoint(args)
    assert str(info.value) == message
