"""LLaVAModel split over two pipeline stages (the ViT, projector, embedding and LM layer 0 on
stage 0; LM layer 1, the final norm and the output layer on stage 1) under the 1F1B schedule:
two micro-batches of different combined lengths (images mid-sequence, two images in a sample, a
text-only sample; then a text-only micro-batch) give the one-stage model's loss and every
gradient. The stages announce each [S, b, h] (variable_seq_lengths) and stage 1 rebuilds the
expanded labels and loss mask from the ids, here with a loss mask of ones so that every
expansion rule (the token before an image, the image positions, the first token after one)
shows in the loss."""

import re

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")

LAYER = re.compile(r'^(language_model\.decoder\.layers\.)(\d+)(\..*)$')
TAIL = ('language_model.decoder.final_layernorm.', 'language_model.output_layer.')


def _micro_batches():
    from tests.unit_tests.models.test_llava_model import IMAGE_ID, _batch

    ids, images, _ = _batch()  # 3 samples: one image, two images, none
    g = torch.Generator().manual_seed(4)
    text_only = torch.randint(1, IMAGE_ID, (3, 5), generator=g)
    out = []
    for tokens, imgs in ((ids, images), (text_only, None)):
        labels = torch.randint(1, IMAGE_ID, tokens.shape, generator=g)
        out.append((tokens, imgs, labels, torch.ones(tokens.shape)))
    return out


def _stage_of(name, per_stage, pp):
    """(stage, stage-local name) of a global parameter name."""
    m = LAYER.match(name)
    if m:
        p = int(m[2]) // per_stage
        return p, f'{m[1]}{int(m[2]) - p * per_stage}{m[3]}'
    return (pp - 1 if name.startswith(TAIL) else 0), name


def _global_name(name, stage, per_stage):
    m = LAYER.match(name)
    return f'{m[1]}{int(m[2]) + stage * per_stage}{m[3]}' if m else name


def _loss(output, loss_mask):
    return (output.float() * loss_mask).sum() / loss_mask.sum()


def _run(full, pp):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from tests.unit_tests.models.test_llava_model import _build

    stage = ps.get_pipeline_model_parallel_rank()
    lm = dict(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32)
    if pp > 1:
        lm['variable_seq_lengths'] = True
    model, _ = _build(
        -2, 'default', lm, pre_process=stage == 0, post_process=stage == pp - 1,
    )  # fmt: skip
    per_stage = 2 // pp
    mine = {}
    for name, t in full.items():
        p, local = _stage_of(name, per_stage, pp)
        if p == stage:
            mine[local] = t
    missing, unexpected = model.load_state_dict(mine, strict=False)
    assert not unexpected and all(k.endswith('_extra_state') for k in missing), (
        missing,
        unexpected,
    )

    def forward_step(data_iterator, model):
        ids, images, labels, loss_mask = next(data_iterator)
        output, new_mask = model(images, ids, None, None, labels=labels, loss_mask=loss_mask)
        return output, lambda out: (_loss(out, new_mask), {'loss': _loss(out, new_mask).detach()})

    losses = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(_micro_batches()), model=[model],
        num_microbatches=2, seq_length=0, micro_batch_size=3, forward_only=False,
    )  # fmt: skip
    grads = {
        _global_name(n, stage, per_stage): p.grad.detach()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return [float(d['loss']) for d in losses], grads


def _reference():
    from megatron.core.models.multimodal.hf_weight_mapping import llava_hf_to_mcore_state_dict
    from tests.unit_tests.models.test_llava_model import _build, _hf_llava

    _, configs = _build(-2, 'default')
    full = llava_hf_to_mcore_state_dict(_hf_llava(-2, 'default').state_dict(), configs[0], 4, 1)
    return (full,) + _run(full, 1)


def test_two_stages_match_one_stage():
    full, ref_losses, ref_grads = run_distributed(_reference, world_size=1)[0]
    (_, grads0), (losses, grads1) = run_distributed(_run, world_size=2, pp=2, args=(full, 2))
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=0)
    assert grads0.keys().isdisjoint(grads1.keys())
    grads = {**grads0, **grads1}
    assert grads.keys() == ref_grads.keys()
    assert any(k.startswith('vision_model.') for k in grads0)
    for name, g in ref_grads.items():
        assert (grads[name] - g).abs().max() <= 1e-5 * max(g.abs().max(), 1e-3), name
