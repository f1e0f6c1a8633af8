"""tools/checkpoint/convert.py --model-type LLAVA: a tiny random HF LlavaForConditionalGeneration
(Llama text model + CLIP tower, vision_feature_layer -2, built here) -> our checkpoint at TP1 ->
TP2 -> HF again.

Both checkpoints, built by pretrain_vlm.py's model provider from their saved args alone
(--use-checkpoint-args) and loaded with strict=True, give HF's logits on a prompt with one
image; the exported directory loads in transformers with the original weights bit for bit (the
tower's layer after the selected feature layer and CLIP's pooler-only `post_layernorm` are not
part of LLaVAModel: the first is not exported, the second comes back as identity) and the same
logits. HF -> TP2 -> TP2 x PP2: each stage's file holds its own parts, pretrain_vlm.py fine-tunes
it at TP2 x PP2 with the TP2 checkpoint's loss, and it exports to HF bit for bit. Layouts the
model cannot take are refused in one line before any work.
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

P = -200  # the image placeholder of our data pipeline


def _convert(loader, saver, load_dir, save_dir, *extra):
    flags = ['--model-type', 'LLAVA', '--loader', loader, '--saver', saver]
    return convert.main(flags + ['--load-dir', load_dir, '--save-dir', save_dir, *extra])


def _prompt():
    """One sample: text, the image placeholder, text; one 16 x 16 image."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 120, (1, 8), generator=g)
    ids[0, 2] = P
    return ids, torch.randn(1, 3, 16, 16, generator=g)


def _logits_from_checkpoint(load_dir, ids, images):
    """Full-vocabulary logits [b, S, v] of a LLaVA checkpoint at its own TP (harness rank)."""
    if cu.REPO not in sys.path:
        sys.path.insert(0, cu.REPO)
    import pretrain_vlm
    from megatron.core import parallel_state as ps
    from megatron.training.arguments import parse_args
    from megatron.training.checkpoint.checkpoint_conversion import (
        CheckpointReader,
        torch_load_weights_only,
    )
    from megatron.training.checkpointing import load_args_from_checkpoint
    from megatron.training.global_vars import destroy_global_vars, set_args
    from megatron.training.validation.argument_validation import validate_args
    from tests.unit_tests.models.gpt_test_utils import gather_logits

    destroy_global_vars()
    flags = ['--load', load_dir, '--use-checkpoint-args', '--micro-batch-size', '1',
             '--mock-data', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '1']  # fmt: skip
    args = parse_args(extra_args_provider=pretrain_vlm.add_vlm_extra_args, args_list=flags)
    load_args_from_checkpoint(args)
    args.world_size, args.rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    validate_args(args)
    set_args(args)
    try:
        model = pretrain_vlm.model_provider()
        name = CheckpointReader(load_dir).rank_file(ps.get_tensor_model_parallel_rank(), 0)
        model.load_state_dict(torch_load_weights_only(name, mmap=False)['model'], strict=True)
        model.eval()
        with torch.no_grad():
            logits, _ = model(images, ids, None, None)
        return gather_logits(logits)
    finally:
        destroy_global_vars()


def _finetune_from(load_dir, extra=()):
    """pretrain_vlm.py --load D --use-checkpoint-args --finetune: one step on the digit captions
    (the imported vocabulary holds the caption words); {iteration: lm loss}."""
    if cu.REPO not in sys.path:
        sys.path.insert(0, cu.REPO)
    import pretrain_vlm
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    flags = ['--load', load_dir, '--use-checkpoint-args', '--finetune', '--no-load-optim',
             '--no-load-rng', '--tokenizer-type', 'NullTokenizer', '--vocab-size', '127',
             '--micro-batch-size', '2', '--global-batch-size', '2', '--train-iters', '1',
             '--lr', '1e-3', '--eval-iters', '0', '--num-workers', '0',
             '--distributed-backend', 'gloo', '--log-interval', '1', *extra]  # fmt: skip
    destroy_global_vars()
    try:
        result = pretrain(
            pretrain_vlm.train_valid_test_datasets_provider,
            pretrain_vlm.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_vlm.forward_step,
            extra_args_provider=pretrain_vlm.add_vlm_extra_args,
            args_list=flags,
        )
    finally:
        destroy_global_vars()
    return {int(k): float(v['lm loss']) for k, v in result['train_losses'].items()}


def test_hf_llava_round_trip_through_tp1_and_tp2(tmp_path):
    from transformers import LlavaForConditionalGeneration

    from tests.unit_tests.models.test_llava_model import _hf_ids, _hf_llava

    hf = _hf_llava(-2, 'default')
    hf_dir, tp1, tp2, back_dir = (str(tmp_path / n) for n in ('hf', 'tp1', 'tp2', 'back'))
    hf.save_pretrained(hf_dir)
    no_tokenizer = ['--hf-tokenizer-type', 'NullTokenizer']
    assert _convert('hf', 'mcore', hf_dir, tp1, *no_tokenizer) == 0
    assert _convert('mcore', 'mcore', tp1, tp2, '--target-tensor-parallel-size', '2') == 0
    assert _convert('mcore', 'hf', tp2, back_dir) == 0

    ids, images = _prompt()
    hf_ids = _hf_ids(ids[0], 16)  # the placeholder as image_seq_length image-token ids
    with torch.no_grad():
        expected = hf(input_ids=hf_ids, pixel_values=images).logits  # [1, S, 128]
    for tp, ckpt in ((1, tp1), (2, tp2)):
        outs = run_distributed(
            _logits_from_checkpoint, world_size=tp, tp=tp, args=(ckpt, ids, images)
        )
        for out in outs:
            assert out.shape[1] == expected.shape[1]
            assert (out[..., :128] - expected).abs().max().item() < 2e-5, tp

    # The training script itself starts from the TP2 checkpoint.
    losses = run_distributed(_finetune_from, world_size=2, tp=2, args=(tp2,))
    assert list(losses[-1]) == [1] and torch.isfinite(torch.tensor(losses[-1][1]))

    back = LlavaForConditionalGeneration.from_pretrained(back_dir, attn_implementation='eager')
    back.eval()
    assert back.config.vision_feature_layer == -1
    assert back.config.vision_config.num_hidden_layers == 1
    # Everything LLaVAModel holds returns bit for bit: all but the tower's second layer (after
    # the feature layer -2) and the pooler-only post_layernorm (identity).
    original = {
        k: v
        for k, v in hf.state_dict().items()
        if '.encoder.layers.1.' not in k and 'post_layernorm' not in k
    }
    returned = back.state_dict()
    assert returned.keys() - original.keys() == {
        'model.vision_tower.post_layernorm.weight',
        'model.vision_tower.post_layernorm.bias',
    }
    assert all(torch.equal(returned[k], v) for k, v in original.items())
    with torch.no_grad():
        again = back(input_ids=hf_ids, pixel_values=images).logits
    assert torch.equal(again, expected)


def test_tp2_pp2_checkpoint_fine_tunes_and_exports(tmp_path):
    """HF -> TP2 x PP2 (stage 0: tower, projector, embedding, LM layer 0; stage 1: LM layer 1,
    final norm, output layer) -> pretrain_vlm.py fine-tunes it at TP2 x PP2 with the TP2
    checkpoint's loss, and -> HF again with every weight bit for bit."""
    from transformers import LlavaForConditionalGeneration

    from tests.unit_tests.models.test_llava_model import _hf_llava

    hf = _hf_llava(-2, 'default')
    hf_dir, tp2, pp2, back_dir = (str(tmp_path / n) for n in ('hf', 'tp2', 'pp2', 'back'))
    hf.save_pretrained(hf_dir)
    no_tokenizer = ['--hf-tokenizer-type', 'NullTokenizer']
    layout = ['--target-tensor-parallel-size', '2']
    assert _convert('hf', 'mcore', hf_dir, tp2, *no_tokenizer, *layout) == 0
    assert (
        _convert('mcore', 'mcore', tp2, pp2, *layout, '--target-pipeline-parallel-size', '2') == 0
    )
    assert _convert('mcore', 'hf', pp2, back_dir) == 0

    from megatron.training.checkpoint.checkpoint_conversion import (
        CheckpointReader,
        torch_load_weights_only,
    )

    reader = CheckpointReader(pp2)
    assert (reader.tp, reader.pp) == (2, 2)
    stage0 = torch_load_weights_only(reader.rank_file(0, 0))['model']
    stage1 = torch_load_weights_only(reader.rank_file(0, 1))['model']
    assert {k.split('.')[0] for k in stage0} == {
        'language_model', 'vision_model', 'vision_projection'
    }  # fmt: skip
    assert {k.split('.')[0] for k in stage1} == {'language_model'}
    assert 'language_model.decoder.layers.0.mlp.linear_fc1.weight' in stage1
    assert 'language_model.output_layer.weight' in stage1
    assert not any('layers.1.' in k for k in stage1 if k.startswith('language_model.'))

    back = LlavaForConditionalGeneration.from_pretrained(back_dir, attn_implementation='eager')
    returned = back.state_dict()
    for k, v in hf.state_dict().items():
        if '.encoder.layers.1.' not in k and 'post_layernorm' not in k:
            assert torch.equal(returned[k], v), k
    # Dropout off (the script's default 0.1 draws per stage otherwise).
    no_dropout = ['--attention-dropout', '0.0', '--hidden-dropout', '0.0']
    serial = run_distributed(_finetune_from, world_size=2, tp=2, args=(tp2, no_dropout))[-1]
    piped = run_distributed(_finetune_from, world_size=4, tp=2, pp=2, args=(pp2, no_dropout))[-1]
    assert piped == pytest.approx(serial, rel=1e-5)


def _last_error_line(capsys):
    # transformers' save_pretrained writes a progress bar to stderr before it.
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_layouts_the_model_cannot_take(capsys, tmp_path):
    from tests.unit_tests.models.test_llava_model import _hf_llava

    hf_dir, save = str(tmp_path / 'hf'), str(tmp_path / 'out')
    _hf_llava(-2, 'default').save_pretrained(hf_dir)
    flags = ['--hf-tokenizer-type', 'NullTokenizer']
    assert (
        _convert('hf', 'mcore', hf_dir, save, *flags, '--target-pipeline-parallel-size', '3') == 2
    )
    assert _last_error_line(capsys) == (
        "error: --target-pipeline-parallel-size 3 does not divide the language model's 2 layers "
        '(the vision tower stays whole on stage 0)'
    )
    assert _convert('hf', 'mcore', hf_dir, save, *flags, '--target-tensor-parallel-size', '3') == 2
    assert _last_error_line(capsys) == (
        "error: --target-tensor-parallel-size 3 does not divide the language model's attention "
        'heads 8'
    )
    assert not os.path.exists(save)

    # A directory missing a weight its config describes: one line, nothing written.
    from safetensors.torch import load_file, save_file

    weights = os.path.join(hf_dir, 'model.safetensors')
    tensors = load_file(weights)
    for dropped, named in (
        ('multi_modal_projector.linear_2.bias', "['multi_modal_projector.linear_2.bias']"),
        ('model.layers.1.self_attn.k_proj.weight',
         'model.layers.1.self_attn.k_proj.weight (as the language model or vision tower names '
         'it)'),
    ):  # fmt: skip
        kept = {k: v for k, v in tensors.items() if dropped not in k}
        save_file(kept, weights, metadata={'format': 'pt'})
        assert _convert('hf', 'mcore', hf_dir, save, *flags) == 1
        assert _last_error_line(capsys) == (
            f'error: --load-dir {hf_dir}: the LlavaForConditionalGeneration weights lack {named}'
        )
    save_file(tensors, weights, metadata={'format': 'pt'})
    assert not os.path.exists(os.path.join(save, 'latest_checkpointed_iteration.txt'))
