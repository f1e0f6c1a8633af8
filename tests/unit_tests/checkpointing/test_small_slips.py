"""Small checks of the checkpoint readers: a tracker file holding a negative iteration is refused;
a Mixtral directory with an expert the config does not describe stops at the header check (the
convert loaders' check, answered with exit 2), as a missing or mis-shaped expert does."""

import json

import pytest
import torch

from megatron.training.checkpoint.checkpoint_layout import _parse_tracker
from megatron.training.checkpoint.hf_checkpoint_moe import check_moe_hf_tensors


@pytest.mark.parametrize('text,ok', [('7', True), ('release', True), ('-3', False), ('0', True)])
def test_tracker_iteration_must_not_be_negative(tmp_path, text, ok):
    tracker = tmp_path / 'latest_checkpointed_iteration.txt'
    tracker.write_text(text)
    if ok:
        _parse_tracker(str(tracker))
        return
    with pytest.raises(ValueError, match=rf'^invalid metadata file {tracker}: iteration -3 is'):
        _parse_tracker(str(tracker))


def test_extra_mixtral_expert_is_refused_by_the_header_check(tmp_path):
    transformers = pytest.importorskip('transformers')
    safetensors_torch = pytest.importorskip('safetensors.torch')
    config = transformers.MixtralConfig(
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        vocab_size=64,
    )
    torch.manual_seed(0)
    transformers.MixtralForCausalLM(config).save_pretrained(str(tmp_path), safe_serialization=True)
    config_dict = json.loads((tmp_path / 'config.json').read_text())
    check_moe_hf_tensors(str(tmp_path), config_dict)  # the genuine directory passes
    path = tmp_path / 'model.safetensors'
    tensors = safetensors_torch.load_file(str(path))
    name = 'model.layers.1.block_sparse_moe.experts.4.w1.weight'
    tensors[name] = torch.zeros(48, 32)
    safetensors_torch.save_file(tensors, str(path), metadata={'format': 'pt'})
    with pytest.raises(ValueError) as info:
        check_moe_hf_tensors(str(tmp_path), config_dict)
    assert str(info.value) == (
        f'--load-dir {tmp_path}: expert weight {name} is not described by the config (4 experts '
        'per layer; 1 such weight(s))'
    )


def test_wandb_failing_on_import_is_one_line(tmp_path, monkeypatch):
    import argparse
    import sys

    from megatron.training.validation.observability_args import _validate_wandb_args

    package = tmp_path / 'wandb'
    package.mkdir()
    (package / '__init__.py').write_text(
        "raise ImportError('libfoo.so: cannot open shared object')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, 'wandb', raising=False)
    args = argparse.Namespace(wandb_project='p', wandb_exp_name='e', wandb_save_dir='d', save=None)
    with pytest.raises(ValueError) as info:
        _validate_wandb_args(args)
    assert str(info.value).startswith(
        '--wandb-project p: the wandb package fails on import (ImportError: libfoo.so: cannot '
        'open shared object)'
    )
    monkeypatch.delitem(sys.modules, 'wandb', raising=False)
