"""Shared pieces of the T5 model tests: a tiny config, random batches with padding, the three masks
built as Megatron's T5 dataset and pretrain_t5.get_batch build them, and the weight mapping to
Hugging Face's MBartForConditionalGeneration.
"""

import torch

from megatron.core import parallel_state

VOCAB, MAX_POS, HIDDEN, HEADS, FFN = 128, 64, 32, 4, 64
S_ENC, S_DEC = 16, 8
PAD = 0


def tiny_config(num_layers=2, **overrides):
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(
        num_layers=num_layers,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=FFN,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
        pipeline_model_parallel_split_rank=parallel_state.get_pipeline_model_parallel_split_rank(),
        pipeline_dtype=torch.float32,
        finalize_model_grads_func=finalize_model_grads,
    )
    kw.update(overrides)
    return TransformerConfig(**kw)


def build_t5(
    config,
    encoder_layers=2,
    decoder_layers=2,
    pre_process=True,
    post_process=True,
    add_encoder=True,
    add_decoder=True,
    tied=True,
):
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_local_block_spec,
    )

    return T5Model(
        config,
        get_t5_encoder_with_local_block_spec(encoder_layers),
        get_t5_decoder_with_local_block_spec(decoder_layers),
        vocab_size=VOCAB,
        max_sequence_length=MAX_POS,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=tied,
        add_encoder=add_encoder,
        add_decoder=add_decoder,
    )


def random_batch(batch_size, seed):
    """Token ids 1..VOCAB-2 (VOCAB-1 is MBart's padding_idx) with trailing padding (id 0), labels
    -1 at padding, and the masks.

    Masks as Megatron builds them: 1 = attend if both positions are real (id >= 1), the decoder
    one also causal; pretrain_t5.get_batch turns them into bool "value < 0.5" (True = masked).
    """
    g = torch.Generator().manual_seed(seed)
    enc = torch.randint(1, VOCAB - 1, (batch_size, S_ENC), generator=g)
    dec = torch.randint(1, VOCAB - 1, (batch_size, S_DEC), generator=g)
    labels = torch.randint(1, VOCAB - 1, (batch_size, S_DEC), generator=g)
    for row in range(batch_size):
        enc_len = S_ENC - 3 * row
        dec_len = S_DEC - 2 * row
        enc[row, enc_len:] = PAD
        dec[row, dec_len:] = PAD
        labels[row, dec_len:] = -1
    loss_mask = (dec != PAD).float()
    enc_real = (enc >= 1).long()
    dec_real = (dec >= 1).long()
    enc_mask = enc_real[:, :, None] * enc_real[:, None, :]
    causal = torch.tril(torch.ones(S_DEC, S_DEC, dtype=torch.long))
    dec_mask = dec_real[:, :, None] * dec_real[:, None, :] * causal
    enc_dec_mask = dec_real[:, :, None] * enc_real[:, None, :]
    return {
        'text_enc': enc,
        'text_dec': dec,
        'labels': labels,
        'loss_mask': loss_mask,
        'enc_mask': enc_mask < 0.5,
        'dec_mask': dec_mask < 0.5,
        'enc_dec_mask': enc_dec_mask < 0.5,
    }


def model_inputs(batch):
    return (
        batch['text_enc'],
        batch['text_dec'],
        batch['enc_mask'],
        batch['dec_mask'],
        batch['enc_dec_mask'],
    )


def randomize(model, seed):
    """Random values in every parameter (zero biases and unit norms would hide mapping errors)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            if 'norm' in name and name.endswith('weight'):
                p.copy_(1.0 + noise)
            else:
                p.copy_(noise)


# --------------------------------------------------------------------------------------------
# Hugging Face MBart


def mbart_config(encoder_layers=2, decoder_layers=2):
    from transformers import MBartConfig

    return MBartConfig(
        vocab_size=VOCAB,
        d_model=HIDDEN,
        encoder_layers=encoder_layers,
        decoder_layers=decoder_layers,
        encoder_attention_heads=HEADS,
        decoder_attention_heads=HEADS,
        encoder_ffn_dim=FFN,
        decoder_ffn_dim=FFN,
        max_position_embeddings=MAX_POS,
        activation_function='gelu',
        scale_embedding=False,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        # An id no test input uses: HF zeroes the gradient of the padding_idx row.
        pad_token_id=VOCAB - 1,
    )


def patch_mbart(hf):
    """Megatron's T5 has no embedding LayerNorm: replace MBart's two by identity; make the final
    logits bias a parameter so that its gradient can be compared with the LM head's bias."""
    hf.model.encoder.layernorm_embedding = torch.nn.Identity()
    hf.model.decoder.layernorm_embedding = torch.nn.Identity()
    bias = hf.final_logits_bias.detach().clone()
    del hf._buffers['final_logits_bias']
    hf.final_logits_bias = torch.nn.Parameter(bias)
    return hf


def _split_rows(weight, parts):
    """[nh * parts * hd, ...] rows grouped per head -> `parts` tensors [nh * hd, ...]."""
    shape = weight.shape
    # [nh * parts * hd, ...] -> [nh, parts, hd, ...]
    w = weight.reshape(HEADS, parts, HIDDEN // HEADS, *shape[1:])
    return [w[:, i].reshape(HIDDEN, *shape[1:]) for i in range(parts)]


def _join_rows(tensors):
    """Inverse of _split_rows: `parts` tensors [nh * hd, ...] -> [nh * parts * hd, ...]."""
    parts = len(tensors)
    shape = tensors[0].shape
    # parts x [nh * hd, ...] -> [nh, parts, hd, ...]
    w = torch.stack([t.reshape(HEADS, HIDDEN // HEADS, *shape[1:]) for t in tensors], dim=1)
    return w.reshape(HEADS * parts * (HIDDEN // HEADS), *shape[1:])


def mbart_name_map(encoder_layers=2, decoder_layers=2):
    """{megatron name: (list of HF names, kind)}; kind says how the tensors correspond."""
    m = {
        'embedding.word_embeddings.weight': (['model.shared.weight'], 'word'),
        'embedding.position_embeddings.weight': (
            ['model.encoder.embed_positions.weight', 'model.decoder.embed_positions.weight'],
            'position',
        ),
        'encoder.final_layernorm.weight': (['model.encoder.layer_norm.weight'], 'same'),
        'encoder.final_layernorm.bias': (['model.encoder.layer_norm.bias'], 'same'),
        'decoder.final_layernorm.weight': (['model.decoder.layer_norm.weight'], 'same'),
        'decoder.final_layernorm.bias': (['model.decoder.layer_norm.bias'], 'same'),
        'output_layer.bias': (['final_logits_bias'], 'logits_bias'),
    }
    common = {
        'input_layernorm': 'self_attn_layer_norm',
        'self_attention.linear_proj': 'self_attn.out_proj',
        'pre_mlp_layernorm': 'final_layer_norm',
        'mlp.linear_fc1': 'fc1',
        'mlp.linear_fc2': 'fc2',
    }
    for stack, count in (('encoder', encoder_layers), ('decoder', decoder_layers)):
        for i in range(count):
            ours, theirs = f'{stack}.layers.{i}', f'model.{stack}.layers.{i}'
            names = dict(common)
            if stack == 'decoder':
                names.update(
                    {
                        'pre_cross_attn_layernorm': 'encoder_attn_layer_norm',
                        'cross_attention.linear_q': 'encoder_attn.q_proj',
                        'cross_attention.linear_proj': 'encoder_attn.out_proj',
                    }
                )
            for suffix in ('weight', 'bias'):
                for a, b in names.items():
                    m[f'{ours}.{a}.{suffix}'] = ([f'{theirs}.{b}.{suffix}'], 'same')
                m[f'{ours}.self_attention.linear_qkv.{suffix}'] = (
                    [f'{theirs}.self_attn.{x}_proj.{suffix}' for x in 'qkv'],
                    'rows',
                )
                if stack == 'decoder':
                    m[f'{ours}.cross_attention.linear_kv.{suffix}'] = (
                        [f'{theirs}.encoder_attn.{x}_proj.{suffix}' for x in 'kv'],
                        'rows',
                    )
    return m


def load_into_mbart(t5_state, hf):
    """Copy an unsharded T5Model state dict into the (patched) MBart model."""
    hf_params = dict(hf.named_parameters())
    with torch.no_grad():
        for ours, (theirs, kind) in mbart_name_map().items():
            value = t5_state[ours]
            if kind == 'word':
                hf_params[theirs[0]].copy_(value)
            elif kind == 'position':
                for name in theirs:
                    # MBart looks positions up at offset 2.
                    hf_params[name][2 : 2 + MAX_POS].copy_(value)
            elif kind == 'logits_bias':
                hf_params[theirs[0]].copy_(value.view(1, -1))
            elif kind == 'rows':
                for name, part in zip(theirs, _split_rows(value, len(theirs))):
                    hf_params[name].copy_(part)
            else:
                hf_params[theirs[0]].copy_(value)
    assert hf.lm_head.weight is hf.model.shared.weight


def mbart_grads_as_megatron(hf):
    """HF parameter gradients in Megatron's names and layouts (the inverse of load_into_mbart)."""
    grads = {n: p.grad for n, p in hf.named_parameters()}
    out = {}
    for ours, (theirs, kind) in mbart_name_map().items():
        if kind == 'position':
            out[ours] = sum(grads[name][2 : 2 + MAX_POS] for name in theirs)
        elif kind == 'logits_bias':
            out[ours] = grads[theirs[0]].view(-1)
        elif kind == 'rows':
            out[ours] = _join_rows([grads[name] for name in theirs])
        else:
            out[ours] = grads[theirs[0]]
    return out
