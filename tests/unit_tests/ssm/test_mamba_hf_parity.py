"""MambaModel against transformers' Mamba2ForCausalLM (pure Mamba) and NemotronHForCausalLM
(hybrid Mamba / attention / MLP), built from tiny random configs (nothing is downloaded).

HF weights are mapped with megatron/core/models/mamba/hf_weight_mapping.py; logits, the
per-token loss and every parameter gradient must agree in fp32, and the reverse mapping must
give back the HF tensors bitwise.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

ATOL = 1e-4
SEQ = 20  # not a multiple of the scan chunks below
VOCAB = 64


def _randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            if name.endswith('norm.weight') or name.endswith('norm_f.weight'):
                p.copy_(1.0 + noise)
            elif name.endswith('A_log'):
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7 + 1))
            elif name.endswith('dt_bias'):
                p.copy_(noise * 10 - 2.0)
            else:
                p.copy_(noise * 3)


def _hf_model(kind):
    if kind == 'mamba2':
        from transformers import Mamba2Config, Mamba2ForCausalLM

        cfg = Mamba2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            num_heads=4,
            head_dim=16,
            state_size=8,
            n_groups=2,
            expand=2,
            num_hidden_layers=2,
            conv_kernel=4,
            chunk_size=8,
            use_bias=False,
            use_conv_bias=True,
            layer_norm_epsilon=1e-5,
            residual_in_fp32=False,
            tie_word_embeddings=True,
        )
        return Mamba2ForCausalLM(cfg), cfg
    from transformers import NemotronHConfig, NemotronHForCausalLM

    cfg = NemotronHConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        layers_block_type=['mamba', 'attention', 'mlp', 'mamba'],
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=8,
        n_groups=2,
        conv_kernel=4,
        chunk_size=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        mlp_hidden_act='relu2',
        use_bias=False,
        use_conv_bias=True,
        attention_bias=False,
        mlp_bias=False,
        layer_norm_epsilon=1e-5,
        attn_implementation='eager',
    )
    hf = NemotronHForCausalLM(cfg)
    # Megatron never clamps dt; NemotronH's prefill clamps at time_step_min.
    for module in hf.modules():
        if hasattr(module, 'time_step_limit'):
            module.time_step_limit = (0.0, float('inf'))
    return hf, cfg


def _compare(kind):
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba import hf_weight_mapping as hfm
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    hf, cfg = _hf_model(kind)
    _randomize(hf, 1)
    hf.eval()
    kw = hfm.mamba_config_kwargs(cfg)
    config = TransformerConfig(**kw['config'], use_cpu_initialization=True)
    model = MambaModel(config=config, mamba_stack_spec=mamba_stack_spec, **kw['model'])
    model.eval()
    pattern = kw['model']['hybrid_override_pattern']
    tied = kw['model']['share_embeddings_and_output_weights']
    hf_sd = dict(hf.state_dict())
    sd = hfm.hf_to_mcore_state_dict(hf_sd, config, pattern, tied=tied)
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith('._extra_state') for k in missing), (
        missing,
        unexpected,
    )
    prefix = 'backbone.' if kind == 'mamba2' else 'model.'
    back = hfm.mcore_to_hf_state_dict(sd, config, pattern, prefix=prefix)
    for name, p in hf.named_parameters():
        assert torch.equal(back[name], p.detach()), name

    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (2, SEQ), generator=g)
    hf_logits = hf(input_ids=tokens).logits
    hf_loss = torch.nn.functional.cross_entropy(
        hf_logits.reshape(-1, VOCAB), labels.reshape(-1), reduction='none'
    ).view(2, SEQ)
    hf_loss.sum().backward()
    hf_grads = {n: p.grad.clone() for n, p in hf.named_parameters()}

    logits = model(tokens, None, None)
    loss = model(tokens, None, None, labels=labels)
    loss.sum().backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads = hfm.mcore_to_hf_state_dict(grads, config, pattern, prefix=prefix)
    return dict(
        hf_logits=hf_logits.detach(),
        logits=logits.detach(),
        hf_loss=hf_loss.detach(),
        loss=loss.detach(),
        hf_grads=hf_grads,
        grads={n: grads[n] for n in hf_grads},
    )


@pytest.mark.parametrize('kind', ['mamba2', 'nemotron_h'])
def test_mamba_model_matches_transformers(kind):
    (out,) = run_distributed(_compare, world_size=1, args=(kind,))
    assert out['logits'].abs().max() > 0.1
    torch.testing.assert_close(out['logits'], out['hf_logits'], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(out['loss'], out['hf_loss'], atol=ATOL, rtol=1e-4)
    for name, g in out['hf_grads'].items():
        torch.testing.assert_close(out['grads'][name], g, atol=ATOL, rtol=1e-3, msg=name)


def _greedy(kind):
    from megatron.core.inference_params import InferenceParams
    from megatron.core.models.mamba import MambaModel
    from megatron.core.models.mamba import hf_weight_mapping as hfm
    from megatron.core.models.mamba.mamba_layer_specs import mamba_stack_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(0)
    hf, cfg = _hf_model(kind)
    _randomize(hf, 2)
    hf.eval()
    kw = hfm.mamba_config_kwargs(cfg)
    config = TransformerConfig(**kw['config'], use_cpu_initialization=True)
    model = MambaModel(config=config, mamba_stack_spec=mamba_stack_spec, **kw['model'])
    model.eval()
    pattern = kw['model']['hybrid_override_pattern']
    tied = kw['model']['share_embeddings_and_output_weights']
    model.load_state_dict(
        hfm.hf_to_mcore_state_dict(dict(hf.state_dict()), config, pattern, tied=tied), strict=False
    )
    prompt = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(4))
    new = 8
    # No end-of-sequence token: generate must neither stop at it nor suppress it.
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        hf_out = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new, do_sample=False,
            pad_token_id=0,
        )  # fmt: skip
        params = InferenceParams(max_batch_size=2, max_sequence_length=prompt.shape[1] + new)
        tokens, step_input = prompt, prompt
        for _ in range(new):
            logits = model(step_input, None, None, inference_params=params)
            params.sequence_len_offset += step_input.shape[1]
            step_input = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, step_input], dim=1)
    return hf_out, tokens


@pytest.mark.parametrize('kind', ['mamba2', 'nemotron_h'])
def test_greedy_decode_matches_hf_generate(kind):
    """Prefill then one-token steps through the conv / SSM (and KV) caches give Hugging Face
    generate's greedy tokens."""
    ((hf_out, ours),) = run_distributed(_greedy, world_size=1, args=(kind,))
    assert torch.equal(ours, hf_out), (ours, hf_out)
