"""--head-lr-mult: the vision head's parameters get lr x mult in the optimizer (as Megatron's
vision finetuning does), nothing else is scaled, and the flag is refused where there is no head;
--vit-layout hf is refused outside the classifier."""

import argparse

import pytest
import torch

from megatron.training.training import head_lr_scaling, is_head_parameter
from tests.unit_tests.dist_utils import run_distributed


def _groups(mult):
    from megatron.core.optimizer import _get_param_groups
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.legacy.model.vision.classification import VitClassificationModel

    config = TransformerConfig(
        num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True
    )
    model = VitClassificationModel(config, 10, img_h=8, img_w=8, patch_dim=4, num_channels=1)
    wrapped = torch.nn.ModuleDict({'module': model})  # the 'module.' prefix of the DDP wrapper
    cond, lr_mult = head_lr_scaling(argparse.Namespace(head_lr_mult=mult))
    groups = _get_param_groups([wrapped], None, cond, lr_mult, lr=1e-3, min_lr=1e-4)
    head = {id(p) for p in model.head.parameters()}
    return [
        (group['lr_mult'], sorted({id(p) in head for p in group['params']})) for group in groups
    ]


def test_only_the_head_gets_the_multiplier():
    groups = run_distributed(_groups, world_size=1, args=(0.1,))[0]
    assert sorted(groups) == [(0.1, [True]), (0.1, [True]), (1.0, [False]), (1.0, [False])]
    assert all(mult == 1.0 for mult, _ in run_distributed(_groups, world_size=1, args=(1.0,))[0])


def test_head_parameter_names():
    assert is_head_parameter('module.head.dense_in.weight', None)
    assert is_head_parameter('module.student.head.last_layer.weight_g', None)
    assert not is_head_parameter('module.backbone.decoder.layers.0.mlp.linear_fc1.weight', None)
    assert not is_head_parameter('module.lm_head.weight', None)


def _validate(extra, vision=True):
    from megatron.training.arguments import parse_args, validate_args

    base = '--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 '
    base += '--max-position-embeddings 16 --micro-batch-size 2 --train-iters 4 --lr 1e-3 '
    base += '--img-h 8 --img-w 8 --patch-dim 2 --num-classes 10'
    args = parse_args(args_list=base.split() + extra)
    args.world_size, args.rank = 1, 0
    return validate_args(args, {'vision_pretraining': True} if vision else {})


@pytest.mark.parametrize(
    'extra, vision, message',
    [
        (['--head-lr-mult', '2'], False, '--head-lr-mult 2.0 scales the learning rate of a vision'),
        (['--head-lr-mult', '-1'], True, '--head-lr-mult must be >= 0 and finite, got -1.0'),
        (
            ['--head-lr-mult', '2', '--vision-pretraining-type', 'inpaint'],
            True,
            'the inpainting model has no head',
        ),
        (['--vit-layout', 'hf'], False, '--vit-layout hf needs pretrain_vision_classify.py'),
        (
            ['--vit-layout', 'hf', '--vision-pretraining-type', 'dino'],
            True,
            "--vit-layout hf is the classifier's layout",
        ),
    ],
)
def test_refusals(extra, vision, message):
    with pytest.raises(ValueError, match=message):
        _validate(extra, vision)


def test_accepted_for_classification():
    assert _validate(['--head-lr-mult', '10']).head_lr_mult == 10.0
