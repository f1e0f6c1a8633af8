"""tensor_parallel as Megatron r0.8's library users call it: the mapping autograd functions
with their `symbolic` methods and a backward called directly (no ctx, default tp group),
`linear_with_frozen_weight` with r0.8's positional signature (checked against an unsharded
reference), RNG tracker states of any type, and the GPT-2 tokenizer module's archive maps.
"""

import json

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


def _mappings_without_ctx():
    """Each check compares one autograd function's symbolic / bare backward with the plain
    collective it stands for, on tp=2 (world 2), with no group passed anywhere."""
    from megatron.core.tensor_parallel import mappings as m

    rank = torch.distributed.get_rank()
    x = torch.arange(8.0).view(4, 2) + 10 * rank  # differs per rank
    whole = torch.cat([torch.arange(8.0).view(4, 2), torch.arange(8.0).view(4, 2) + 10], dim=0)
    out = {}
    out['copy_bwd'] = m._CopyToModelParallelRegion.backward(None, x.clone())
    out['copy_sym'] = m._CopyToModelParallelRegion.symbolic(None, x)
    out['reduce_sym'] = m._ReduceFromModelParallelRegion.symbolic(None, x.clone())
    out['reduce_bwd'] = m._ReduceFromModelParallelRegion.backward(None, x)
    out['scatter_sym'] = m._ScatterToModelParallelRegion.symbolic(None, x)
    out['scatter_bwd'] = m._ScatterToModelParallelRegion.backward(None, x)
    out['gather_sym'] = m._GatherFromModelParallelRegion.symbolic(None, x)
    out['gather_bwd'] = m._GatherFromModelParallelRegion.backward(None, x)
    out['sp_scatter_sym'] = m._ScatterToSequenceParallelRegion.symbolic(None, x)
    out['sp_scatter_bwd'] = m._ScatterToSequenceParallelRegion.backward(None, x)
    out['sp_gather_sym'] = m._GatherFromSequenceParallelRegion.symbolic(None, x)

    class GatherCtx:  # no group: the default one
        tensor_parallel_output_grad = True
        output_split_sizes = None

    out['sp_gather_bwd'] = m._GatherFromSequenceParallelRegion.backward(GatherCtx(), whole)

    class ScatterCtx:
        input_split_sizes = None

    out['rs_sym'] = m._ReduceScatterToSequenceParallelRegion.symbolic(None, whole)
    out['rs_bwd'] = m._ReduceScatterToSequenceParallelRegion.backward(ScatterCtx(), x)
    out['ag_last_sym'] = m._AllGatherFromTensorParallelRegion.symbolic(None, x)
    out['rs_last_sym'] = m._ReduceScatterToTensorParallelRegion.symbolic(None, x)
    out['a2a_sym'] = m._AllToAll.symbolic(
        None, m.parallel_state.get_tensor_model_parallel_group(), x, None, None
    )
    # The public functions with no group, inside autograd (forward and backward).
    y = x.clone().requires_grad_()
    m.copy_to_tensor_model_parallel_region(y).sum().backward()
    out['copy_autograd_grad'] = y.grad
    z = x.clone().requires_grad_()
    m._CopyToModelParallelRegion.apply(z).sum().backward()  # r0.8's one-argument apply
    out['copy_apply1_grad'] = z.grad
    return out


def test_mapping_functions_symbolic_and_direct_backward_use_the_default_group():
    outs = run_distributed(_mappings_without_ctx, world_size=2, tp=2)
    base = [torch.arange(8.0).view(4, 2) + 10 * r for r in range(2)]
    total = base[0] + base[1]
    whole = torch.cat(base, dim=0)
    for rank, out in enumerate(outs):
        x = base[rank]
        assert isinstance(out['copy_bwd'], torch.Tensor)  # a bare tensor, as in r0.8
        torch.testing.assert_close(out['copy_bwd'], total)
        torch.testing.assert_close(out['copy_sym'], x)
        torch.testing.assert_close(out['reduce_sym'], total)
        torch.testing.assert_close(out['reduce_bwd'], x)
        torch.testing.assert_close(out['scatter_sym'], x[:, rank : rank + 1])
        torch.testing.assert_close(out['scatter_bwd'], torch.cat(base, dim=-1))
        torch.testing.assert_close(out['gather_sym'], torch.cat(base, dim=-1))
        torch.testing.assert_close(out['gather_bwd'], x[:, rank : rank + 1])
        torch.testing.assert_close(out['sp_scatter_sym'], x[2 * rank : 2 * rank + 2])
        torch.testing.assert_close(out['sp_scatter_bwd'], whole)
        torch.testing.assert_close(out['sp_gather_sym'], whole)
        grad, *rest = out['sp_gather_bwd']
        assert len(rest) == 2 and all(r is None for r in rest)  # r0.8's three gradients
        torch.testing.assert_close(grad, 2 * base[rank])
        torch.testing.assert_close(out['rs_sym'], 2 * base[rank])
        grad, none = out['rs_bwd']  # r0.8's two gradients
        assert none is None
        torch.testing.assert_close(grad, whole)
        torch.testing.assert_close(out['ag_last_sym'], torch.cat(base, dim=-1))
        torch.testing.assert_close(out['rs_last_sym'], total[:, rank : rank + 1])
        torch.testing.assert_close(
            out['a2a_sym'], torch.cat([b[2 * rank : 2 * rank + 2] for b in base], dim=0)
        )
        torch.testing.assert_close(out['copy_autograd_grad'], torch.full((4, 2), 2.0))
        torch.testing.assert_close(out['copy_apply1_grad'], torch.full((4, 2), 2.0))


def _frozen_linear(weight, bias, x, sequence_parallel):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    rank = ps.get_tensor_model_parallel_rank()
    rows = weight.shape[0] // 2
    w = weight[rank * rows : (rank + 1) * rows].clone()  # column parallel: [o/tp, h]
    b = bias[rank * rows : (rank + 1) * rows].clone()
    if sequence_parallel:
        inp = x[rank * 2 : rank * 2 + 2].clone().requires_grad_()  # [s/tp, b, h]
    else:
        inp = x.clone().requires_grad_()
    # r0.8's positional order: gradient_accumulation_fusion, async_grad_allreduce,
    # sequence_parallel, grad_output_buffer, wgrad_deferral_limit.
    out = linear_with_frozen_weight(
        inp, w, b, False, not sequence_parallel, sequence_parallel, None, None
    )
    full = gather_from_tensor_model_parallel_region(out)
    (full * torch.arange(full.numel()).view(full.shape)).sum().backward()
    return full.detach(), inp.grad, w.grad


@pytest.mark.parametrize('sequence_parallel', [False, True])
def test_linear_with_frozen_weight_matches_unsharded(sequence_parallel):
    torch.manual_seed(0)
    weight, bias, x = torch.randn(6, 5), torch.randn(6), torch.randn(4, 3, 5)
    ref_x = x.clone().requires_grad_()
    ref = torch.nn.functional.linear(ref_x, weight, bias)
    (ref * torch.arange(ref.numel()).view(ref.shape)).sum().backward()
    outs = run_distributed(
        _frozen_linear, world_size=2, tp=2, args=(weight, bias, x, sequence_parallel)
    )
    for rank, (full, grad_in, grad_w) in enumerate(outs):
        assert grad_w is None  # the weight takes no gradient
        if sequence_parallel:
            # Each rank's output holds the whole sequence; its input grad is its own part.
            torch.testing.assert_close(full, ref.detach())
            torch.testing.assert_close(grad_in, ref_x.grad[rank * 2 : rank * 2 + 2])
        else:
            torch.testing.assert_close(full, ref.detach())
            torch.testing.assert_close(grad_in, ref_x.grad)


def test_frozen_weight_refuses_a_grad_output_buffer():
    from megatron.core.tensor_parallel.layers import linear_with_frozen_weight

    with pytest.raises(ValueError, match='grad_output_buffer'):
        linear_with_frozen_weight(torch.ones(2, 2), torch.ones(2, 2), None, False, False, False, [])


def test_rng_tracker_keeps_states_of_any_type_and_clones_tensors():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    tracker.set_states({'plain': 1234})
    assert tracker.get_states()['plain'] == 1234 and tracker.is_initialized()
    tracker.reset()
    assert tracker.get_states() == {}
    tracker.add('a', 11)
    states = tracker.get_states()
    with tracker.fork('a'):
        torch.rand(3)
    # The fork advanced the tracker's state, not the copy handed out before it.
    assert not torch.equal(states['a'], tracker.get_states()['a'])
    torch.manual_seed(11)
    assert torch.equal(states['a'], torch.get_rng_state())


def test_gpt2_archive_maps_and_from_pretrained_directory(tmp_path):
    from megatron.training.tokenizer import gpt2_tokenization as g

    assert g.PRETRAINED_MERGES_ARCHIVE_MAP['gpt2'].endswith('gpt2-merges.txt')
    assert g.PRETRAINED_VOCAB_ARCHIVE_MAP['gpt2'].endswith('gpt2-vocab.json')
    assert g.PRETRAINED_VOCAB_POSITIONAL_EMBEDDINGS_SIZE_MAP['gpt2'] == 1024
    vocab = {'a': 0, 'b': 1, 'ab': 2, '\u0120': 3}
    (tmp_path / g.VOCAB_NAME).write_text(json.dumps(vocab))
    (tmp_path / g.MERGES_NAME).write_text('#version: 0.2\na b\n')
    (tmp_path / g.SPECIAL_TOKENS_NAME).write_text('<sep>\n')
    tok = g.GPT2Tokenizer.from_pretrained(str(tmp_path))
    assert tok.encode('ab') == [2]
    assert tok.special_tokens == {'<sep>': 4} and len(tok) == 5
    with pytest.raises(ValueError, match='nothing is downloaded'):
        g.GPT2Tokenizer.from_pretrained('gpt2')
