"""BertModel against Hugging Face `MegatronBertForPreTraining` (same architecture: pre-LN layers,
final LayerNorm, no embedding LayerNorm, tied decoder with bias), plus megatron-core's literal
state-dict key set, the padding mask and the layer-spec names.

HF models are built from tiny configs with random weights (nothing is downloaded); the weights are
mapped with megatron/core/models/bert/hf_weight_mapping.py. Settings for exact parity: fp32,
dropout 0, exact GeLU in the MLP and the head, LayerNorm eps 1e-5. megatron-core also masks the
rows of pad queries (HF does not), so logits are compared at non-pad positions only; gradients of
a loss over non-pad positions match everywhere.
"""

import logging

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

ATOL = 1e-5


def _randomize(model, seed):
    """Random values in every parameter (HF inits biases to 0 and norms to 1, which would hide
    mapping mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            if p.dim() == 1 and ("ln" in name or "LayerNorm" in name) and name.endswith("weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise * 2)


def _compare(binary_head):
    from transformers import MegatronBertConfig, MegatronBertForPreTraining

    from megatron.core.models.bert import hf_weight_mapping as hfm
    from megatron.core.models.bert.bert_layer_specs import bert_layer_local_spec
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models import bert_test_utils as U

    hf_config = MegatronBertConfig(
        vocab_size=U.VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=U.MAX_POS,
        type_vocab_size=2,
        hidden_act="gelu",
        layer_norm_eps=1e-5,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    hf = MegatronBertForPreTraining(hf_config)
    _randomize(hf, 1)
    if not binary_head:
        # A BertModel without token types maps to an all-zero HF token-type table.
        with torch.no_grad():
            hf.bert.embeddings.token_type_embeddings.weight.zero_()
    hf.eval()

    kw = hfm.megatron_bert_config_kwargs(hf_config)
    config = TransformerConfig(use_cpu_initialization=True, **kw["config"])
    model_kw = dict(kw["model"])
    if not binary_head:
        model_kw["num_tokentypes"] = 0
    model = BertModel(
        config=config,
        transformer_layer_spec=bert_layer_local_spec,
        add_binary_head=binary_head,
        **model_kw,
    )
    model.eval()

    hf_sd = dict(hf.state_dict())
    mcore_sd = hfm.megatron_bert_hf_to_mcore_state_dict(hf_sd, config)
    if not binary_head:
        mcore_sd = {
            k: v
            for k, v in mcore_sd.items()
            if not k.startswith(("binary_head.", "pooler.", "embedding.tokentype"))
        }
    missing, unexpected = model.load_state_dict(mcore_sd, strict=False)
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (
        missing,
        unexpected,
    )
    # The reverse mapping gives back the HF parameters exactly.
    back = hfm.mcore_to_megatron_bert_hf_state_dict(model.state_dict(), config)
    for name, p in hf.named_parameters():
        if binary_head or not name.startswith(("cls.seq_relationship", "bert.pooler")):
            assert torch.equal(back[name], p.detach()), name

    b = U.batch()
    real = b["padding_mask"].bool()
    types = b["types"] if binary_head else None

    hf_out = hf(
        input_ids=b["ids"],
        attention_mask=b["padding_mask"],
        token_type_ids=b["types"] if binary_head else None,
    )
    hf_lm = torch.nn.functional.cross_entropy(
        hf_out.prediction_logits.reshape(-1, U.VOCAB),
        b["labels"].clamp(min=0).reshape(-1),
        reduction="none",
    ).view(b["labels"].shape)
    hf_loss = (hf_lm * b["loss_mask"]).sum() / b["loss_mask"].sum()
    if binary_head:
        hf_loss = hf_loss + torch.nn.functional.cross_entropy(
            hf_out.seq_relationship_logits, b["is_random"]
        )
    hf_loss.backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    if not binary_head:
        # The zero token-type table stands for "no table": it has no megatron-core gradient.
        del hf_grads["bert.embeddings.token_type_embeddings.weight"]

    with torch.no_grad():
        logits, binary_logits = model(b["ids"], b["padding_mask"], tokentype_ids=types)
    lm_loss, binary_logits_2 = model(
        b["ids"], b["padding_mask"], tokentype_ids=types, lm_labels=b["labels"]
    )
    loss = (lm_loss * b["loss_mask"]).sum() / b["loss_mask"].sum()
    if binary_head:
        loss = loss + torch.nn.functional.cross_entropy(binary_logits_2, b["is_random"])
    loss.backward()
    grads = {
        n: (p.grad if p.grad is not None else torch.zeros_like(p)).clone()
        for n, p in model.named_parameters()
    }
    grads = hfm.mcore_to_megatron_bert_hf_state_dict(grads, config)

    return dict(
        logits=logits[real],
        hf_logits=hf_out.prediction_logits.detach()[real],
        pad_logit_gap=(logits[~real] - hf_out.prediction_logits.detach()[~real]).abs().max(),
        binary_logits=binary_logits,
        hf_binary_logits=hf_out.seq_relationship_logits.detach(),
        loss=loss.detach(),
        hf_loss=hf_loss.detach(),
        lm_loss_dtype=str(lm_loss.dtype),
        grads={n: grads[n] for n in hf_grads},
        hf_grads=hf_grads,
    )


@pytest.mark.parametrize("binary_head", [True, False])
def test_bert_model_matches_megatron_bert_hf(binary_head):
    (out,) = run_distributed(_compare, world_size=1, args=(binary_head,))
    torch.testing.assert_close(out["logits"], out["hf_logits"], atol=ATOL, rtol=0)
    # Pad query rows are fully masked here (not in HF), so those logits differ.
    assert out["pad_logit_gap"] > 1e-4
    if binary_head:
        torch.testing.assert_close(out["binary_logits"], out["hf_binary_logits"], atol=ATOL, rtol=0)
    else:
        assert out["binary_logits"] is None
    assert out["lm_loss_dtype"] == "torch.float32"
    torch.testing.assert_close(out["loss"], out["hf_loss"], atol=ATOL, rtol=0)
    assert out["grads"].keys() == out["hf_grads"].keys()
    for name, g in out["hf_grads"].items():
        torch.testing.assert_close(out["grads"][name], g, atol=ATOL, rtol=1e-4, msg=name)


# megatron-core's flat state-dict keys of a 2-layer BERT, local spec, tied, binary head.
_LAYER_KEYS = [
    "input_layernorm.weight",
    "input_layernorm.bias",
    "self_attention.linear_proj.weight",
    "self_attention.linear_proj.bias",
    "self_attention.linear_proj._extra_state",
    "self_attention.linear_qkv.weight",
    "self_attention.linear_qkv.bias",
    "self_attention.linear_qkv._extra_state",
    "pre_mlp_layernorm.weight",
    "pre_mlp_layernorm.bias",
    "mlp.linear_fc1.weight",
    "mlp.linear_fc1.bias",
    "mlp.linear_fc1._extra_state",
    "mlp.linear_fc2.weight",
    "mlp.linear_fc2.bias",
    "mlp.linear_fc2._extra_state",
]
MCORE_BERT_KEYS = (
    [
        "embedding.word_embeddings.weight",
        "embedding.position_embeddings.weight",
        "embedding.tokentype_embeddings.weight",
    ]
    + [f"encoder.layers.{i}.{k}" for i in range(2) for k in _LAYER_KEYS]
    + [
        "encoder.final_layernorm.weight",
        "encoder.final_layernorm.bias",
        "lm_head.dense.weight",
        "lm_head.dense.bias",
        "lm_head.layer_norm.weight",
        "lm_head.layer_norm.bias",
        "output_layer.bias",
        "output_layer._extra_state",
        "binary_head.weight",
        "binary_head.bias",
        "pooler.dense.weight",
        "pooler.dense.bias",
    ]
)


def _state_dict_shapes(model_overrides):
    from tests.unit_tests.models import bert_test_utils as U

    model, _ = U.build_bert(U.tiny_bert_kwargs(), **model_overrides)
    return {k: (None if v is None else tuple(v.shape)) for k, v in model.state_dict().items()}


def test_state_dict_keys_are_mcore_names():
    (tied,) = run_distributed(_state_dict_shapes, world_size=1, args=({},))
    assert list(tied) == MCORE_BERT_KEYS
    assert tied["embedding.word_embeddings.weight"] == (128, 32)
    assert tied["embedding.tokentype_embeddings.weight"] == (2, 32)
    assert tied["encoder.layers.0.self_attention.linear_qkv.weight"] == (96, 32)
    assert tied["output_layer.bias"] == (128,)
    assert tied["binary_head.weight"] == (2, 32)
    assert tied["encoder.layers.1.mlp.linear_fc2._extra_state"] is None

    (untied_plain,) = run_distributed(
        _state_dict_shapes,
        world_size=1,
        args=(
            {
                "share_embeddings_and_output_weights": False,
                "add_binary_head": False,
                "num_tokentypes": 0,
            },
        ),
    )
    expected = [
        k
        for k in MCORE_BERT_KEYS
        if not k.startswith(("binary_head.", "pooler.", "embedding.tokentype"))
    ]
    expected.insert(expected.index("output_layer.bias"), "output_layer.weight")
    assert list(untied_plain) == expected


def _tp2_shapes():
    return _state_dict_shapes({})


def test_state_dict_shapes_tp2():
    outs = run_distributed(_tp2_shapes, world_size=2, tp=2)
    for shapes in outs:
        assert list(shapes) == MCORE_BERT_KEYS
        assert shapes["embedding.word_embeddings.weight"] == (64, 32)
        assert shapes["encoder.layers.0.self_attention.linear_qkv.weight"] == (48, 32)
        assert shapes["encoder.layers.0.self_attention.linear_proj.weight"] == (32, 16)
        assert shapes["encoder.layers.0.mlp.linear_fc1.bias"] == (64,)
        assert shapes["output_layer.bias"] == (64,)
        assert shapes["lm_head.dense.weight"] == (32, 32)


def test_extended_attention_mask_masks_pad_queries_and_keys():
    from megatron.core.models.bert.bert_model import bert_extended_attention_mask

    padding_mask = torch.tensor([[1, 1, 1, 0]])
    mask = bert_extended_attention_mask(padding_mask)
    assert mask.dtype == torch.bool and mask.shape == (1, 1, 4, 4)
    expected = torch.tensor(
        [
            [False, False, False, True],
            [False, False, False, True],
            [False, False, False, True],
            [True, True, True, True],
        ]
    )
    assert torch.equal(mask[0, 0], expected)


def test_transformer_engine_spec_name_falls_back_to_local(caplog):
    from megatron.core.models.bert import bert_layer_specs

    with caplog.at_level(logging.WARNING):
        spec = bert_layer_specs.bert_layer_with_transformer_engine_spec
    assert spec is bert_layer_specs.bert_layer_local_spec
    assert len(caplog.records) == 1 and "Transformer Engine" in caplog.records[0].getMessage()
    with pytest.raises(AttributeError):
        bert_layer_specs.no_such_spec  # noqa: B018


def _embeddings():
    from tests.unit_tests.models import bert_test_utils as U

    model, _ = U.build_bert(U.tiny_bert_kwargs(), return_embeddings=True)
    model.eval()
    b = U.batch()
    with torch.no_grad():
        emb = model(b["ids"], b["padding_mask"], tokentype_ids=b["types"])
        hidden = {}
        model.encoder.register_forward_hook(lambda m, i, o: hidden.setdefault("h", o))
        model(b["ids"], b["padding_mask"], tokentype_ids=b["types"])
    return emb, hidden["h"], b["padding_mask"]


def test_return_embeddings_mean_pools_between_cls_and_last_sep():
    ((emb, hidden, padding_mask),) = run_distributed(_embeddings, world_size=1)
    assert emb.shape == (2, 32) and emb.dtype == torch.float32
    n1 = int(padding_mask[1].sum())  # 11 real tokens
    torch.testing.assert_close(emb[0], hidden[1:15, 0].mean(0))
    torch.testing.assert_close(emb[1], hidden[1 : n1 - 1, 1].mean(0))
