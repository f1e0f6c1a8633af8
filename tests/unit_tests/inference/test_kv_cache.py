"""KV-cached forward of GPTModel against the full forward (learned positions, RoPE with GQA), on
one rank and tensor-parallel, plus InferenceParams' bookkeeping."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed


def _last_token_logits(arch):
    from megatron.core import InferenceParams
    from tests.unit_tests.models.gpt_test_utils import (
        build_gpt,
        gpt2_like_kwargs,
        llama_like_kwargs,
    )

    kwargs = gpt2_like_kwargs() if arch == "gpt2" else llama_like_kwargs()
    model, _ = build_gpt(kwargs, arch=arch)
    model.eval()
    tokens = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = model(tokens, None, None)
        params = InferenceParams(max_batch_size=2, max_sequence_length=6)
        params.materialize_only_last_token_logits = True
        last = model(tokens, None, None, inference_params=params)
    return full, last


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_materialize_only_last_token_logits(arch):
    ((full, last),) = run_distributed(_last_token_logits, world_size=1, args=(arch,))
    assert last.shape == (2, 1, full.size(-1))
    torch.testing.assert_close(last[:, 0], full[:, -1], atol=1e-5, rtol=1e-5)


def _cached_vs_full(arch, prefix, micro_batches):
    from megatron.core import InferenceParams
    from tests.unit_tests.models.gpt_test_utils import (
        build_gpt,
        gather_logits,
        gpt2_like_kwargs,
        llama_like_kwargs,
    )

    kwargs = gpt2_like_kwargs() if arch == "gpt2" else llama_like_kwargs()
    model, _ = build_gpt(kwargs, arch=arch)
    model.eval()
    b, s = 4, 12
    tokens = torch.randint(0, 128, (b, s), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        full = gather_logits(model(tokens, None, None))  # [b, s, v]
        params = InferenceParams(max_batch_size=b, max_sequence_length=s)
        steps = [(0, prefix)] + [(i, i + 1) for i in range(prefix, s)]
        cached = []
        for start, end in steps:
            rows = []
            # Pipeline-style micro-batches: each writes its own rows at the same positions.
            for chunk in torch.arange(b).chunk(micro_batches):
                params.batch_size_offset = int(chunk[0])
                positions = torch.arange(start, end).unsqueeze(0).expand(len(chunk), -1)
                rows.append(
                    gather_logits(
                        model(tokens[chunk, start:end], positions, None, inference_params=params)
                    )
                )
            params.batch_size_offset = 0
            params.sequence_len_offset += end - start
            cached.append(torch.cat(rows, dim=0))
    return full, torch.cat(cached, dim=1)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
@pytest.mark.parametrize("tp", [1, 2])
def test_kv_cache_matches_full_forward(arch, tp):
    outs = run_distributed(_cached_vs_full, world_size=tp, tp=tp, args=(arch, 5, 2))
    for full, cached in outs:
        torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)


def test_inference_params_fields_and_swap():
    from megatron.core import InferenceParams

    params = InferenceParams(max_batch_size=3, max_sequence_length=7)
    assert (params.max_batch_size, params.max_sequence_length) == (3, 7)
    assert (params.sequence_len_offset, params.batch_size_offset) == (0, 0)
    assert params.key_value_memory_dict == {}
    with pytest.raises(ValueError, match="should not swap when dict in empty"):
        params.swap_key_value_dict([0, 1, 2])
    key = torch.arange(7 * 3).view(7, 3, 1, 1).float()
    params.key_value_memory_dict[1] = (key, key + 100)
    params.swap_key_value_dict(torch.tensor([2, 2, 0]))
    k, v = params.key_value_memory_dict[1]
    assert torch.equal(k[:, 0], key[:, 2]) and torch.equal(k[:, 2], key[:, 0])
    assert torch.equal(v[:, 1], key[:, 2] + 100)
