"""Packed sequences (PackedSeqParams) through GPTModel -> TransformerBlock -> attention ->
DotProductAttention: a micro-batch of packed conversations gives, for every conversation, the
same logits, per-token losses and parameter gradients as that conversation run alone from
position 0. Rotary (Llama-like, GQA) and learned positions (GPT-2-like), the fused per-segment
path and the masked block-diagonal path, at TP1 and TP2 (each layout against itself run alone:
the check is that no attention or position crosses a conversation boundary)."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

L = 24
#: Conversation lengths of the two samples of the micro-batch (the last one takes the pad tail).
SAMPLES = [[7, 10, 7], [5, 19]]


def _cu_seqlens():
    rows = []
    for lengths in SAMPLES:
        starts = [0]
        for n in lengths[:-1]:
            starts.append(starts[-1] + n)
        rows.append(starts + [L] * (L + 1 - len(starts)))
    return torch.tensor(rows, dtype=torch.int32)


def _packed_vs_alone(arch, masked_path):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention._can_use_sdpa
    if masked_path:
        # The exact masked path runs for dropout or a 16-bit softmax in fp32; force it here.
        DotProductAttention._can_use_sdpa = lambda self, *args: False
    try:
        return _run_packed_vs_alone(arch)
    finally:
        DotProductAttention._can_use_sdpa = original  # the worker process is reused


def _run_packed_vs_alone(arch):
    from megatron.core.packed_seq_params import packed_seq_params_from_samples
    from tests.unit_tests.models.gpt_test_utils import (
        VOCAB,
        build_gpt,
        gather_logits,
        gpt2_like_kwargs,
        grads_of,
        llama_like_kwargs,
    )

    kwargs = gpt2_like_kwargs() if arch == "gpt2" else llama_like_kwargs()
    model, _ = build_gpt(kwargs, arch=arch, max_sequence_length=2 * L)
    g = torch.Generator().manual_seed(3)
    b = len(SAMPLES)
    tokens = torch.randint(0, VOCAB, (b, L), generator=g)
    labels = torch.randint(0, VOCAB, (b, L), generator=g)
    cu = _cu_seqlens()
    positions = torch.zeros(b, L, dtype=torch.int64)
    spans = []
    for i, lengths in enumerate(SAMPLES):
        start = 0
        for k, n in enumerate(lengths):
            end = L if k == len(lengths) - 1 else start + n
            positions[i, start:end] = torch.arange(end - start)
            spans.append((i, start, end))
            start = end
    params = packed_seq_params_from_samples(cu, torch.tensor([10, 19], dtype=torch.int32))
    assert params.cu_seqlens_q.tolist() == [0, 7, 17, 24, 29, 48]

    logits = gather_logits(model(tokens, positions, None, packed_seq_params=params))
    model.zero_grad()
    loss = model(tokens, positions, None, labels=labels, packed_seq_params=params)
    loss.sum().backward()
    packed_grads = grads_of(model)

    alone_logits = torch.empty_like(logits)
    alone_loss = torch.empty_like(loss)
    model.zero_grad()
    for i, lo, hi in spans:
        piece = tokens[i : i + 1, lo:hi]
        pos = torch.arange(hi - lo).unsqueeze(0)
        with torch.no_grad():
            alone_logits[i, lo:hi] = gather_logits(model(piece, pos, None))[0]
        piece_loss = model(piece, pos, None, labels=labels[i : i + 1, lo:hi])
        piece_loss.sum().backward()
        alone_loss[i, lo:hi] = piece_loss[0].detach()
    alone_grads = grads_of(model)
    return logits.detach(), alone_logits, loss.detach(), alone_loss, packed_grads, alone_grads


@pytest.mark.parametrize(
    "arch,masked_path,tp",
    [
        ("llama", False, 1),
        ("gpt2", False, 1),
        ("llama", True, 1),
        ("llama", False, 2),
        ("gpt2", True, 2),
    ],
)
def test_packed_equals_each_conversation_alone(arch, masked_path, tp):
    outs = run_distributed(_packed_vs_alone, world_size=tp, tp=tp, args=(arch, masked_path))
    for logits, alone_logits, loss, alone_loss, grads, alone_grads in outs:
        torch.testing.assert_close(logits, alone_logits, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(loss, alone_loss, atol=2e-5, rtol=1e-5)
        assert grads.keys() == alone_grads.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], alone_grads[name], atol=1e-5, rtol=1e-4)


def test_packed_attention_mask_is_block_diagonal_causal():
    from megatron.core.transformer.dot_product_attention import packed_attention_mask

    cu = torch.tensor([0, 2, 5, 6, 8], dtype=torch.int32)  # 2 samples of 4: [2, 2] and [1, 1, 2]
    mask = packed_attention_mask(cu, 4, 2, causal=True)
    allowed = (~mask[:, 0]).int().tolist()
    assert allowed[0] == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]
    assert allowed[1] == [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]]


def test_rotary_positions_restart_per_segment():
    """RoPE is translation-invariant in attention (so the test above cannot see it); the angles
    themselves must be those of each token's position in its segment, as the dataset's
    position_ids (and Megatron's per-segment RoPE)."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.packed_seq_params import packed_seq_params_from_samples

    rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0)
    angles = rope(L)  # [L, 1, 1, 8]
    params = packed_seq_params_from_samples(_cu_seqlens(), torch.tensor([10, 19]))
    got = rope.packed_angles(L, params)  # [L, 2, 1, 8]
    assert got.shape == (L, 2, 1, 8)
    for i, lengths in enumerate(SAMPLES):
        start = 0
        for k, n in enumerate(lengths):
            end = L if k == len(lengths) - 1 else start + n
            torch.testing.assert_close(got[start:end, i], angles[: end - start, 0], rtol=0, atol=0)
            start = end
