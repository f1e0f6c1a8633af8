"""LLaVAModel against transformers' LlavaForConditionalGeneration (tiny random Llama + CLIP built
here), the label / loss-mask expansion on hand-written cases, the refusals, and TP2 parity."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")

VOCAB, IMAGE_ID, TEXT_LEN, MAX_SEQ = 128, 127, 8, 64
P = -200  # our placeholder


def _hf_llava(feature_layer, strategy):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from tests.unit_tests.models import vision_test_utils as vu

    vision = CLIPVisionConfig(
        hidden_size=vu.HIDDEN, intermediate_size=vu.FFN, num_hidden_layers=vu.LAYERS,
        num_attention_heads=vu.HEADS, image_size=vu.IMG, patch_size=vu.PATCH,
        hidden_act='quick_gelu', attention_dropout=0.0,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-6,
        max_position_embeddings=MAX_SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    tokens = (vu.IMG // vu.PATCH) ** 2 + (strategy == 'full')
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=IMAGE_ID,
        image_seq_length=tokens, vision_feature_layer=feature_layer,
        vision_feature_select_strategy=strategy, projector_hidden_act='gelu',
        multimodal_projector_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = 'eager'
    model = LlavaForConditionalGeneration(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.1
            is_norm = p.dim() == 1 and 'norm' in name and name.endswith('weight')
            p.copy_(1.0 + noise if is_norm else noise)
    return model.eval()


def _configs(feature_layer, **lm_overrides):
    """Our language, vision and projection TransformerConfigs for the current TP size."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt.hf_weight_mapping import llama_config_kwargs
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.models import vision_test_utils as vu

    tp = parallel_state.get_tensor_model_parallel_world_size()
    hf = _hf_llava(feature_layer, 'default')
    lm_kw = llama_config_kwargs(hf.config.text_config)
    lm = TransformerConfig(
        **(lm_kw['config'] | lm_overrides),
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
    )
    vision = vu.vit_config('clip')
    projection = TransformerConfig(
        num_layers=1, hidden_size=64, ffn_hidden_size=64, num_attention_heads=8,
        add_bias_linear=True, activation_func=torch.nn.functional.gelu,
        bias_activation_fusion=False, use_cpu_initialization=True, tensor_model_parallel_size=tp,
    )  # fmt: skip
    return (lm, vision, projection), lm_kw['model']['rotary_base']


def _build(feature_layer, strategy, lm_overrides=None, **overrides):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.multimodal import LLaVAModel
    from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from tests.unit_tests.models import vision_test_utils as vu

    (lm, vision, projection), base = _configs(feature_layer, **(lm_overrides or {}))
    kw = dict(
        language_transformer_config=lm,
        language_transformer_layer_spec=get_gpt_layer_local_spec(),
        language_vocab_size=VOCAB,
        language_max_sequence_length=MAX_SEQ,
        vision_transformer_config=vision,
        vision_transformer_layer_spec=get_vit_layer_with_local_spec(),
        drop_vision_class_token=strategy == 'default',
        vision_projection_config=projection,
        vision_projection_layer_spec=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
        parallel_output=False,
        language_position_embedding_type='rope',
        language_rotary_base=base,
        img_h=vu.IMG,
        img_w=vu.IMG,
        patch_dim=vu.PATCH,
        vision_feature_layer=feature_layer,
    )
    kw.update(overrides)
    model = LLaVAModel(**kw)
    # A later pipeline stage has no vision model.
    vit = model.vision_model.config if model.vision_model is not None else vision
    return model, (lm, vit, projection)


def _load(model, configs, full):
    from megatron.core import parallel_state
    from megatron.core.models.multimodal.hf_weight_mapping import (
        split_llava_state_dict_for_tensor_parallel,
    )

    tp = parallel_state.get_tensor_model_parallel_world_size()
    rank = parallel_state.get_tensor_model_parallel_rank()
    shard = split_llava_state_dict_for_tensor_parallel(full, configs, tp)[rank]
    missing, unexpected = model.load_state_dict(shard, strict=False)
    assert not unexpected, unexpected
    assert all(k.endswith('_extra_state') for k in missing), missing


def _gather(named, configs):
    from megatron.core import parallel_state
    from megatron.core.models.gpt.hf_weight_mapping import tensor_parallel_partition_dim
    from megatron.core.models.multimodal.hf_weight_mapping import (
        merge_llava_tensor_parallel_state_dicts,
    )
    from tests.unit_tests.models.gpt_test_utils import _all_gather_tp

    tp = parallel_state.get_tensor_model_parallel_world_size()
    shards = [dict() for _ in range(tp)]
    for name, t in named.items():
        rule_name = name.replace('vision_projection.encoder.', 'vision_projection.mlp.')
        split = tensor_parallel_partition_dim(rule_name) is not None
        pieces = _all_gather_tp(t) if split else [t] * tp
        for r in range(tp):
            shards[r][name] = pieces[r].detach()
    return merge_llava_tensor_parallel_state_dicts(shards, configs)


def _batch():
    """Three samples: one image, two images, none (placeholders = P); 3 images in all."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, IMAGE_ID, (3, TEXT_LEN), generator=g)
    ids[0, 2] = P
    ids[1, 1] = P
    ids[1, 5] = P
    images = torch.randn(3, 3, 16, 16, generator=g)
    return ids, images, [[0], [1, 2], []]


def _hf_ids(row, tokens):
    out = []
    for t in row.tolist():
        out += [IMAGE_ID] * tokens if t == P else [t]
    return torch.tensor([out])


def _hf_parity(feature_layer, strategy):
    from megatron.core.models.multimodal.hf_weight_mapping import llava_hf_to_mcore_state_dict

    hf = _hf_llava(feature_layer, strategy)
    model, configs = _build(feature_layer, strategy)
    full = llava_hf_to_mcore_state_dict(
        hf.state_dict(), configs[0], 4, model.vision_model.config.num_layers
    )
    _load(model, configs, full)
    ids, images, image_of = _batch()
    logits, _ = model(images, ids, None, None)
    ours_loss, theirs_loss, out_err = 0.0, 0.0, 0.0
    for i in range(3):
        hf_ids = _hf_ids(ids[i], model.img_seq_len)
        pixels = images[image_of[i]] if image_of[i] else None
        theirs = hf(input_ids=hf_ids, pixel_values=pixels).logits[0]  # [S_i, V]
        ours = logits[i, : theirs.shape[0]]
        out_err = max(out_err, (ours - theirs).abs().max().item())
        w = torch.randn(theirs.shape, generator=torch.Generator().manual_seed(i))
        ours_loss = ours_loss + (ours * w).sum()
        theirs_loss = theirs_loss + (theirs * w).sum()
    ours_loss.backward()
    theirs_loss.backward()
    hf_grads = {n: (p.grad if p.grad is not None else torch.zeros_like(p)) for n, p in
                hf.named_parameters()}  # fmt: skip
    theirs_grads = llava_hf_to_mcore_state_dict(
        hf_grads, configs[0], 4, model.vision_model.config.num_layers
    )
    # Relative to each gradient's largest entry (the summed weighted logits give large ones).
    grad_err = {
        n: ((p.grad - theirs_grads[n]).abs().max() / theirs_grads[n].abs().max()).item()
        for n, p in model.named_parameters()
    }
    return out_err, grad_err, model.vision_model.config.num_layers, logits.shape


@pytest.mark.parametrize('feature_layer,strategy', [(-2, 'default'), (-1, 'full')])
def test_matches_hf_llava(feature_layer, strategy):
    out_err, grad_err, vit_layers, shape = run_distributed(
        _hf_parity, world_size=1, args=(feature_layer, strategy)
    )[0]
    assert vit_layers == (1 if feature_layer == -2 else 2)
    k = 16 + (strategy == 'full')
    assert tuple(shape) == (3, TEXT_LEN - 2 + 2 * k, VOCAB)
    assert out_err < 2e-5, out_err
    assert max(grad_err.values()) < 1e-5, grad_err
    assert any('vision_model.conv1' in n for n in grad_err)
    assert any('vision_projection.encoder.linear_fc1' in n for n in grad_err)


def test_label_and_loss_mask_expansion():
    from megatron.core.models.multimodal.llava_inputs import merge_placeholder_batch

    # Megatron's example: k = 3, ids [10, 11, P, 12, 13].
    ids = torch.tensor([[10, 11, P, 12, 13], [P, 20, 21, P, 22]])
    labels = torch.tensor([[11, P, 12, 13, 14], [20, 21, P, 22, 23]])
    mask = torch.ones(2, 5)
    text = torch.arange(10.0).reshape(5, 2, 1).expand(5, 2, 2)  # [s, b, h]
    images = 100 + torch.arange(3 * 3 * 2.0).reshape(3, 3, 2)  # [n, k, h]
    emb, new_labels, new_mask = merge_placeholder_batch(
        text, images, ids, None, P, 64, labels, mask
    )
    ignore = -100
    assert new_labels.tolist() == [
        [11, ignore, ignore, ignore, 12, 13, 14, ignore, ignore],
        [ignore, ignore, 20, 21, ignore, ignore, ignore, 22, 23],
    ]
    assert new_mask.tolist() == [[1, 0, 0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0, 0, 1]]
    # Sample 1: image 1, then the text 20 21, image 2, then 22 (text rows t = 2 * pos + 1).
    assert emb[:, 1, 0].tolist() == [106, 108, 110, 3, 5, 112, 114, 116, 9]
    assert emb[:, 0, 0].tolist() == [0, 2, 100, 102, 104, 6, 8, 0, 0]  # right-padded
    # HF trains the first token after an image: the option gives it the placeholder's mask.
    _, _, hf_mask = merge_placeholder_batch(
        text, images, ids, None, P, 64, labels, mask, supervise_first_token_after_image=True
    )
    assert hf_mask.tolist() == [[1, 0, 0, 0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 0, 0, 0, 1, 1]]
    # Two tiles for the first image: 6 tokens; truncation to 8 keeps the images whole.
    _, tl, _ = merge_placeholder_batch(
        text[:, :1], images[:2], ids[:1], torch.tensor([2]), P, 8, labels[:1], mask[:1]
    )
    assert tl.tolist() == [[11, ignore, ignore, ignore, ignore, ignore, ignore, 12]]


def test_placeholder_errors():
    from megatron.core.models.multimodal.llava_inputs import merge_placeholder_batch
    from megatron.core.models.multimodal.llava_model import vision_layers_for_feature_layer

    ids = torch.tensor([[10, P, 12, P]])
    text = torch.zeros(4, 1, 2)
    with pytest.raises(ValueError, match='more image tokens .* 2 placeholders for 1 images'):
        merge_placeholder_batch(text, torch.zeros(1, 3, 2), ids, None, P, 64)
    with pytest.raises(ValueError, match='fewer image tokens .* 2 placeholders for 3 images'):
        merge_placeholder_batch(text, torch.zeros(3, 3, 2), ids, None, P, 64)
    with pytest.raises(ValueError, match='image 1 ends at combined position 8, beyond .* 7'):
        merge_placeholder_batch(text, torch.zeros(2, 3, 2), ids, None, P, 7)
    with pytest.raises(ValueError, match='vision_feature_layer -3 selects no transformer layer'):
        vision_layers_for_feature_layer(2, -3)


def _modes_and_freeze():
    from megatron.core.models.multimodal.hf_weight_mapping import llava_hf_to_mcore_state_dict

    hf = _hf_llava(-1, 'default')
    model, configs = _build(-1, 'default', img_embedding_idx=2)
    full = llava_hf_to_mcore_state_dict(hf.state_dict(), configs[0], 4, 2)
    _load(model, configs, full)
    ids, images, _ = _batch()
    with torch.no_grad():
        placeholder, _ = model(images[:1], ids[:1], None, None)
        fixed, _ = model(images[:1], torch.cat([ids[:1, :2], ids[:1, 3:]], 1), None, None)
        # Labels: the per-token loss at the trained positions, and the expanded mask.
        labels = torch.randint(0, VOCAB, ids[:1].shape)
        loss, loss_mask = model(images[:1], ids[:1], None, None, labels=labels)
    errors = []
    for call in (
        lambda: model(images[:2], ids[:1], None, None),  # 2 images, 1 placeholder
        lambda: model(images[:1], ids[2:], None, None, labels=labels),  # fixed, short labels
        # Checked before the vision model runs: it would refuse these 5x5 images.
        lambda: model(torch.zeros(2, 3, 5, 5), ids[:1], None, None),
        lambda: model(torch.zeros(1, 3, 5, 5), ids[2:], None, None, labels=labels),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    # A text-only batch gives the vision parts zero gradients (not None: DDP reduces them).
    text_only, _ = model(None, ids[2:], None, None)
    text_only.sum().backward()
    vision_grads = [
        p.grad for n, p in model.named_parameters() if not n.startswith('language_model')
    ]
    anchored = all(g is not None and not g.any() for g in vision_grads)
    lm_trained = model.language_model.output_layer.weight.grad.abs().sum() > 0
    model.freeze(False, True, False)
    frozen = {n.split('.')[0] for n, p in model.named_parameters() if not p.requires_grad}
    # A checkpoint without the projector loads when the flag allows it.
    lenient, _ = _build(-1, 'default', allow_missing_vision_projection_checkpoint=True)
    no_proj = {k: v for k, v in model.state_dict().items() if 'vision_projection' not in k}
    result = lenient.load_state_dict(no_proj, strict=True)
    missing, anchored = list(result.missing_keys), anchored and lm_trained
    return placeholder, fixed, loss, loss_mask, labels, errors, frozen, missing, anchored


def test_fixed_index_mode_labels_freeze_and_missing_projection():
    placeholder, fixed, loss, mask, labels, errors, frozen, missing, anchored = run_distributed(
        _modes_and_freeze, world_size=1
    )[0]
    # r0.8's fixed index 2 on the text without its placeholder = the placeholder at index 2.
    assert (placeholder - fixed).abs().max() < 1e-5
    expected = torch.nn.functional.cross_entropy(placeholder[0], torch.full((23,), -100).index_copy(
        0, torch.tensor([0, 1, 18, 19, 20, 21, 22]), labels[0, [0, 1, 3, 4, 5, 6, 7]]
    ), reduction='none', ignore_index=-100)  # fmt: skip
    trained = mask[0].bool()
    assert trained.sum() == 7  # the placeholder's label sits on the image's last token, unmasked
    assert (loss[0][trained] - expected[trained]).abs().max() < 1e-4
    assert 'fewer image tokens' in errors[0] and '1 placeholders for 2 images' in errors[0]
    assert 'labels has 8 positions, the combined sequence 24' in errors[1]
    assert errors[2] == errors[0] and errors[3] == errors[1]
    assert frozen == {'vision_model'}
    assert missing == []
    assert anchored


def _tp_run(full, sequence_parallel=False):
    from megatron.core import parallel_state
    from tests.unit_tests.models.gpt_test_utils import _all_gather_tp

    ids, images, _ = _batch()
    ids = ids[:, :7]  # odd text (7) and combined (37) lengths: the sequence-parallel padding
    lm_overrides = dict(sequence_parallel=sequence_parallel)
    # Sequence parallelism takes parallel_output=True (the logits stay split over the vocabulary).
    model, configs = _build(-2, 'default', lm_overrides, parallel_output=True)
    _load(model, configs, full)
    logits, _ = model(images, ids, None, None)
    logits = logits[:, :37]  # [b, S(+pad), v/p] -> [b, S, v/p]
    w = torch.randn(3, 37, VOCAB, generator=torch.Generator().manual_seed(2))
    rank = parallel_state.get_tensor_model_parallel_rank()
    local_w = w.chunk(parallel_state.get_tensor_model_parallel_world_size(), dim=-1)[rank]
    (logits * local_w).sum().backward()  # the ranks' terms add up to the full weighted sum
    logits = torch.cat(_all_gather_tp(logits.detach()), dim=-1)  # [b, S, v]
    # What finalize_model_grads does for the norms inside the sequence-parallel region.
    for p in model.parameters():
        if getattr(p, 'sequence_parallel', False):
            group = parallel_state.get_tensor_model_parallel_group()
            torch.distributed.all_reduce(p.grad, group=group)
    grads = _gather({n: p.grad for n, p in model.named_parameters()}, configs)
    return logits.detach(), grads


def _tp_reference():
    from megatron.core.models.multimodal.hf_weight_mapping import llava_hf_to_mcore_state_dict

    hf = _hf_llava(-2, 'default')
    _, configs = _build(-2, 'default')
    full = llava_hf_to_mcore_state_dict(hf.state_dict(), configs[0], 4, 1)
    return (full,) + _tp_run(full)


@pytest.mark.parametrize('sequence_parallel', [False, True])
def test_tensor_parallel_matches_unsharded(sequence_parallel):
    full, ref_logits, ref_grads = run_distributed(_tp_reference, world_size=1)[0]
    outs = run_distributed(_tp_run, world_size=2, tp=2, args=(full, sequence_parallel))
    for logits, grads in outs:
        assert (logits - ref_logits).abs().max() < 1e-5
        assert grads.keys() == ref_grads.keys()
        for name, g in ref_grads.items():
            assert (grads[name] - g).abs().max() < 1e-4, name


def test_hf_weight_round_trip():
    from megatron.core.models.gpt.hf_weight_mapping import llama_config_kwargs
    from megatron.core.models.multimodal.hf_weight_mapping import (
        llava_hf_to_mcore_state_dict,
        mcore_to_hf_llava_state_dict,
    )
    from megatron.core.transformer.transformer_config import TransformerConfig

    hf = _hf_llava(-1, 'default')
    lm = TransformerConfig(**llama_config_kwargs(hf.config.text_config)['config'])
    hf_sd = hf.state_dict()
    back = mcore_to_hf_llava_state_dict(llava_hf_to_mcore_state_dict(hf_sd, lm, 4, 2), lm, 4)
    # CLIP's post_layernorm only feeds HF's pooler output: not in the model, exported as identity.
    kept = {k: v for k, v in hf_sd.items() if 'post_layernorm' not in k}
    assert back.keys() - kept.keys() == {
        'model.vision_tower.post_layernorm.weight',
        'model.vision_tower.post_layernorm.bias',
    }
    assert all(torch.equal(back[k], v) for k, v in kept.items())


def _greedy():
    from megatron.core.inference_params import InferenceParams
    from megatron.core.models.multimodal.hf_weight_mapping import llava_hf_to_mcore_state_dict

    hf = _hf_llava(-2, 'default')
    model, configs = _build(-2, 'default')
    _load(model, configs, llava_hf_to_mcore_state_dict(hf.state_dict(), configs[0], 4, 1))
    model.eval()
    ids, images, _ = _batch()
    prompt, image = ids[:1], images[:1]  # one image
    steps = 5
    with torch.no_grad():
        theirs = hf.generate(
            input_ids=_hf_ids(prompt[0], model.img_seq_len), pixel_values=image,
            max_new_tokens=steps, do_sample=False,
        )[0, -steps:]  # fmt: skip
        params = InferenceParams(1, MAX_SEQ)
        logits, _ = model(image, prompt, None, None, inference_params=params)
        ours = [int(logits[0, -1].argmax())]
        params.sequence_len_offset += logits.shape[1]
        for _ in range(steps - 1):
            # The image passed again is ignored: its tokens are in the KV cache.
            step = torch.tensor([[ours[-1]]])
            logits, _ = model(image, step, None, None, inference_params=params)
            params.sequence_len_offset += 1
            ours.append(int(logits[0, -1].argmax()))
    return ours, theirs.tolist()


def test_kv_cache_greedy_matches_hf_generate():
    ours, theirs = run_distributed(_greedy, world_size=1)[0]
    assert ours == theirs
