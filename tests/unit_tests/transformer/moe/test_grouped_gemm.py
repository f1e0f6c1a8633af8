"""The grouped GEMM of GroupedMLP: output and gradients equal one GEMM per expert, with empty
experts (zero weight gradient, not a missing one); on a CUDA bf16 device of compute capability 9+
torch's `_grouped_mm` kernel against the same loop."""

import pytest
import torch

from megatron.core.transformer.moe.experts import _torch_grouped_mm_available, grouped_gemm


def _check(device, dtype, atol):
    g = torch.Generator().manual_seed(0)
    counts = torch.tensor([5, 0, 11, 16])  # expert 1 gets no rows
    x = torch.randn(int(counts.sum()), 32, generator=g).to(device, dtype).requires_grad_(True)
    w = torch.randn(4, 32, 48, generator=g).to(device, dtype).requires_grad_(True)
    grad = torch.randn(int(counts.sum()), 48, generator=g).to(device, dtype)
    out = grouped_gemm(x, w, counts)
    out.backward(grad)
    x_ref, w_ref = x.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)
    rows = torch.split(x_ref, counts.tolist())
    ref = torch.cat([r @ w_ref[e] for e, r in enumerate(rows)])
    ref.backward(grad)
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
    torch.testing.assert_close(x.grad, x_ref.grad, atol=atol, rtol=0)
    torch.testing.assert_close(w.grad, w_ref.grad, atol=atol, rtol=0)
    assert torch.count_nonzero(w.grad[1]) == 0


def test_grouped_gemm_equals_one_gemm_per_expert():
    _check('cpu', torch.float32, 1e-5)


@pytest.mark.gpu
def test_torch_grouped_mm_kernel_on_cuda():
    x = torch.zeros(1, 16, device='cuda', dtype=torch.bfloat16)
    if not _torch_grouped_mm_available(x, x.view(1, 16, 1)):
        pytest.skip('torch._grouped_mm needs bf16 on compute capability 9+')
    _check('cuda', torch.bfloat16, 5e-2)


def _layouts_body():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module
    from megatron.training.checkpoint.checkpoint_conversion_moe import (
        grouped_to_sequential,
        sequential_to_grouped,
    )
    from tests.unit_tests.transformer.moe.moe_test_utils import (
        E,
        H,
        global_weights,
        load_weights,
        moe_config,
    )

    layers = {}
    for grouped in (False, True):
        config = moe_config(moe_grouped_gemm=grouped)
        layers[grouped] = build_module(
            get_gpt_layer_local_spec(E, grouped).submodules.mlp, config=config
        )
        load_weights(layers[grouped], global_weights(seed=7))
    # Keys as a GPTModel checkpoint names them.
    prefix = 'decoder.layers.0.mlp.'
    sequential = {prefix + k: v for k, v in layers[False].state_dict().items() if v is not None}
    grouped = {prefix + k: v for k, v in layers[True].state_dict().items() if v is not None}
    return dict(
        to_grouped=sequential_to_grouped(sequential, E),
        grouped=grouped,
        to_sequential=grouped_to_sequential(grouped, E, H),
        sequential=sequential,
    )


def test_checkpoint_layouts_of_grouped_and_sequential_experts_convert_exactly():
    from tests.unit_tests.dist_utils import run_distributed

    out = run_distributed(_layouts_body, 1)[0]
    for converted, target in (('to_grouped', 'grouped'), ('to_sequential', 'sequential')):
        assert sorted(out[converted]) == sorted(out[target])
        for name, tensor in out[target].items():
            assert torch.equal(out[converted][name], tensor), (converted, name)
