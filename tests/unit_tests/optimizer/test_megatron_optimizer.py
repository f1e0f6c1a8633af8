"""Megatron optimizer wrappers: global grad norm at TP=2, fp16 loss scaling, bf16/fp16 fp32 main
params, weight-decay param groups."""

import copy

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.model_parallel_config import ModelParallelConfig
from megatron.core.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.utils import init_method_normal
from tests.unit_tests.dist_utils import run_distributed


def _all_gather_cat(tensor, dim):
    group = parallel_state.get_tensor_model_parallel_group()
    parts = [torch.empty_like(tensor) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _tp_grad_norm(clip_grad):
    """TP=2 column+row parallel MLP, a replicated norm and a tied (shared) weight."""
    config = ModelParallelConfig(tensor_model_parallel_size=2, use_cpu_initialization=True)
    torch.manual_seed(5)
    init = init_method_normal(0.5)
    col = ColumnParallelLinear(
        8,
        12,
        config=config,
        init_method=init,
        bias=True,
        gather_output=False,
        keep_master_weight_for_test=True,
    )
    row = RowParallelLinear(
        12,
        6,
        config=config,
        init_method=init,
        bias=True,
        input_is_parallel=True,
        skip_bias_add=False,
        keep_master_weight_for_test=True,
    )
    norm = torch.nn.LayerNorm(6)
    shared = torch.nn.Parameter(torch.randn(6))
    shared.shared = True  # the last stage's copy of a tied embedding: excluded from the norm
    x = torch.randn(4, 1, 8)

    # Unsharded reference with the same weights.
    ref_col = torch.nn.Linear(8, 12)
    ref_row = torch.nn.Linear(12, 6)
    with torch.no_grad():
        ref_col.weight.copy_(col.master_weight)
        ref_col.bias.copy_(_all_gather_cat(col.bias.detach(), 0))
        ref_row.weight.copy_(row.master_weight)
        ref_row.bias.copy_(row.bias.detach())
    ref_norm_layer = copy.deepcopy(norm)
    ref_shared = torch.nn.Parameter(shared.detach().clone())

    def forward(c, r, n, s):
        hidden = torch.nn.functional.gelu(c(x)[0] if isinstance(c(x), tuple) else c(x))
        out = r(hidden)
        out = out[0] if isinstance(out, tuple) else out
        return (n(out) * s).pow(2).mean()

    forward(col, row, norm, shared).backward()
    forward(ref_col, ref_row, ref_norm_layer, ref_shared).backward()

    # Some exact zeros, mirrored in the reference (rows 0 and 6 of the master are rank 0/1 row 0).
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    col.weight.grad[0, :3] = 0.0
    row.bias.grad[:2] = 0.0
    ref_col.weight.grad[0, :3] = 0.0
    ref_col.weight.grad[6, :3] = 0.0
    ref_row.bias.grad[:2] = 0.0

    ref_params = (
        list(ref_col.parameters()) + list(ref_row.parameters()) + list(ref_norm_layer.parameters())
    )
    ref_norm = torch.sqrt(sum(p.grad.double().pow(2).sum() for p in ref_params)).item()
    ref_zeros = sum(int((p.grad == 0).sum()) for p in ref_params)

    module = torch.nn.ModuleList([col, row, norm])
    module.register_parameter('shared', shared)
    opt_config = OptimizerConfig(
        optimizer='sgd',
        lr=0.1,
        sgd_momentum=0.0,
        weight_decay=0.0,
        clip_grad=clip_grad,
        log_num_zeros_in_grad=True,
    )
    optimizer = get_megatron_optimizer(opt_config, [module])
    assert isinstance(optimizer, FP32Optimizer)
    success, grad_norm, num_zeros = optimizer.step()
    return {
        'tp_rank': tp_rank,
        'success': success,
        'grad_norm': grad_norm,
        'num_zeros': num_zeros,
        'ref_norm': ref_norm,
        'ref_zeros': ref_zeros,
        'norm_after_clip': optimizer.get_grad_norm(),
    }


def test_grad_norm_and_clipping_at_tp2_match_unsharded_model():
    outs = run_distributed(_tp_grad_norm, 2, tp=2, args=(0.05,))
    for out in outs:
        assert out['success']
        assert out['grad_norm'] == pytest.approx(out['ref_norm'], rel=1e-5)
        assert out['ref_norm'] > 0.05  # clipping is active
        assert out['norm_after_clip'] == pytest.approx(0.05, rel=1e-4)
        assert out['num_zeros'] == out['ref_zeros'] > 0
    assert outs[0]['grad_norm'] == outs[1]['grad_norm']


def _fp16_loss_scaling():
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4)
    ).half()
    config = OptimizerConfig(
        fp16=True,
        lr=0.01,
        weight_decay=0.0,
        clip_grad=1.0,
        initial_loss_scale=2.0**10,
        loss_scale_window=3,
        hysteresis=2,
    )
    optimizer = get_megatron_optimizer(config, [model])
    assert isinstance(optimizer, Float16OptimizerWithFloat16Params)
    # Model params and their fp32 main copies, paired in the optimizer's group order.
    model_params = [p for g in optimizer.float16_groups for p in g]
    main_params = [p for g in optimizer.fp32_from_float16_groups for p in g]
    assert len(model_params) == 4 and all(p.dtype == torch.float32 for p in main_params)
    x = torch.randn(5, 8).half()
    rank = torch.distributed.get_rank()

    log = []
    for step in range(7):
        inject = step in (1, 2)
        optimizer.zero_grad()
        loss = model(x).float().pow(2).mean()
        optimizer.scale_loss(loss).backward()
        if inject and rank == 0:  # only one model-parallel rank overflows: all must skip
            model[0].weight.grad[0, 0] = float('inf') if step == 1 else float('nan')
        scale = optimizer.get_loss_scale().item()
        grads = [p.grad.float() / scale for p in model_params]
        main_before = [p.detach().clone() for p in main_params]
        model_before = [p.detach().clone() for p in model_params]

        # Reference update: fp32 AdamW on the unscaled, clipped grads from the same main params.
        ref = [torch.nn.Parameter(p.clone()) for p in main_before]
        ref_opt = torch.optim.AdamW(ref, lr=0.01, weight_decay=0.0)
        if step == 0:
            for r, g in zip(ref, grads):
                r.grad = g.clone()
            torch.nn.utils.clip_grad_norm_(ref, 1.0)
            ref_opt.step()

        success, grad_norm, _ = optimizer.step()
        entry = {
            'success': success,
            'grad_norm': grad_norm,
            'scale_after': optimizer.get_loss_scale().item(),
            'unchanged': all(torch.equal(a, b) for a, b in zip(main_before, main_params))
            and all(torch.equal(a, b) for a, b in zip(model_before, model_params)),
            'model_is_cast_main': all(
                torch.equal(m, p.detach().half()) for m, p in zip(model_params, main_params)
            ),
        }
        if step == 0:
            entry['max_err'] = max((r - p).abs().max().item() for r, p in zip(ref, main_params))
        log.append(entry)
    return log


def test_fp16_dynamic_loss_scaling_skips_and_rescales():
    outs = run_distributed(_fp16_loss_scaling, 2, tp=2)
    for log in outs:
        assert [e['success'] for e in log] == [True, False, False, True, True, True, True]
        # hysteresis 2: first overflow tolerated, second halves; 3 clean steps (window) double.
        assert [e['scale_after'] for e in log] == [
            1024.0,
            1024.0,
            512.0,
            512.0,
            512.0,
            1024.0,
            1024.0,
        ]
        assert log[1]['unchanged'] and log[2]['unchanged'] and log[1]['grad_norm'] is None
        assert not log[0]['unchanged'] and not log[3]['unchanged']
        assert all(e['model_is_cast_main'] for e in log)
        assert log[0]['max_err'] < 1e-6


def _bf16_main_params(num_steps):
    torch.manual_seed(7)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4)
    )
    model = model.to(torch.bfloat16)
    ddp = DistributedDataParallel(
        ModelParallelConfig(), DistributedDataParallelConfig(grad_reduce_in_fp32=True), model
    )
    config = OptimizerConfig(bf16=True, lr=1e-3, weight_decay=0.1, clip_grad=0.0)
    optimizer = get_megatron_optimizer(config, [ddp])
    assert (
        isinstance(optimizer, Float16OptimizerWithFloat16Params) and optimizer.grad_scaler is None
    )
    assert optimizer.get_loss_scale().item() == 1.0
    main_groups = optimizer.fp32_from_float16_groups
    ref_groups = [[torch.nn.Parameter(p.detach().clone()) for p in g] for g in main_groups]
    ref_opt = torch.optim.AdamW(
        [
            {'params': r, 'weight_decay': g['weight_decay']}
            for r, g in zip(ref_groups, optimizer.param_groups)
        ],
        lr=1e-3,
    )
    dp_rank = parallel_state.get_data_parallel_rank()
    for step in range(num_steps):
        x = torch.randn(6, 8).to(torch.bfloat16)[dp_rank * 3 : dp_rank * 3 + 3]
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        for model_group, ref_group in zip(optimizer.float16_groups, ref_groups):
            for p, r in zip(model_group, ref_group):
                r.grad = p.main_grad.clone()
        ref_opt.step()
        success, grad_norm, _ = optimizer.step()
        assert success and grad_norm is None
    main = torch.cat([p.view(-1) for g in main_groups for p in g])
    ref = torch.cat([p.detach().view(-1) for g in ref_groups for p in g])
    model_params = torch.cat([p.detach().view(-1) for g in optimizer.float16_groups for p in g])
    return {'main': main, 'ref': ref, 'model': model_params}


def test_bf16_keeps_fp32_main_params():
    outs = run_distributed(_bf16_main_params, 2, args=(3,))
    for out in outs:
        assert out['main'].dtype == torch.float32 and out['model'].dtype == torch.bfloat16
        torch.testing.assert_close(out['main'], out['ref'], rtol=1e-6, atol=1e-7)
        assert torch.equal(out['model'], out['main'].to(torch.bfloat16))
        # The fp32 main copy holds updates that bf16 cannot represent.
        assert not torch.equal(out['main'], out['model'].float())
    torch.testing.assert_close(outs[0]['main'], outs[1]['main'], rtol=0, atol=0)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(4, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.fc2 = torch.nn.Linear(6, 3)

    def forward(self, x):
        return self.fc2(self.norm(self.fc1(x)))


def _weight_decay_groups():
    torch.manual_seed(0)
    model = _Net()
    config = OptimizerConfig(lr=0.1, weight_decay=0.5, clip_grad=0.0)
    optimizer = get_megatron_optimizer(
        config, [model], scale_lr_cond=lambda name, param: name.startswith('fc2'), lr_mult=2.0
    )
    names = {p: n for n, p in model.named_parameters()}
    groups = [
        (
            sorted(names[p] for p in g['params']),
            g['wd_mult'],
            g['lr_mult'],
            g['weight_decay'],
            g['lr'],
        )
        for g in optimizer.param_groups
    ]
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    (
        model(torch.randn(2, 4)).sum() * 0.0
    ).backward()  # zero grads: Adam's update is 0, only decay acts
    optimizer.step()
    after = {n: p.detach().clone() for n, p in model.named_parameters()}
    return {'groups': groups, 'before': before, 'after': after}


def test_no_weight_decay_for_biases_and_norms():
    out = run_distributed(_weight_decay_groups, 2)[0]
    assert out['groups'] == [
        (['fc1.weight'], 1.0, 1.0, 0.5, 0.1),
        (['fc2.weight'], 1.0, 2.0, 0.5, 0.2),
        (['fc1.bias', 'norm.bias', 'norm.weight'], 0.0, 1.0, 0.0, 0.1),
        (['fc2.bias'], 0.0, 2.0, 0.0, 0.2),
    ]
    before, after = out['before'], out['after']
    # Decoupled (AdamW) decay: w <- w * (1 - lr * wd), with the group's lr (lr_mult applied).
    torch.testing.assert_close(after['fc1.weight'], before['fc1.weight'] * (1 - 0.1 * 0.5))
    torch.testing.assert_close(after['fc2.weight'], before['fc2.weight'] * (1 - 0.2 * 0.5))
    for name in ('fc1.bias', 'fc2.bias', 'norm.weight', 'norm.bias'):
        assert torch.equal(after[name], before[name]), name


def _chained_vs_single():
    from megatron.core.optimizer import ChainedOptimizer

    results = {}
    for chained in (False, True):
        torch.manual_seed(0)
        model = _Net()
        config = OptimizerConfig(lr=0.05, weight_decay=0.1, clip_grad=0.1)
        if chained:
            # Two optimizers over disjoint parts, stepped and clipped by one global norm.
            optimizer = ChainedOptimizer(
                [
                    get_megatron_optimizer(config, [model.fc1]),
                    get_megatron_optimizer(config, [torch.nn.ModuleList([model.norm, model.fc2])]),
                ]
            )
        else:
            optimizer = get_megatron_optimizer(config, [model])
        norms = []
        for step in range(3):
            optimizer.zero_grad()
            model(torch.randn(3, 4, generator=torch.Generator().manual_seed(step))).pow(
                2
            ).sum().backward()
            success, grad_norm, _ = optimizer.step()
            assert success
            norms.append(grad_norm)
        results[chained] = {
            'params': torch.cat([p.detach().view(-1) for p in model.parameters()]),
            'norms': norms,
            'num_groups': len(optimizer.param_groups),
            'state_dict_len': len(optimizer.state_dict()) if chained else None,
        }
    return results


def test_chained_optimizer_matches_single_optimizer():
    out = run_distributed(_chained_vs_single, 2)[0]
    torch.testing.assert_close(out[True]['params'], out[False]['params'], rtol=1e-6, atol=1e-7)
    assert out[True]['norms'] == pytest.approx(out[False]['norms'], rel=1e-6)
    assert out[True]['norms'][0] > 0.1  # clipping by the global norm is active
    assert out[True]['num_groups'] == 4 and out[True]['state_dict_len'] == 2
