"""The chunked SSD scan equals the sequential recurrence: outputs, final states and every
input gradient, in fp32, for several chunk sizes, lengths that are not a multiple of the
chunk, an initial state and packed documents (the state must not cross a document start)."""

import pytest
import torch

from megatron.core.ssm.causal_conv1d import causal_conv1d
from megatron.core.ssm.ssd_scan import ssd_chunked_scan, ssd_sequential_scan


def _inputs(seed, b=2, s=23, nh=4, p=3, g=2, n=5):
    gen = torch.Generator().manual_seed(seed)
    return dict(
        x=torch.randn(b, s, nh, p, generator=gen),
        dt=torch.rand(b, s, nh, generator=gen) * 0.6 + 0.01,
        A=-(torch.rand(nh, generator=gen) * 3 + 0.1),
        B=torch.randn(b, s, g, n, generator=gen),
        C=torch.randn(b, s, g, n, generator=gen),
        initial_state=torch.randn(b, nh, p, n, generator=gen),
    )


def _run(fn, inputs, seq_idx, **kw):
    leaves = {k: v.clone().requires_grad_(True) for k, v in inputs.items()}
    y, state = fn(**leaves, seq_idx=seq_idx, **kw)
    gen = torch.Generator().manual_seed(9)
    (y * torch.randn(y.shape, generator=gen)).sum().backward(retain_graph=True)
    (state * torch.randn(state.shape, generator=gen)).sum().backward()
    return y.detach(), state.detach(), {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize('chunk_size', [1, 4, 8, 16, 64])
@pytest.mark.parametrize('packed', [False, True])
def test_chunked_scan_equals_recurrence(chunk_size, packed):
    inputs = _inputs(0)
    seq_idx = None
    if packed:
        seq_idx = torch.tensor([[0] * 7 + [1] * 9 + [2] * 7, [0] * 23])
    ref = _run(ssd_sequential_scan, inputs, seq_idx)
    out = _run(ssd_chunked_scan, inputs, seq_idx, chunk_size=chunk_size)
    torch.testing.assert_close(out[0], ref[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], ref[1], atol=2e-5, rtol=1e-5)
    for name in inputs:
        torch.testing.assert_close(out[2][name], ref[2][name], atol=5e-5, rtol=1e-4, msg=name)


def test_documents_do_not_leak():
    """Packed rows equal each document scanned on its own (conv and scan)."""
    inputs = _inputs(1, b=1, s=12)
    inputs.pop('initial_state')
    seq_idx = torch.tensor([[0] * 5 + [1] * 7])
    y, _ = ssd_chunked_scan(**inputs, chunk_size=4, seq_idx=seq_idx)
    first = {k: v[:, :5] if k != 'A' else v for k, v in inputs.items()}
    second = {k: v[:, 5:] if k != 'A' else v for k, v in inputs.items()}
    y1, _ = ssd_sequential_scan(**first)
    y2, _ = ssd_sequential_scan(**second)
    torch.testing.assert_close(y, torch.cat([y1, y2], dim=1), atol=2e-5, rtol=1e-5)

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 6, 12, generator=gen)
    w, bias = torch.randn(6, 1, 4, generator=gen), torch.randn(6, generator=gen)
    packed = causal_conv1d(x, w, bias, seq_idx)
    alone = torch.cat([causal_conv1d(x[..., :5], w, bias), causal_conv1d(x[..., 5:], w, bias)], -1)
    torch.testing.assert_close(packed, alone)
    # Without document ids the same conv does see across the boundary.
    assert not torch.allclose(causal_conv1d(x, w, bias), alone)
