"""tools/checkpoint/convert.py --model-type VISION: a tiny random HF CLIPVisionModel /
SiglipVisionModel (built here) -> our checkpoint at TP2 -> HF again.

The TP2 checkpoint's rank files, loaded into a TP2 CLIPViTModel on two gloo ranks, give HF's
`last_hidden_state`; the exported directory loads in transformers with the original weights
(CLIP's pooler-only `post_layernorm` and SigLIP's pooling `head` are not part of the encoder: the
first comes back as identity, the second is absent). Layouts the encoder cannot take are refused
in one line before any work.
"""

import os
import sys

import pytest
import torch

from tests.functional_tests import convert_utils as cu
from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip('transformers')

sys.path.insert(0, os.path.join(cu.REPO, 'tools', 'checkpoint'))
import convert  # noqa: E402

_POOLER_ONLY = ('post_layernorm.', 'head.')


def _convert(loader, saver, load_dir, save_dir, *extra):
    flags = ['--model-type', 'VISION', '--loader', loader, '--saver', saver]
    return convert.main(flags + ['--load-dir', load_dir, '--save-dir', save_dir, *extra])


def _rank_forward(subtype, ckpt_dir, pixels):
    from megatron.core import parallel_state
    from tests.unit_tests.models import vision_test_utils as vu

    model, _ = vu.build_vit(subtype)
    rank = parallel_state.get_tensor_model_parallel_rank()
    name = os.path.join(ckpt_dir, 'iter_0000001', f'mp_rank_0{rank}', 'model_optim_rng.pt')
    state = torch.load(name, weights_only=False)
    model.load_state_dict(state['model'])
    with torch.no_grad():
        return model(pixels)


@pytest.mark.parametrize('subtype', ['clip', 'siglip'])
def test_hf_round_trip_through_tp2(subtype, tmp_path):
    from transformers import AutoModel

    from tests.unit_tests.models import vision_test_utils as vu

    hf = vu.hf_tower(subtype)
    hf_dir, mc_dir, back_dir = (str(tmp_path / n) for n in ('hf', 'mc', 'back'))
    hf.save_pretrained(hf_dir)
    assert _convert('hf', 'mcore', hf_dir, mc_dir, '--target-tensor-parallel-size', '2') == 0
    assert _convert('mcore', 'hf', mc_dir, back_dir) == 0

    pixels = vu.images()
    with torch.no_grad():
        expected = hf(pixel_values=pixels).last_hidden_state
    outs = run_distributed(_rank_forward, world_size=2, tp=2, args=(subtype, mc_dir, pixels))
    for out in outs:
        assert (out - expected).abs().max().item() < 2e-5

    back = AutoModel.from_pretrained(back_dir, attn_implementation='eager').eval()
    assert type(back) is type(hf)
    original = {k: v for k, v in hf.state_dict().items() if not k.startswith(_POOLER_ONLY)}
    returned = back.state_dict()
    assert all(torch.equal(returned[k], v) for k, v in original.items())
    with torch.no_grad():
        assert torch.equal(back(pixel_values=pixels).last_hidden_state, expected)


def _last_error_line(capsys):
    # transformers' save_pretrained writes a progress bar to stderr before it.
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_layouts_the_encoder_cannot_take(capsys, tmp_path):
    from tests.unit_tests.models import vision_test_utils as vu

    hf_dir = str(tmp_path / 'hf')
    vu.hf_tower('clip').save_pretrained(hf_dir)
    save = str(tmp_path / 'out')
    assert _convert('hf', 'mcore', hf_dir, save, '--target-tensor-parallel-size', '3') == 2
    assert _last_error_line(capsys) == (
        "error: --target-tensor-parallel-size 3 does not divide the encoder's "
        f'num_attention_heads {vu.HEADS}'
    )
    assert _convert('hf', 'mcore', hf_dir, save, '--target-pipeline-parallel-size', '2') == 2
    assert _last_error_line(capsys) == (
        'error: --target-pipeline-parallel-size 2: a vision encoder is one pipeline stage (1)'
    )
    assert not os.path.exists(save)


def _train_classifier(digits, ckpt, tp, layout):
    """pretrain_vision_classify.py for 2 iterations at `tp`, saved to `ckpt`."""
    from tests.functional_tests.vision_utils import run_vision_classify

    flags = [
        *('--tensor-model-parallel-size', str(tp), '--micro-batch-size', '4'),
        *('--global-batch-size', '8', '--train-iters', '2', '--eval-iters', '0'),
        *('--data-path', f'{digits}/train', f'{digits}/val', '--vit-layout', layout),
        *('--save', ckpt, '--save-interval', '2'),
    ]
    run_distributed(run_vision_classify, world_size=tp, tp=tp, args=(flags,))


def _classifier_forward(ckpt_dir, pixels):
    """Logits of this TP rank's classifier loaded from its rank file (TINY_VIT_ARGS' model)."""
    from megatron.core import parallel_state
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.legacy.model.vision.classification import VitClassificationModel

    tp = parallel_state.get_tensor_model_parallel_world_size()
    config = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, tensor_model_parallel_size=tp,
        hidden_dropout=0.0, attention_dropout=0.0, bias_activation_fusion=True,
        use_cpu_initialization=True,
    )  # fmt: skip
    model = VitClassificationModel(
        config, 10, img_h=8, img_w=8, patch_dim=2, num_channels=1, layout='hf'
    ).eval()
    rank = parallel_state.get_tensor_model_parallel_rank()
    name = os.path.join(ckpt_dir, 'iter_0000002', f'mp_rank_0{rank}', 'model_optim_rng.pt')
    model.load_state_dict(torch.load(name, weights_only=False)['model'])
    with torch.no_grad():
        return model(pixels)


def test_vit_classifier_exports_to_vit_for_image_classification(tmp_path, capsys):
    """A classifier trained at TP2 with --vit-layout hf exports to ViTForImageClassification,
    whose logits equal ours; Megatron's layout is refused in one line."""
    from transformers import ViTForImageClassification

    from tests.functional_tests.vision_utils import prepare_digits

    digits = prepare_digits(str(tmp_path / 'data'))
    ckpt, hf_dir = str(tmp_path / 'ckpt'), str(tmp_path / 'hf')
    _train_classifier(digits, ckpt, 2, 'hf')
    assert _convert('mcore', 'hf', ckpt, hf_dir) == 0
    hf = ViTForImageClassification.from_pretrained(hf_dir, attn_implementation='eager').eval()
    pixels = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(pixel_values=pixels).logits
    for ours in run_distributed(_classifier_forward, world_size=2, tp=2, args=(ckpt, pixels)):
        assert (ours - expected).abs().max().item() < 2e-5

    megatron_ckpt = str(tmp_path / 'megatron_layout')
    _train_classifier(digits, megatron_ckpt, 1, 'megatron')
    assert _convert('mcore', 'hf', megatron_ckpt, str(tmp_path / 'no')) == 2
    assert "holds Megatron's ViT classifier (--vit-layout megatron" in _last_error_line(capsys)
    assert not os.path.exists(tmp_path / 'no')
