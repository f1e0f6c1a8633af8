"""Multi-token prediction against the Hugging Face MTP layer math (transformers' `MtpLayer` with
Llama decoder layers; a tiny random config built here).

- Depth-1 logits of our GPTModel's MTP layer equal HF's MtpLayer fed ids[:, 1:] and the main
  hidden state [:, :-1] (positions shifted by one: RoPE attention is shift invariant), at TP=1
  and TP=2.
- The recorded `mtp_1 loss` is the masked mean CE of those logits against labels rolled once.
- The loss reaches the gradient: after backward of the main loss alone, eh_proj's gradient is
  mtp_loss_scaling_factor x dL_1/dW.
- Layouts MTP cannot run are refused at config time.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

V, S, B, H, N, L = 48, 10, 2, 32, 4, 2
FACTOR = 0.3


def _hf():
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_layers import MtpLayer
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

    torch.manual_seed(5)
    config = LlamaConfig(
        vocab_size=V,
        hidden_size=H,
        intermediate_size=48,
        num_hidden_layers=L,
        num_attention_heads=N,
        num_key_value_heads=N,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    config._attn_implementation = 'eager'
    model = LlamaForCausalLM(config).eval()
    mtp = MtpLayer(config, LlamaDecoderLayer, LlamaRMSNorm, layer_idx=L).eval()
    with torch.no_grad():
        for p in list(model.parameters()) + list(mtp.parameters()):
            if p.dim() == 1:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    return model, mtp


def _mapped_state(model, mtp):
    import types

    from megatron.core.models.gpt.hf_weight_mapping import llama_hf_to_mcore_state_dict

    core = types.SimpleNamespace(num_attention_heads=N, num_query_groups=N, kv_channels=H // N)
    full = llama_hf_to_mcore_state_dict(model.state_dict(), core)
    block = {
        'model.layers.0.' + k[len('mtp_block.') :]: v
        for k, v in mtp.state_dict().items()
        if k.startswith('mtp_block.')
    }
    block.update({'model.embed_tokens.weight': full['embedding.word_embeddings.weight'] * 0})
    block['model.norm.weight'] = mtp.post_norm.weight
    inner = llama_hf_to_mcore_state_dict(block, core)
    for k, v in inner.items():
        if k.startswith('decoder.layers.0.'):
            full['mtp.layers.0.transformer_layer.' + k[len('decoder.layers.0.') :]] = v
    for name in ('enorm', 'hnorm'):
        full[f'mtp.layers.0.{name}.weight'] = getattr(mtp, name).weight.detach()
    full['mtp.layers.0.eh_proj.weight'] = mtp.eh_proj.weight.detach()
    full['mtp.layers.0.final_layernorm.weight'] = mtp.post_norm.weight.detach()
    return full


def _mtp_vs_hf():
    import torch.nn.functional as F

    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.hf_weight_mapping import split_state_dict_for_tensor_parallel
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import (
        clear_mtp_loss_tracker,
        mtp_loss_tracker,
        roll_left,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    tp = parallel_state.get_tensor_model_parallel_world_size()
    hf, hf_mtp = _hf()
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(1))
    labels = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(2))
    mask = (torch.rand(B, S, generator=torch.Generator().manual_seed(3)) > 0.3).float()

    # HF reference: the MTP layer on ids[:, 1:] and the main hidden state [:, :-1].
    with torch.no_grad():
        main = hf.model(ids).last_hidden_state  # [b, s, h], after the final norm
        positions = torch.arange(1, S).unsqueeze(0).expand(B, -1)
        embeds = hf.model.embed_tokens(ids[:, 1:])
        rope = hf.model.rotary_emb(embeds, positions)
        causal = torch.full((S - 1, S - 1), float('-inf')).triu(1).expand(B, 1, S - 1, S - 1)
        h1 = hf_mtp(embeds, main[:, :-1], rope, causal, positions, None)
        hf_logits = hf.lm_head(h1)  # [b, s-1, v]
        target, weight = labels[:, 1:], mask[:, 1:]
        ce = F.cross_entropy(hf_logits.reshape(-1, V), target.reshape(-1), reduction='none')
        hf_loss = (ce * weight.reshape(-1)).sum() / weight.sum()

    config = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=N,
        ffn_hidden_size=48,
        normalization='RMSNorm',
        layernorm_epsilon=1e-6,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=1,
        mtp_loss_scaling_factor=FACTOR,
        tensor_model_parallel_size=tp,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config,
        get_gpt_layer_local_spec(),
        vocab_size=V,
        max_sequence_length=64,
        position_embedding_type='rope',
    )
    shard = split_state_dict_for_tensor_parallel(_mapped_state(hf, hf_mtp), config, tp)[
        parallel_state.get_tensor_model_parallel_rank()
    ]
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected and all(k.endswith('_extra_state') for k in missing), (
        missing,
        unexpected,
    )

    with torch.no_grad():
        rotary = model.rotary_pos_emb(S)
        hidden = model.decoder(
            model.embedding(input_ids=ids, position_ids=None), None, rotary_pos_emb=rotary
        )
        layer = model.mtp.layers[0]
        h_ours = layer(
            model.embedding(input_ids=roll_left(ids), position_ids=None), hidden, None, rotary
        )
        logits = gather_from_tensor_model_parallel_region(model.output_logits(h_ours))
        logits = logits.transpose(0, 1)[:, : S - 1]  # [b, s-1, v]

    # The recorded loss and its gradient (the schedule's scale left at 1).
    MoEAuxLossAutoScaler.set_loss_scale(None)
    clear_mtp_loss_tracker()
    model.train()
    token_loss = model(ids, None, None, labels=labels, loss_mask=mask)
    ((token_loss * mask).sum() / mask.sum()).backward()
    recorded = mtp_loss_tracker()[1].clone()
    grad = layer.eh_proj.weight.grad.clone()
    model.zero_grad()
    (l1,) = model.mtp.losses(
        hidden.detach(),
        input_ids=ids,
        position_ids=None,
        labels=labels,
        loss_mask=mask,
        embedding=model.embedding,
        token_losses=lambda h, y: model.compute_language_model_loss(y, model.output_logits(h)),
        rotary_pos_emb=rotary,
    )
    (FACTOR * l1).backward()
    clear_mtp_loss_tracker()
    return dict(
        logits=logits,
        hf_logits=hf_logits,
        recorded=recorded,
        hf_loss=hf_loss,
        grad=grad,
        grad_ref=layer.eh_proj.weight.grad,
    )


@pytest.mark.parametrize('tp', [1, 2])
def test_mtp_equals_hf_mtp_layer(tp):
    for res in run_distributed(_mtp_vs_hf, tp, tp=tp):
        torch.testing.assert_close(res['logits'], res['hf_logits'], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res['recorded'], res['hf_loss'], atol=1e-5, rtol=1e-5)
        assert res['grad'].abs().sum() > 0
        torch.testing.assert_close(res['grad'], res['grad_ref'], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize(
    'change,message',
    [
        (
            dict(
                pipeline_model_parallel_size=2,
                virtual_pipeline_model_parallel_size=2,
                pipeline_dtype=torch.float32,
                num_layers=4,
            ),
            'virtual_pipeline_model_parallel_size',
        ),
        (dict(mtp_num_layers=0), 'positive integer'),
    ],
)
def test_mtp_refuses_layouts_it_cannot_run(change, message):
    from megatron.core.transformer.transformer_config import TransformerConfig

    kwargs = dict(num_layers=2, hidden_size=32, num_attention_heads=4, mtp_num_layers=1)
    kwargs.update(change)
    with pytest.raises(ValueError, match=message):
        TransformerConfig(**kwargs)


def _packed_mtp_vs_alone():
    """The MTP loss of two documents packed in one row (their boundaries in PackedSeqParams) and
    of each document alone: per document, ids, labels and mask roll within the document."""
    import torch.nn.functional as F

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.packed_seq_params import packed_seq_params_from_samples
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import (
        clear_mtp_loss_tracker,
        mtp_loss_tracker,
        roll_left,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(11)
    config = TransformerConfig(
        num_layers=L,
        hidden_size=H,
        num_attention_heads=N,
        ffn_hidden_size=48,
        normalization='RMSNorm',
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mtp_num_layers=2,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=V, max_sequence_length=64,
        position_embedding_type='rope',
    ).eval()  # fmt: skip
    MoEAuxLossAutoScaler.set_loss_scale(None)
    g = torch.Generator().manual_seed(4)
    docs = [
        (torch.randint(0, V, (1, n), generator=g), torch.randint(0, V, (1, n), generator=g))
        for n in (7, 9)
    ]
    masks = [torch.ones(1, 7), (torch.rand(1, 9, generator=g) > 0.2).float()]

    def recorded(ids, labels, mask, **kw):
        clear_mtp_loss_tracker()
        model.train()
        with torch.no_grad():
            model(ids, None, None, labels=labels, loss_mask=mask, **kw)
        return {depth: float(loss) for depth, loss in mtp_loss_tracker().items()}

    alone = [recorded(ids, labels, mask) for (ids, labels), mask in zip(docs, masks)]
    packed_ids = torch.cat([d[0] for d in docs], dim=1)
    packed_labels = torch.cat([d[1] for d in docs], dim=1)
    packed_mask = torch.cat(masks, dim=1)
    # One sample of 16 tokens: segment starts 0 and 7, right-filled with 16 ([b, s + 1]).
    cu_seqlens = torch.tensor([[0, 7] + [16] * 15], dtype=torch.int32)
    params = packed_seq_params_from_samples(cu_seqlens, torch.tensor([9], dtype=torch.int32))
    packed = recorded(packed_ids, packed_labels, packed_mask, packed_seq_params=params)
    unbounded = recorded(packed_ids, packed_labels, packed_mask)  # one document of 16
    expected = {}
    for depth in (1, 2):
        counts = []
        for mask in masks:
            rolled = mask
            for _ in range(depth):
                rolled = roll_left(rolled)
            counts.append(float(rolled.sum()))
        total = sum(c * a[depth] for c, a in zip(counts, alone))
        expected[depth] = total / sum(counts)
    clear_mtp_loss_tracker()
    return packed, expected, unbounded


def test_packed_documents_roll_within_each_document():
    packed, expected, unbounded = run_distributed(_packed_mtp_vs_alone, 1)[0]
    for depth in (1, 2):
        assert packed[depth] == pytest.approx(expected[depth], rel=1e-5)
        # Rolled across the boundary (and attending across it), the losses differ.
        assert unbounded[depth] != pytest.approx(expected[depth], rel=1e-3)
