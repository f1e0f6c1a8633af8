"""pretrain_vlm.py on the bundled digit captions: two training steps of a tiny LLaVA through the
script's providers and Megatron's train_step, with --freeze-LM --freeze-ViT (the frozen weights
stay bit-identical and get no optimizer state; the projector trains); a bad flag stops before
any model is built; the caption samples place the image placeholder and mask the prompt."""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

TINY_VLM_ARGS = [
    '--num-layers', '1', '--hidden-size', '32', '--num-attention-heads', '4',
    '--seq-length', '16', '--max-position-embeddings', '16', '--img-h', '8', '--img-w', '8',
    '--patch-dim', '4', '--disable-vision-class-token', '--tokenizer-type', 'NullTokenizer',
    '--vocab-size', '20', '--micro-batch-size', '4', '--global-batch-size', '4',
    '--train-iters', '2', '--lr', '1e-2', '--attention-dropout', '0.0', '--hidden-dropout',
    '0.0', '--num-workers', '0', '--distributed-backend', 'gloo',
    '--position-embedding-type', 'rope',
]  # fmt: skip


def _train_frozen(extra):
    import contextlib
    import io

    import pretrain_vlm
    from megatron.core.enums import ModelType
    from megatron.training.datasets.vlm_dataset import DigitCaptionDataset, TextEncoder
    from megatron.training.global_vars import destroy_global_vars, get_args, get_tokenizer
    from megatron.training.initialize import initialize_megatron
    from megatron.training.training import setup_model_and_optimizer, train_step

    destroy_global_vars()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            initialize_megatron(
                extra_args_provider=pretrain_vlm.add_vlm_extra_args,
                args_list=TINY_VLM_ARGS + list(extra),
            )
            model, optimizer, scheduler = setup_model_and_optimizer(
                pretrain_vlm.model_provider, ModelType.encoder_or_decoder
            )
        before = {n: p.detach().clone() for n, p in model[0].named_parameters()}
        trainable = {n for n, p in model[0].named_parameters() if p.requires_grad}
        dataset = DigitCaptionDataset(
            'train', 8, TextEncoder(get_tokenizer(), True), 16, 8, 8, seed=1
        )
        loader = iter(torch.utils.data.DataLoader(dataset, batch_size=4))
        losses = []
        for iteration in range(2):
            get_args().curr_iteration = iteration
            loss, *_ = train_step(
                pretrain_vlm.forward_step, loader, model, optimizer, scheduler, model[0].config
            )
            losses.append(float(loss['lm loss']))
        changed = {
            n for n, p in model[0].named_parameters() if not torch.equal(p.detach(), before[n])
        }
        held = {id(p) for p in optimizer.get_parameters()}
        in_optimizer = {n for n, p in model[0].named_parameters() if id(p) in held}
        return {
            'losses': losses,
            'trainable': trainable,
            'changed': changed,
            'in_optimizer': in_optimizer,
        }
    finally:
        destroy_global_vars()


def test_freeze_lm_and_vit_trains_only_the_projector():
    result = run_distributed(_train_frozen, world_size=1, args=(['--freeze-LM', '--freeze-ViT'],))[
        0
    ]
    assert all(torch.isfinite(torch.tensor(result['losses'])))
    assert result['trainable'] and all(
        n.startswith('module.vision_projection.') or n.startswith('vision_projection.')
        for n in result['trainable']
    ), result['trainable']
    # Only the projector moves, every projector weight moves, and only it has optimizer state.
    assert result['changed'] == result['trainable']
    assert result['in_optimizer'] == result['trainable']


def _bad_flags(extra):
    import contextlib
    import io

    import pretrain_vlm
    from megatron.training.global_vars import destroy_global_vars, get_args
    from megatron.training.initialize import initialize_megatron

    destroy_global_vars()
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            initialize_megatron(
                extra_args_provider=pretrain_vlm.add_vlm_extra_args,
                args_list=TINY_VLM_ARGS + list(extra),
            )
        try:
            pretrain_vlm.check_vlm_args(get_args())
        except ValueError as exc:
            return str(exc)
        return None
    finally:
        destroy_global_vars()


@pytest.mark.parametrize(
    'extra, expected',
    [
        (['--vision-model-type', 'siglip'], '--vision-model-type siglip is not supported'),
        (['--patch-dim', '3'], '--img-h 8 and --img-w 8 must be multiples of --patch-dim 3'),
    ],
)
def test_bad_flags_refused_in_one_line(extra, expected):
    message = run_distributed(_bad_flags, world_size=1, args=(extra,))[0]
    assert message is not None and expected in message and '\n' not in message


@pytest.mark.parametrize(
    'extra, expected',
    [
        (
            ['--freeze-LM'],
            '--freeze-LM with --pipeline-model-parallel-size 2 leaves stages 1...1 nothing to '
            'train',
        ),
        (
            ['--num-layers-per-virtual-pipeline-stage', '1'],
            'the interleaved pipeline schedule is not supported for LLaVA',
        ),
    ],
)
def test_pipeline_flags_refused_in_one_line(extra, expected):
    pp2 = ['--pipeline-model-parallel-size', '2', '--num-layers', '4']
    message = run_distributed(_bad_flags, world_size=2, pp=2, args=(pp2 + extra,))[0]
    assert message is not None and expected in message and '\n' not in message


def test_digit_caption_sample_layout():
    from megatron.core.models.multimodal.llava_inputs import DEFAULT_IMAGE_TOKEN_INDEX
    from megatron.training.datasets.vlm_dataset import (
        DIGIT_WORDS,
        DigitCaptionDataset,
        TextEncoder,
        load_digits,
    )

    class _Null:
        eod = 20

    dataset = DigitCaptionDataset('valid', 1, TextEncoder(_Null(), True), 16, 8, 8, seed=1)
    sample = dataset[0]
    words = 'which digit is this ? it is a handwritten'.split()
    digit = int(load_digits()[1][dataset.indices[0]])
    ids = [DIGIT_WORDS.index(w) for w in words] + [10 + digit, DIGIT_WORDS.index('.'), 20]
    assert sample['tokens'][:12].tolist() == [DEFAULT_IMAGE_TOKEN_INDEX] + ids[:11]
    assert sample['labels'][:12].tolist() == ids
    # The loss covers the answer ("it is a handwritten <digit> .") and the eod only.
    assert sample['loss_mask'].tolist() == [0.0] * 5 + [1.0] * 7 + [0.0] * 4
    assert sample['image'].shape == (3, 8, 8)
    with pytest.raises(ValueError, match='--seq-length 8 is too short'):
        DigitCaptionDataset('valid', 1, TextEncoder(_Null(), True), 8, 8, 8, seed=1)


def test_bad_image_and_unknown_words_refused(tmp_path):
    from megatron.training.datasets.vlm_dataset import TextEncoder, read_image

    bad = tmp_path / 'broken.png'
    bad.write_bytes(b'not a png')
    with pytest.raises(ValueError, match=f'cannot decode image {bad}'):
        read_image(str(bad), 8, 8)

    class _Null:
        eod = 20

    with pytest.raises(ValueError, match=r"only the digit caption words are known, got \['cat'\]"):
        TextEncoder(_Null(), True)('which cat')


def _pretrain_mock(extra):
    import pretrain_vlm
    from megatron.core.enums import ModelType
    from megatron.training.global_vars import destroy_global_vars
    from megatron.training.training import pretrain

    destroy_global_vars()
    try:
        samples = pretrain_vlm._mock_datasets  # the script's own mock path, as `--mock-data` runs
        result = pretrain(
            pretrain_vlm.train_valid_test_datasets_provider,
            pretrain_vlm.model_provider,
            ModelType.encoder_or_decoder,
            pretrain_vlm.forward_step,
            extra_args_provider=pretrain_vlm.add_vlm_extra_args,
            args_list=TINY_VLM_ARGS + list(extra),
        )
        from megatron.training.global_vars import get_args

        train, _, _ = samples(get_args(), [4, 4, 4])
        result['first_sample'] = train[0]
        return result
    finally:
        destroy_global_vars()


def test_mock_data_trains_through_the_script():
    """`pretrain_vlm.py --mock-data`: Megatron's MockMultimodalDataset in the placeholder layout
    (the image token first, no loss on it), two training steps and an evaluation."""
    from megatron.core.models.multimodal.llava_model import DEFAULT_IMAGE_TOKEN_INDEX

    # Mock documents are 1, 2, ..., n - 1 with n up to 4096: a vocabulary that holds those ids.
    extra = ['--mock-data', '--vocab-size', '4096', '--eval-iters', '1', '--eval-interval', '2']
    result = run_distributed(_pretrain_mock, world_size=1, args=(extra,))[0]
    assert result['iteration'] == 2
    losses = [result['train_losses'][i]['lm loss'] for i in (1, 2)]
    assert all(torch.isfinite(torch.tensor(losses))), losses
    assert torch.isfinite(torch.tensor(result['valid_losses']['lm loss']))
    sample = result['first_sample']
    assert int(sample['tokens'][0]) == DEFAULT_IMAGE_TOKEN_INDEX
    assert float(sample['loss_mask'][0]) == 0.0
    assert tuple(sample['image'].shape[-2:]) == (8, 8)
