"""Muon (`--optimizer muon`).

- On a matrix, our Muon equals torch.optim.Muon (coefficients (3.4445, -4.775, 2.0315),
  adjust_lr_fn "original" = our shape_scaling, bf16 cast before normalising = our "low"
  precision), over several steps, wide and tall.
- TP = 2: "duplicated" gives every rank its block of the full-matrix update (equal to TP = 1);
  "blockwise" orthogonalises each shard (its own reference, and not the full-matrix update).
- The fused QKV weight is orthogonalised per q / k / v block.
- Through get_megatron_optimizer: 2-D hidden weights get Muon, norms / embeddings AdamW; the
  state saves and loads (a resumed optimizer continues identically).
"""

import copy

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


@pytest.mark.parametrize('shape', [(8, 16), (16, 8)])
def test_muon_equals_torch_optim_muon(shape):
    from megatron.core.optimizer.muon import Muon

    g = torch.Generator().manual_seed(0)
    start = torch.randn(*shape, generator=g)
    grads = [torch.randn(*shape, generator=g) for _ in range(4)]
    ours_p = torch.nn.Parameter(start.clone())
    ref_p = torch.nn.Parameter(start.clone())
    ours = Muon(
        [{'params': [ours_p], 'use_muon': True}],
        lr=0.02,
        weight_decay=0.1,
        momentum=0.95,
        nesterov=True,
        scale_mode='shape_scaling',
        matmul_precision='low',
    )
    ref = torch.optim.Muon(
        [ref_p], lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True, adjust_lr_fn='original'
    )
    for grad in grads:
        ours_p.grad, ref_p.grad = grad.clone(), grad.clone()
        ours.step()
        ref.step()
    torch.testing.assert_close(ours_p.data, ref_p.data, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(ours_p.data, start)


def _tp_muon(mode):
    from megatron.core import parallel_state
    from megatron.core.optimizer.muon import Muon, muon_scale, newton_schulz

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    g = torch.Generator().manual_seed(1)
    full, grad = torch.randn(12, 8, generator=g), torch.randn(12, 8, generator=g)
    shard = torch.nn.Parameter(full.chunk(tp, 0)[rank].clone())
    shard.tensor_model_parallel, shard.partition_dim = True, 0
    shard.grad = grad.chunk(tp, 0)[rank].clone()
    opt = Muon(
        [{'params': [shard], 'use_muon': True}],
        lr=0.1,
        momentum=0.0,
        matmul_precision='high',
        tp_mode=mode,
        tp_group=parallel_state.get_tensor_model_parallel_group(),
    )
    opt.step()
    whole = full - 0.1 * newton_schulz(grad) * muon_scale(12, 8, 'spectral')
    local_grad = grad.chunk(tp, 0)[rank]
    local = full.chunk(tp, 0)[rank] - 0.1 * newton_schulz(local_grad) * muon_scale(
        *local_grad.shape, 'spectral'
    )
    return dict(ours=shard.data, whole=whole.chunk(tp, 0)[rank], local=local)


def test_muon_tp_duplicated_equals_full_matrix_and_blockwise_per_shard():
    for res in run_distributed(_tp_muon, 2, tp=2, args=('duplicated',)):
        torch.testing.assert_close(res['ours'], res['whole'], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(res['ours'], res['local'], atol=1e-3)
    for res in run_distributed(_tp_muon, 2, tp=2, args=('blockwise',)):
        torch.testing.assert_close(res['ours'], res['local'], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(res['ours'], res['whole'], atol=1e-3)


def test_muon_splits_fused_qkv_per_block():
    from megatron.core.optimizer.muon import Muon, muon_scale, newton_schulz

    groups, heads, head, hidden = 2, 2, 4, 8
    g = torch.Generator().manual_seed(2)
    grad = torch.randn(groups * (heads + 2) * head, hidden, generator=g)
    param = torch.nn.Parameter(torch.zeros_like(grad))
    param.muon_qkv_layout = (groups, heads, head)
    param.grad = grad
    Muon(
        [{'params': [param], 'use_muon': True}], lr=1.0, momentum=0.0, matmul_precision='high'
    ).step()
    blocks = grad.view(groups, heads + 2, head, hidden)
    expected = []
    for part in torch.split(blocks, [heads, 1, 1], dim=1):
        flat = part.reshape(-1, hidden)
        expected.append(
            (-newton_schulz(flat) * muon_scale(*flat.shape, 'spectral')).view(part.shape)
        )
    torch.testing.assert_close(param.data, torch.cat(expected, dim=1).view_as(grad))
    whole = -newton_schulz(grad) * muon_scale(*grad.shape, 'spectral')
    assert not torch.allclose(param.data, whole, atol=1e-3)


def _megatron_muon_resume():
    import torch.nn.functional as F

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    def build():
        torch.manual_seed(3)
        config = TransformerConfig(
            num_layers=1,
            hidden_size=16,
            num_attention_heads=2,
            ffn_hidden_size=32,
            normalization='RMSNorm',
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
        )
        model = GPTModel(
            config,
            get_gpt_layer_local_spec(),
            vocab_size=32,
            max_sequence_length=8,
            position_embedding_type='rope',
        )
        opt = get_megatron_optimizer(
            OptimizerConfig(optimizer='muon', lr=1e-2, weight_decay=0.01), [model]
        )
        return model, opt

    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(4))

    def step(model, opt):
        opt.zero_grad()
        model(ids, None, None, labels=ids).mean().backward()
        opt.step()

    model, opt = build()
    kinds = {
        name: ('momentum_buffer' in opt.optimizer.state[p]) for name, p in model.named_parameters()
    }
    step(model, opt)
    saved_model = {k: v.clone() for k, v in model.state_dict().items() if torch.is_tensor(v)}
    saved_opt = copy.deepcopy(opt.state_dict())  # the live state changes in place
    step(model, opt)
    model2, opt2 = build()
    model2.load_state_dict(saved_model, strict=False)
    opt2.load_state_dict(saved_opt)
    step(model2, opt2)
    kinds = {n: 'momentum_buffer' in opt.optimizer.state[p] for n, p in model.named_parameters()}
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
    return dict(kinds=kinds, same=same)


def test_megatron_muon_param_kinds_and_resume():
    (res,) = run_distributed(_megatron_muon_resume, 1)
    kinds = res['kinds']
    assert kinds['decoder.layers.0.self_attention.linear_qkv.weight']
    assert kinds['decoder.layers.0.mlp.linear_fc2.weight']
    assert not kinds['embedding.word_embeddings.weight']
    assert not kinds['decoder.final_layernorm.weight']
    assert res['same']
