"""Nothing the product reads from disk can execute code: a pickle planted in each kind of file
(dataset cache `.npy`, checkpoint, the args inside a checkpoint read by --use-checkpoint-args) is
refused with a message naming the file, and the planted command never runs (it would create a
marker file)."""

import argparse
import os

import numpy
import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset
from megatron.core.datasets.index_cache import CorruptCacheError
from megatron.core.datasets.utils import get_blend_from_list
from megatron.training import checkpointing
from tests.unit_tests.data.test_gpt_dataset import _config, corpus  # noqa: F401 (fixture)


class _Planted:
    """Unpickling this runs `touch <marker>`."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f'touch {self.marker}',))


def _build(cfg, sizes=(40, 8, 4)):
    return BlendedMegatronDatasetBuilder(GPTDataset, list(sizes), lambda: True, cfg).build()


def _cache_file(cache, suffix, split='train'):
    names = [n for n in os.listdir(cache) if n.endswith(f'-{split}-{suffix}')]
    assert len(names) == 1, names
    return os.path.join(cache, names[0])


@pytest.mark.parametrize('kind', ['pickle', 'object-array', 'truncated', 'wrong-rank'])
def test_planted_gpt_cache_file_is_refused(corpus, tmp_path, kind):  # noqa: F811
    cache = tmp_path / 'cache'
    marker = tmp_path / 'marker'
    cfg = _config(corpus, cache, split='90,8,2')
    _build(cfg)
    target = _cache_file(cache, 'document_index.npy')
    if kind == 'pickle':  # what Megatron's numpy.load(allow_pickle=True) would execute
        with open(target, 'wb') as f:
            import pickle

            pickle.dump(_Planted(marker), f)
    elif kind == 'object-array':
        numpy.save(target, numpy.array([_Planted(marker)], dtype=object), allow_pickle=True)
    elif kind == 'truncated':
        data = open(target, 'rb').read()
        open(target, 'wb').write(data[: len(data) // 2])
    else:
        numpy.save(target, numpy.zeros((3, 2), dtype=numpy.int32))
    with pytest.raises(
        CorruptCacheError,
        match=rf'dataset cache file {target} is corrupt or was '
        rf'not written by Megatron .*delete it',
    ):
        _build(cfg)
    assert not marker.exists(), 'the planted command ran'


def test_planted_blended_cache_file_is_refused(corpus, tmp_path):  # noqa: F811
    cache = tmp_path / 'cache'
    marker = tmp_path / 'marker'
    blend = get_blend_from_list(['0.3', corpus.fortunes, '0.7', corpus.moby])
    cfg = _config(corpus, cache, blend=blend, split='80,10,10')
    _build(cfg, (100, 20, 6))
    names = [n for n in os.listdir(cache) if n.endswith('BlendedDataset-train-dataset_index.npy')]
    target = os.path.join(cache, names[0])
    numpy.save(target, numpy.array([_Planted(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(CorruptCacheError, match=rf'dataset cache file {target} is corrupt'):
        _build(cfg, (100, 20, 6))
    assert not marker.exists()


def _plant_checkpoint(ckpt_dir, payload):
    name = os.path.join(ckpt_dir, 'iter_0000002', 'mp_rank_00', 'model_optim_rng.pt')
    os.makedirs(os.path.dirname(name))
    torch.save(payload, name)
    with open(os.path.join(ckpt_dir, 'latest_checkpointed_iteration.txt'), 'w') as f:
        f.write('2')
    return name


def test_planted_checkpoint_is_refused(tmp_path):
    marker = tmp_path / 'marker'
    name = _plant_checkpoint(
        str(tmp_path / 'ckpt'), {'model': {'w': torch.ones(2)}, 'rng_state': _Planted(marker)}
    )
    with pytest.raises(
        ValueError,
        match=rf'checkpoint file {name} cannot be loaded as weights '
        rf'only .*unsupported GLOBAL posix.system',
    ):
        checkpointing._load_base_checkpoint(str(tmp_path / 'ckpt'), rank0=True)
    assert not marker.exists()


def test_planted_args_are_refused(tmp_path):
    """--use-checkpoint-args reads the args before anything else: a planted object there."""
    marker = tmp_path / 'marker'
    name = _plant_checkpoint(str(tmp_path / 'ckpt'), {'args': _Planted(marker), 'iteration': 2})
    args = argparse.Namespace(load=str(tmp_path / 'ckpt'), ckpt_step=None)
    with pytest.raises(ValueError, match=rf'checkpoint file {name} cannot be loaded'):
        checkpointing.load_args_from_checkpoint(args)
    assert not marker.exists()
    # The same file with plain args loads: the refusal is about the planted object only.
    _plant_checkpoint(
        str(tmp_path / 'ok'),
        {'args': argparse.Namespace(num_layers=3), 'iteration': 2, 'checkpoint_version': 3.0},
    )
    args = argparse.Namespace(load=str(tmp_path / 'ok'), ckpt_step=None, num_layers=None)
    checkpointing.load_args_from_checkpoint(args)
    assert args.num_layers == 3
