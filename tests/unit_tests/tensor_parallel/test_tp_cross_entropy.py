"""vocab_parallel_cross_entropy against torch.nn.functional.cross_entropy (loss and logit grads)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
from tests.unit_tests.dist_utils import run_distributed

S, B, V = 6, 3, 32


def _reference(logits, target, label_smoothing):
    # Megatron's smoothing puts `label_smoothing` on the V - 1 non-target classes, which is
    # torch's smoothing (spread over all V classes) with eps = label_smoothing * V / (V - 1).
    eps = label_smoothing * V / (V - 1)
    logits = logits.clone().requires_grad_(True)
    loss = F.cross_entropy(
        logits.view(-1, V), target.view(-1), reduction="none", label_smoothing=eps
    )
    loss = loss.view(S, B)
    return loss, logits


def _check_cross_entropy():
    group = ps.get_tensor_model_parallel_group()
    r, n = group.rank(), group.size()
    gen = torch.Generator().manual_seed(11)
    logits_full = torch.randn(S, B, V, generator=gen) * 3
    target = torch.randint(0, V, (S, B), generator=gen)
    target[0, 0], target[1, 1] = 0, V - 1  # first and last vocabulary entries
    grad_loss = torch.rand(S, B, generator=gen)
    for label_smoothing, inplace in ((0.0, False), (0.1, False), (0.0, True), (0.1, True)):
        ref_loss, ref_logits = _reference(logits_full, target, label_smoothing)
        ref_loss.backward(grad_loss)

        shard = logits_full.chunk(n, dim=-1)[r].clone()
        leaf = shard.clone().requires_grad_(True)
        logits = leaf * 1.0  # a non-leaf, as the output layer's logits are
        loss = vocab_parallel_cross_entropy(logits, target, label_smoothing, inplace=inplace)
        loss.backward(grad_loss)
        msg = f"label_smoothing={label_smoothing} inplace={inplace}"
        torch.testing.assert_close(
            loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-5, msg=lambda m: f"loss {msg}: {m}"
        )
        torch.testing.assert_close(
            leaf.grad,
            ref_logits.grad.chunk(n, dim=-1)[r],
            rtol=1e-5,
            atol=1e-6,
            msg=lambda m: f"grad {msg}: {m}",
        )
        if inplace:  # the fp32 logits were overwritten with their (local) softmax
            assert not torch.equal(logits.detach(), shard), msg
        else:
            assert torch.equal(logits.detach(), shard), "the caller's logits were modified"
    # Far-apart logits: most softmax entries underflow to 0, the loss stays exact.
    extreme = torch.zeros(S, B, V)
    extreme[..., 0] = 1000.0
    extreme[0, 0, V - 1] = 2000.0
    loss_x = vocab_parallel_cross_entropy(extreme.chunk(n, dim=-1)[r].clone(), target)
    ref_x = F.cross_entropy(extreme.view(-1, V), target.view(-1), reduction="none").view(S, B)
    assert torch.isfinite(loss_x).all()
    torch.testing.assert_close(loss_x, ref_x, rtol=1e-6, atol=1e-4)
    # Low precision logits are computed in fp32.
    loss16 = vocab_parallel_cross_entropy(logits_full.chunk(n, dim=-1)[r].bfloat16(), target)
    ref = F.cross_entropy(
        logits_full.bfloat16().float().view(-1, V), target.view(-1), reduction="none"
    )
    assert loss16.dtype == torch.float32
    torch.testing.assert_close(loss16, ref.view(S, B), rtol=1e-4, atol=1e-4)
    return True


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_cross_entropy_matches_torch(tp):
    assert all(run_distributed(_check_cross_entropy, 4, tp=tp))


H = 8


def _check_logits_from_linear_layer(inplace: bool):
    """Logits straight out of a ColumnParallelLinear (the output layer's graph: the GEMM's output,
    no other op in between) into the cross entropy, then backward into the layer's weight and
    input, against the unsharded reference. With `inplace` the softmax overwrites the logits; the
    tensor saved for backward (scaled in place there) must not be the view the softmax was
    written into, or autograd's view / in-place check fails the model's backward."""
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    group = ps.get_tensor_model_parallel_group()
    r, n = group.rank(), group.size()
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(V, H, generator=gen) * 0.5
    x_full = torch.randn(S, B, H, generator=gen)
    target = torch.randint(0, V, (S, B), generator=gen)

    ref_x = x_full.clone().requires_grad_(True)
    ref_w = weight.clone().requires_grad_(True)
    ref_loss = F.cross_entropy(
        F.linear(ref_x, ref_w).view(-1, V), target.view(-1), reduction="none"
    ).view(S, B)
    ref_loss.sum().backward()

    config = ModelParallelConfig(tensor_model_parallel_size=n, use_cpu_initialization=True)
    layer = ColumnParallelLinear(
        H, V, config=config, init_method=torch.nn.init.zeros_, bias=False, tp_group=group
    )
    with torch.no_grad():
        layer.weight.copy_(weight.chunk(n, dim=0)[r])
    x = x_full.clone().requires_grad_(True)
    logits, _ = layer(x)  # [s, b, v/tp]
    loss = vocab_parallel_cross_entropy(logits, target, inplace=inplace)
    loss.sum().backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        layer.weight.grad, ref_w.grad.chunk(n, dim=0)[r], rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)
    return True


@pytest.mark.parametrize("inplace", [True, False])
def test_logits_from_a_linear_layer(inplace):
    assert all(run_distributed(_check_logits_from_linear_layer, 2, tp=2, args=(inplace,)))
