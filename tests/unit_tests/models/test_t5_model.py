"""T5Model: Megatron's flat state-dict names (literal), the LM head's bias rule, and logits,
per-token loss and gradients against Hugging Face's MBartForConditionalGeneration with the same
random weights (its two embedding LayerNorms replaced by identity; positions at offset 2).
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

transformers = pytest.importorskip("transformers")

ATOL = 1e-5

#: Megatron core_r0.8.0's state-dict names of one encoder and one decoder layer (local spec,
#: tied), written out literally, with the shapes at h=32, ffn=64, vocab 128, 64 positions.
EXPECTED_KEYS = {
    'embedding.word_embeddings.weight': (128, 32),
    'embedding.position_embeddings.weight': (64, 32),
    'encoder.layers.0.input_layernorm.weight': (32,),
    'encoder.layers.0.input_layernorm.bias': (32,),
    'encoder.layers.0.self_attention.linear_qkv.weight': (96, 32),
    'encoder.layers.0.self_attention.linear_qkv.bias': (96,),
    'encoder.layers.0.self_attention.linear_qkv._extra_state': None,
    'encoder.layers.0.self_attention.linear_proj.weight': (32, 32),
    'encoder.layers.0.self_attention.linear_proj.bias': (32,),
    'encoder.layers.0.self_attention.linear_proj._extra_state': None,
    'encoder.layers.0.pre_mlp_layernorm.weight': (32,),
    'encoder.layers.0.pre_mlp_layernorm.bias': (32,),
    'encoder.layers.0.mlp.linear_fc1.weight': (64, 32),
    'encoder.layers.0.mlp.linear_fc1.bias': (64,),
    'encoder.layers.0.mlp.linear_fc1._extra_state': None,
    'encoder.layers.0.mlp.linear_fc2.weight': (32, 64),
    'encoder.layers.0.mlp.linear_fc2.bias': (32,),
    'encoder.layers.0.mlp.linear_fc2._extra_state': None,
    'encoder.final_layernorm.weight': (32,),
    'encoder.final_layernorm.bias': (32,),
    'decoder.layers.0.input_layernorm.weight': (32,),
    'decoder.layers.0.input_layernorm.bias': (32,),
    'decoder.layers.0.self_attention.linear_qkv.weight': (96, 32),
    'decoder.layers.0.self_attention.linear_qkv.bias': (96,),
    'decoder.layers.0.self_attention.linear_qkv._extra_state': None,
    'decoder.layers.0.self_attention.linear_proj.weight': (32, 32),
    'decoder.layers.0.self_attention.linear_proj.bias': (32,),
    'decoder.layers.0.self_attention.linear_proj._extra_state': None,
    'decoder.layers.0.pre_cross_attn_layernorm.weight': (32,),
    'decoder.layers.0.pre_cross_attn_layernorm.bias': (32,),
    'decoder.layers.0.cross_attention.linear_q.weight': (32, 32),
    'decoder.layers.0.cross_attention.linear_q.bias': (32,),
    'decoder.layers.0.cross_attention.linear_q._extra_state': None,
    'decoder.layers.0.cross_attention.linear_kv.weight': (64, 32),
    'decoder.layers.0.cross_attention.linear_kv.bias': (64,),
    'decoder.layers.0.cross_attention.linear_kv._extra_state': None,
    'decoder.layers.0.cross_attention.linear_proj.weight': (32, 32),
    'decoder.layers.0.cross_attention.linear_proj.bias': (32,),
    'decoder.layers.0.cross_attention.linear_proj._extra_state': None,
    'decoder.layers.0.pre_mlp_layernorm.weight': (32,),
    'decoder.layers.0.pre_mlp_layernorm.bias': (32,),
    'decoder.layers.0.mlp.linear_fc1.weight': (64, 32),
    'decoder.layers.0.mlp.linear_fc1.bias': (64,),
    'decoder.layers.0.mlp.linear_fc1._extra_state': None,
    'decoder.layers.0.mlp.linear_fc2.weight': (32, 64),
    'decoder.layers.0.mlp.linear_fc2.bias': (32,),
    'decoder.layers.0.mlp.linear_fc2._extra_state': None,
    'decoder.final_layernorm.weight': (32,),
    'decoder.final_layernorm.bias': (32,),
    'lm_head.output_layer.bias': (128,),
    'lm_head.output_layer._extra_state': None,
    'output_layer.bias': (128,),
    'output_layer._extra_state': None,
}


def _state_dicts():
    from tests.unit_tests.models.t5_test_utils import build_t5, tiny_config

    def shapes(model):
        return {k: (None if v is None else tuple(v.shape)) for k, v in model.state_dict().items()}

    tied = build_t5(tiny_config(num_layers=1), encoder_layers=1, decoder_layers=1, tied=True)
    untied = build_t5(tiny_config(num_layers=1), encoder_layers=1, decoder_layers=1, tied=False)
    return dict(
        tied=shapes(tied),
        untied=shapes(untied),
        same_module=tied.output_layer is tied.lm_head.output_layer,
        untied_bias_is_none=untied.output_layer.bias is None,
        model_type=str(tied.model_type),
    )


def test_state_dict_names_match_megatron():
    (out,) = run_distributed(_state_dicts, world_size=1)
    assert out['tied'] == EXPECTED_KEYS
    assert out['same_module']
    assert out['model_type'] == 'ModelType.encoder_and_decoder'
    # Untied: the head gets a weight under both names and no bias at all.
    expected_untied = {
        k: v for k, v in EXPECTED_KEYS.items() if not k.endswith('output_layer.bias')
    }
    expected_untied['output_layer.weight'] = (128, 32)
    expected_untied['lm_head.output_layer.weight'] = (128, 32)
    assert out['untied'] == expected_untied
    assert out['untied_bias_is_none']


def _compare_with_mbart():
    from transformers import MBartForConditionalGeneration

    from tests.unit_tests.models import t5_test_utils as tu

    torch.manual_seed(0)
    model = tu.build_t5(tu.tiny_config())
    tu.randomize(model, seed=5)
    model.eval()
    hf = tu.patch_mbart(MBartForConditionalGeneration(tu.mbart_config()))
    hf.eval()
    tu.load_into_mbart(model.state_dict(), hf)

    batch = tu.random_batch(batch_size=3, seed=7)
    enc_pad = (batch['text_enc'] != tu.PAD).long()
    dec_pad = (batch['text_dec'] != tu.PAD).long()
    hf_logits = hf(
        input_ids=batch['text_enc'],
        attention_mask=enc_pad,
        decoder_input_ids=batch['text_dec'],
        decoder_attention_mask=dec_pad,
    ).logits
    v = hf_logits.size(-1)
    labels = batch['labels'].clamp(min=0)
    hf_loss = torch.nn.functional.cross_entropy(
        hf_logits.reshape(-1, v), labels.reshape(-1), reduction='none'
    ).view(labels.shape)
    (hf_loss * batch['loss_mask']).sum().backward()

    logits = model(*tu.model_inputs(batch))
    loss = model(*tu.model_inputs(batch), lm_labels=batch['labels'])
    (loss * batch['loss_mask']).sum().backward()
    # named_parameters() lists the head's bias once, under its first name (lm_head.output_layer).
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads['output_layer.bias'] = grads.pop('lm_head.output_layer.bias')

    # Unpatched MBart (embedding LayerNorms in place) must differ: the test can see a mismatch.
    unpatched = MBartForConditionalGeneration(tu.mbart_config())
    unpatched = tu.patch_mbart(unpatched)
    unpatched.model.encoder.layernorm_embedding = torch.nn.LayerNorm(tu.HIDDEN)
    unpatched.model.decoder.layernorm_embedding = torch.nn.LayerNorm(tu.HIDDEN)
    unpatched.eval()
    tu.load_into_mbart(model.state_dict(), unpatched)
    unpatched_logits = unpatched(
        input_ids=batch['text_enc'],
        attention_mask=enc_pad,
        decoder_input_ids=batch['text_dec'],
        decoder_attention_mask=dec_pad,
    ).logits
    return dict(
        real=dec_pad.bool(),
        logits=logits.detach(),
        hf_logits=hf_logits.detach(),
        unpatched_logits=unpatched_logits.detach(),
        loss=loss.detach(),
        hf_loss=hf_loss.detach(),
        grads=grads,
        hf_grads=tu.mbart_grads_as_megatron(hf),
    )


def test_logits_loss_and_grads_match_mbart():
    (out,) = run_distributed(_compare_with_mbart, world_size=1)
    real = out['real']
    assert real.sum() < real.numel()  # the batch has padded decoder positions
    torch.testing.assert_close(out['logits'][real], out['hf_logits'][real], atol=ATOL, rtol=0)
    torch.testing.assert_close(out['loss'][real], out['hf_loss'][real], atol=ATOL, rtol=0)
    assert (out['unpatched_logits'][real] - out['hf_logits'][real]).abs().max() > 1e-2
    assert set(out['hf_grads']) == set(out['grads'])
    for name, g in out['hf_grads'].items():
        torch.testing.assert_close(out['grads'][name], g, atol=ATOL, rtol=1e-4, msg=name)
