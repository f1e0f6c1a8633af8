"""A planted torch_dist `.metadata` never reaches a callable; genuine metadata still loads.

Each planted pickle is assembled opcode by opcode (protocol 2) and would create a marker file if
any of its calls ran. Reading it must fail with one line naming the file, and leave the real DCP
classes untouched.
"""

import os
import pickle
import shutil
import struct

import pytest
import torch
from torch.distributed.checkpoint import metadata as dcp_metadata

from megatron.core.dist_checkpointing.mapping import CheckpointingException
from megatron.core.dist_checkpointing.strategies.torch import read_metadata

FIXTURE = os.path.join(os.path.dirname(__file__), 'fixtures', 'mcore08_gpt', 'iter_0000001')
DCP = 'torch.distributed.checkpoint.metadata'


def _glob(module, name):
    return b'c' + module.encode() + b'\n' + name.encode() + b'\n'


def _str(text):
    data = text.encode()
    return b'X' + struct.pack('<I', len(data)) + data


def _call(fn, *args):
    return fn + b'(' + b''.join(args) + b't' + b'R'


def _getattr(obj, name):
    return _call(_glob('builtins', 'getattr'), obj, _str(name))


def _pickle(body):
    return b'\x80\x02' + body + b'.'


def _planted(kind, marker):
    command = _str(f'touch {marker}')
    if kind == 'getattr-globals':  # PosixPath.exists.__globals__.get('os').system(...)
        init_globals = _getattr(_getattr(_glob('pathlib', 'PosixPath'), 'exists'), '__globals__')
        os_module = _call(_getattr(init_globals, 'get'), _str('os'))
        return _call(_getattr(os_module, 'system'), command)
    if kind == 'path-method':  # PosixPath(marker).touch()
        return _call(_getattr(_call(_glob('pathlib', 'PosixPath'), _str(str(marker))), 'touch'))
    if kind == 'eval':
        return _call(_glob('builtins', 'eval'), _str(f"__import__('os').system('touch {marker}')"))
    if kind == 'exec':
        return _call(_glob('builtins', 'exec'), _str(f"__import__('os').system('touch {marker}')"))
    if kind == 'os-system':
        return _call(_glob('os', 'system'), command)
    if kind == 'posix-system':
        return _call(_glob('posix', 'system'), command)
    if kind == 'partial':
        return _call(_call(_glob('functools', 'partial'), _glob('os', 'system'), command))
    if kind == 'torch-attribute':  # a torch global that is not a dtype
        return _call(_glob('torch', 'load'), _str(str(marker)))
    if kind == 'build-on-allowed-class':  # overwrite TensorProperties.__setstate__ via BUILD
        state = b'(N}' + _str('__setstate__') + _glob('torch', 'Size') + b's' + b't'
        return _glob(DCP, 'TensorProperties') + state + b'b'
    if kind == 'reduce-allowed-class-hostile-args':  # Metadata(<a class object>)
        return _call(_glob(DCP, 'Metadata'), _glob(DCP, 'StorageMeta'))
    if kind == 'size-of-objects':
        return _call(_glob('torch', 'Size'), b'(' + _glob(DCP, 'Metadata') + b'l')
    if kind == 'layout-lookup':
        return _call(_glob('torch.serialization', '_get_layout'), _str('os.system'))
    if kind == 'persistent-id':
        return b'P' + b'x\n'
    raise AssertionError(kind)


KINDS = [
    'getattr-globals',
    'path-method',
    'eval',
    'exec',
    'os-system',
    'posix-system',
    'partial',
    'torch-attribute',
    'build-on-allowed-class',
    'reduce-allowed-class-hostile-args',
    'size-of-objects',
    'layout-lookup',
    'persistent-id',
]


@pytest.mark.parametrize('kind', KINDS)
def test_planted_metadata_reaches_no_callable(tmp_path, kind):
    marker = tmp_path / 'marker'
    ckpt = tmp_path / 'ckpt'
    ckpt.mkdir()
    path = ckpt / '.metadata'
    path.write_bytes(_pickle(_planted(kind, marker)))
    setstate = dcp_metadata.TensorProperties.__setstate__
    with pytest.raises(CheckpointingException) as info:
        read_metadata(str(ckpt))
    message = str(info.value)
    assert message.startswith(f'{path} cannot be read: '), message
    assert '\n' not in message
    assert not marker.exists(), 'the planted call ran'
    assert dcp_metadata.TensorProperties.__setstate__ is setstate


def test_genuine_metadata_loads_equal_to_plain_pickle(tmp_path):
    ckpt = tmp_path / 'ckpt'
    shutil.copytree(FIXTURE, ckpt)
    loaded = read_metadata(str(ckpt))
    with open(ckpt / '.metadata', 'rb') as f:
        plain = pickle.load(f)
    assert isinstance(loaded, dcp_metadata.Metadata)
    assert loaded.state_dict_metadata == plain.state_dict_metadata
    assert loaded.storage_data == plain.storage_data
    assert loaded.planner_data == plain.planner_data
    dtypes = {m.properties.dtype for m in loaded.state_dict_metadata.values() if hasattr(m, 'size')}
    assert torch.float32 in dtypes


def test_truncated_metadata_names_the_file(tmp_path):
    ckpt = tmp_path / 'ckpt'
    shutil.copytree(FIXTURE, ckpt)
    data = (ckpt / '.metadata').read_bytes()
    (ckpt / '.metadata').write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointingException, match=r'\.metadata cannot be read: '):
        read_metadata(str(ckpt))
