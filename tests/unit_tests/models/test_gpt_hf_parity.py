"""GPTModel against independent implementations: transformers' GPT2LMHeadModel and
LlamaForCausalLM built from tiny configs with random weights (nothing is downloaded).

The HF weights are mapped with megatron/core/models/gpt/hf_weight_mapping.py (the reusable
converter code); logits, per-token loss and parameter gradients must agree in fp32.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

ATOL = 1e-4


def _randomize(model, seed):
    """Random values in every parameter (HF inits biases to 0 and norms to 1, which would hide
    mapping mistakes)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.05
            if p.dim() == 1 and ("ln" in name or "norm" in name) and name.endswith("weight"):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise * 2)


def _hf_per_token_loss(hf_logits, labels):
    v = hf_logits.size(-1)
    return torch.nn.functional.cross_entropy(
        hf_logits.reshape(-1, v), labels.reshape(-1), reduction="none"
    ).view(labels.shape)


def _compare(arch):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import hf_weight_mapping as hfm
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models.gpt_test_utils import batch, grads_of

    torch.manual_seed(0)
    if arch == "gpt2":
        hf_config = GPT2Config(
            vocab_size=128,
            n_positions=32,
            n_embd=32,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
        hf = GPT2LMHeadModel(hf_config)
        kw = hfm.gpt2_config_kwargs(hf_config)
        to_mcore, to_hf = hfm.gpt2_hf_to_mcore_state_dict, hfm.mcore_to_gpt2_hf_state_dict
    else:
        hf_config = LlamaConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_theta=5000.0,
            attn_implementation="eager",
        )
        hf = LlamaForCausalLM(hf_config)
        kw = hfm.llama_config_kwargs(hf_config)
        to_mcore, to_hf = hfm.llama_hf_to_mcore_state_dict, hfm.mcore_to_llama_hf_state_dict
    _randomize(hf, 1)
    hf.eval()

    config = TransformerConfig(**kw["config"])
    model = GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(), **kw["model"]
    )
    model.eval()

    hf_sd = {k: v for k, v in hf.state_dict().items()}
    mcore_sd = to_mcore(hf_sd, config)
    missing, unexpected = model.load_state_dict(mcore_sd, strict=False)
    # Only the (None) `_extra_state` entries of the linear layers are not weights.
    assert not unexpected and all(k.endswith("._extra_state") for k in missing), (
        missing,
        unexpected,
    )

    # The reverse mapping reproduces the HF parameters exactly.
    back = to_hf(mcore_sd, config)
    for name, p in hf.named_parameters():
        assert torch.equal(back[name], p.detach()), name

    tokens, labels = batch(seed=3, batch_size=2, seq=16)
    position_ids = torch.arange(16).unsqueeze(0).expand(2, -1)

    hf_logits = hf(input_ids=tokens).logits
    hf_loss = _hf_per_token_loss(hf_logits, labels)
    hf_loss.sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}

    logits = model(tokens, position_ids, None)
    # Explicit causal mask (the non-SDPA attention path) must give the same logits.
    causal = torch.triu(torch.ones(16, 16, dtype=torch.bool), diagonal=1).expand(2, 1, 16, 16)
    logits_masked = model(tokens, position_ids, causal)
    loss = model(tokens, position_ids, None, labels=labels)
    loss.sum().backward()
    grads = to_hf(grads_of(model), config)

    return dict(
        hf_logits=hf_logits.detach(),
        logits=logits.detach(),
        logits_masked=logits_masked.detach(),
        hf_loss=hf_loss.detach(),
        loss=loss.detach(),
        hf_grads=hf_grads,
        grads={n: grads[n] for n in hf_grads},
        loss_dtype=str(loss.dtype),
        loss_shape=tuple(loss.shape),
    )


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_gpt_model_matches_transformers(arch):
    (out,) = run_distributed(_compare, world_size=1, args=(arch,))
    assert out["loss_shape"] == (2, 16) and out["loss_dtype"] == "torch.float32"
    torch.testing.assert_close(out["logits"], out["hf_logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["logits_masked"], out["hf_logits"], atol=ATOL, rtol=0)
    torch.testing.assert_close(out["loss"], out["hf_loss"], atol=ATOL, rtol=0)
    for name, g in out["hf_grads"].items():
        torch.testing.assert_close(out["grads"][name], g, atol=ATOL, rtol=1e-4, msg=name)
