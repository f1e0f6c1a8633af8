"""CLIPViTModel against transformers' CLIPVisionModel and SiglipVisionModel (tiny random towers
built here), bidirectional attention, tensor + sequence parallel parity, the projector."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")

ATOL = 2e-5


def _hf_parity(subtype):
    from megatron.core.models.vision.hf_weight_mapping import (
        hf_to_mcore_vision_state_dict,
        mcore_to_hf_vision_state_dict,
    )
    from tests.unit_tests.models import vision_test_utils as vu

    hf = vu.hf_tower(subtype)
    model, config = vu.build_vit(subtype)
    mc_sd = hf_to_mcore_vision_state_dict(hf.state_dict(), vu.HEADS)
    vu.load_full(model, config, mc_sd)
    x = vu.images()
    weight = torch.randn(2, model.seq_length, vu.HIDDEN, generator=torch.Generator().manual_seed(9))

    ours = model(x)
    theirs = hf(pixel_values=x).last_hidden_state
    (ours * weight).sum().backward()
    (theirs * weight).sum().backward()

    ours_grads = {n: p.grad for n, p in model.named_parameters()}
    theirs_grads = hf_to_mcore_vision_state_dict(
        {n: p.grad for n, p in hf.named_parameters() if p.grad is not None}
        | {n: torch.zeros_like(p) for n, p in hf.named_parameters() if p.grad is None},
        vu.HEADS,
    )
    # Export gives back HF's weights (CLIP's pooler-only post_layernorm is not in the encoder).
    back = mcore_to_hf_vision_state_dict(model.state_dict(), vu.HEADS)
    hf_sd = {k: v for k, v in hf.state_dict().items() if not k.startswith(('head.', 'post_'))}
    same = all(torch.equal(back[k], v) for k, v in hf_sd.items())
    grad_err = max((ours_grads[n] - theirs_grads[n]).abs().max().item() for n in ours_grads)
    return (ours - theirs).abs().max().item(), grad_err, same


@pytest.mark.parametrize('subtype', ['clip', 'siglip'])
def test_matches_hf_vision_tower(subtype):
    out_err, grad_err, same = run_distributed(_hf_parity, world_size=1, args=(subtype,))[0]
    assert out_err < ATOL, out_err
    assert grad_err < 1e-4, grad_err
    assert same


def _bidirectional():
    from tests.unit_tests.models import vision_test_utils as vu

    model, _ = vu.build_vit('clip')
    x = vu.images(batch=1)
    changed = x.clone()
    changed[:, :, -vu.PATCH :, -vu.PATCH :] += 1.0  # the last patch only
    with torch.no_grad():
        a, b = model(x), model(changed)
    # A causal ViT would leave every token before the last patch untouched.
    return (a[0, 0] - b[0, 0]).abs().max().item()


def test_attention_is_bidirectional():
    delta = run_distributed(_bidirectional, world_size=1)[0]
    assert delta > 1e-4, delta


def _reference():
    from tests.unit_tests.models import vision_test_utils as vu

    # 2 class tokens: 16 patches + 2 = 18 tokens, divisible by TP=2 for sequence parallelism.
    model, _ = vu.build_vit('clip', class_token_len=2)
    full = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith('_extra_state')}
    x = vu.images()
    w = torch.randn(2, 18, vu.HIDDEN, generator=torch.Generator().manual_seed(4))
    out = model(x)
    (out * w).sum().backward()
    return full, x, w, out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _tp_parity(full, x, w, sequence_parallel):
    from megatron.core import parallel_state
    from tests.unit_tests.models import vision_test_utils as vu

    model, config = vu.build_vit('clip', class_token_len=2, sequence_parallel=sequence_parallel)
    vu.load_full(model, config, full)
    out = model(x)
    (out * w).sum().backward()
    # What finalize_model_grads does for the norms inside the sequence-parallel region.
    for p in model.parameters():
        if getattr(p, 'sequence_parallel', False):
            torch.distributed.all_reduce(
                p.grad, group=parallel_state.get_tensor_model_parallel_group()
            )
    return out.detach(), vu.gather_full({n: p.grad for n, p in model.named_parameters()}, config)


@pytest.mark.parametrize('sequence_parallel', [False, True])
def test_tensor_parallel_matches_unsharded(sequence_parallel):
    full, x, w, ref_out, ref_grads = run_distributed(_reference, world_size=1)[0]
    outs = run_distributed(_tp_parity, world_size=2, tp=2, args=(full, x, w, sequence_parallel))
    for out, grads in outs:
        assert (out - ref_out).abs().max() < 1e-5
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max() < 1e-4, name


def _projector(projector_type):
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=1, hidden_size=48, ffn_hidden_size=48, num_attention_heads=4,
        use_cpu_initialization=True, add_bias_linear=True,
    )  # fmt: skip
    sub = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    proj = MultimodalProjector(config, sub, projector_type, input_size=32)
    x = torch.randn(5, 2, 32)
    y = proj(x)
    sd = proj.state_dict()
    if projector_type == 'mlp':
        fc1, b1 = sd['encoder.linear_fc1.weight'], sd['encoder.linear_fc1.bias']
        fc2, b2 = sd['encoder.linear_fc2.weight'], sd['encoder.linear_fc2.bias']
        expected = torch.nn.functional.gelu(x @ fc1.t() + b1) @ fc2.t() + b2
    else:
        expected = x @ sd['encoder.weight'].t() + sd['encoder.bias']
    n_params = sum(p.numel() for p in proj.parameters())
    return (y - expected).abs().max().item(), n_params, sorted(k for k in sd if 'extra' not in k)


@pytest.mark.parametrize('projector_type', ['mlp', 'affine'])
def test_multimodal_projector(projector_type):
    err, n_params, keys = run_distributed(_projector, world_size=1, args=(projector_type,))[0]
    assert err < 1e-5
    if projector_type == 'mlp':
        assert n_params == 32 * 48 + 48 + 48 * 48 + 48
        assert keys[0].startswith('encoder.linear_fc1')
    else:
        assert n_params == 32 * 48 + 48
        assert keys == ['encoder.bias', 'encoder.weight']


def test_refusals():
    from megatron.core.models.vision.clip_vit_model import CLIPViTModel
    from megatron.core.models.vision.multimodal_projector import MultimodalProjector

    with pytest.raises(ValueError, match='not divisible by the patch size 5'):
        CLIPViTModel(None, None, patch_dim=5, img_h=16, img_w=16)
    with pytest.raises(ValueError, match='model subtype internvit is not supported'):
        CLIPViTModel(None, None, model_subtype='internvit')
    with pytest.raises(ValueError, match='SigLIP does not support class tokens'):
        CLIPViTModel(None, None, model_subtype='siglip', add_class_token=True)
    with pytest.raises(ValueError, match='MLPSubmodules must be provided'):
        MultimodalProjector(None, None, 'mlp', 8)
