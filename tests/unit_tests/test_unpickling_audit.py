"""Every place the product unpickles is restricted, and each loader refuses a planted pickle.

- A scan of the product's source (megatron/, tools/, tasks/, the entry scripts): every
  `torch.load` passes `weights_only=True`, every `numpy.load` `allow_pickle=False`, and the only
  `pickle.Unpickler` is the DCP metadata one; no `pickle.load(s)` anywhere.
- Each weights-only loader (common.pt and stored objects, legacy checkpoint files, convert.py's
  reader, the distributed optimizer's parameter-state file) refuses a zip whose data.pkl is
  planted (a `getattr` chain to `os.system`, a path method, `builtins.eval`,
  `functools.partial`), with one line naming the file, and the planted command never runs.
"""

import ast
import pathlib
import zipfile

import pytest
import torch

from megatron.core.dist_checkpointing.safe_load import weights_only_load
from megatron.training import checkpointing
from megatron.training.checkpoint import checkpoint_conversion
from tests.unit_tests.dist_checkpointing.test_metadata_unpickler import _pickle, _planted

REPO = pathlib.Path(__file__).resolve().parents[2]
METADATA_UNPICKLER = 'megatron/core/dist_checkpointing/strategies/metadata_unpickler.py'


def _product_files():
    for top in ('megatron', 'tools', 'tasks'):
        yield from sorted((REPO / top).rglob('*.py'))
    yield from sorted(REPO.glob('pretrain_*.py'))


def _call_name(node):
    func = node.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
        return f'{func.value.id}.{func.attr}'
    if isinstance(func, ast.Attribute):
        return func.attr
    return getattr(func, 'id', '')


def _keyword(node, name):
    for kw in node.keywords:
        if kw.arg == name and isinstance(kw.value, ast.Constant):
            return kw.value.value
    return None


def test_every_unpickling_call_is_restricted():
    problems = []
    for path in _product_files():
        rel = path.relative_to(REPO).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if isinstance(node, ast.ClassDef):
                bases = {getattr(b, 'attr', getattr(b, 'id', '')) for b in node.bases}
                if 'Unpickler' in bases and rel != METADATA_UNPICKLER:
                    problems.append(f'{rel}:{node.lineno} defines an Unpickler')
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            where = f'{rel}:{node.lineno} {name}'
            if name == 'torch.load' and _keyword(node, 'weights_only') is not True:
                problems.append(f'{where} without weights_only=True')
            if name in ('numpy.load', 'np.load') and _keyword(node, 'allow_pickle') is not False:
                problems.append(f'{where} without allow_pickle=False')
            if name in ('pickle.load', 'pickle.loads', 'marshal.loads', 'dill.load'):
                problems.append(where)
    assert not problems, problems


def _plant(path, kind, marker):
    """A torch.save zip whose data.pkl is replaced by a planted pickle."""
    torch.save({'iteration': 3}, path)
    with zipfile.ZipFile(path) as src:
        entries = {info.filename: src.read(info) for info in src.infolist()}
    with zipfile.ZipFile(path, 'w', zipfile.ZIP_STORED) as dst:
        for name, data in entries.items():
            if name.endswith('/data.pkl'):
                data = _pickle(_planted(kind, marker))
            dst.writestr(name, data)


def _loaders():
    return {
        'common.pt': lambda p: weights_only_load(p, what=p),
        'model_optim_rng.pt': checkpointing._torch_load,
        'convert.py reader': checkpoint_conversion.torch_load_weights_only,
        'distrib_optim.pt': lambda p: weights_only_load(p, what=p, mmap=True),
    }


@pytest.mark.parametrize('payload', ['getattr-globals', 'path-method', 'eval', 'partial'])
def test_weights_only_loaders_refuse_planted_files(tmp_path, payload):
    marker = tmp_path / 'marker'
    path = str(tmp_path / 'planted.pt')
    _plant(path, payload, marker)
    for name, load in _loaders().items():
        with pytest.raises(Exception) as info:
            load(path)
        message = str(info.value)
        if name != 'model_optim_rng.pt':  # its caller adds the file name (checkpointing.py)
            assert path in message and '\n' not in message, (name, message)
        assert not marker.exists(), f'{name}: the planted call ran'
