"""Datasets as Megatron r0.8's library users drive them: MockGPTDataset's length is the samples
it built (any shuffle position can be read), the mock multimodal dataset, a weighted blend with
no requested size refused with an error that is also an AssertionError, and
build_train_valid_test_data_iterators passing an 'external' provider's objects through."""

import types

import pytest
import torch

from megatron.core.datasets.blended_megatron_dataset_builder import (
    BlendedMegatronDatasetBuilder,
    MissingBlendSizeError,
)
from megatron.core.datasets.blended_megatron_dataset_config import BlendedMegatronDatasetConfig
from megatron.core.datasets.gpt_dataset import (
    GPTDatasetConfig,
    MockGPTDataset,
    MockGPTLowLevelDataset,
)
from megatron.core.datasets.multimodal_dataset import MockMultimodalDataset, MultimodalDatasetConfig
from megatron.training.tokenizer.tokenizer import _NullTokenizer
from tests.unit_tests.dist_utils import run_distributed


@pytest.fixture
def small_mock(monkeypatch):
    # 300 documents of < 64 tokens keep the index building instant.
    monkeypatch.setattr(MockGPTLowLevelDataset, 'size', 300)
    monkeypatch.setattr(MockGPTLowLevelDataset, 'max_sequence_length', 64)
    return _NullTokenizer(vocab_size=512)


def _config(tokenizer, cls=GPTDatasetConfig, **kw):
    return cls(
        random_seed=1234,
        sequence_length=16,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=True,
        tokenizer=tokenizer,
        **kw,
    )


def test_mock_gpt_length_covers_every_built_sample(small_mock):
    train, valid, test = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [20, None, 0], lambda: True, _config(small_mock)
    ).build()
    for ds in (train, valid, test):
        # One epoch at least (None and 0 ask for nothing more), so length >= what was asked.
        assert len(ds) == ds.sample_index.shape[0] - 1 == ds.shuffle_index.shape[0]
        last = ds[int(ds.shuffle_index.argmax())]  # the position Megatron's tests read
        assert last['tokens'].shape == (16,)
        ds[len(ds) - 1]
        with pytest.raises(IndexError):
            ds[len(ds)]
    assert len(train) >= 20
    assert not torch.any(valid[None]['loss_mask'])  # the padding sample


def test_mock_multimodal_dataset_adds_a_blank_image(small_mock):
    seen = []

    def preprocess(sample):
        seen.append(sorted(sample))
        return {**sample, 'image': sample['image'] + 1}

    cfg = _config(
        small_mock, MultimodalDatasetConfig, image_h=6, image_w=4, preprocess_func=preprocess
    )
    datasets = BlendedMegatronDatasetBuilder(
        MockMultimodalDataset, [None, None, None], lambda: True, cfg
    ).build()
    text = BlendedMegatronDatasetBuilder(
        MockGPTDataset, [None, None, None], lambda: True, _config(small_mock)
    ).build()
    for ds, plain in zip(datasets, text):
        sample = ds[3]
        assert sample['image'].shape == (3, 6, 4) and sample['image'].dtype == torch.float32
        assert torch.equal(sample['image'], torch.ones(3, 6, 4))  # preprocess_func ran
        assert torch.equal(sample['tokens'], plain[3]['tokens'])  # the GPT mock text
        assert len(ds) == len(plain)
    assert seen[0] == ['attention_mask', 'image', 'labels', 'loss_mask', 'position_ids', 'tokens']
    with pytest.raises(ValueError, match='image_h'):
        _config(small_mock, MultimodalDatasetConfig, image_w=4)


def test_weighted_blend_without_size_is_refused_as_value_and_assertion_error(tmp_path):
    cfg = BlendedMegatronDatasetConfig(
        random_seed=1, sequence_length=8, blend_per_split=[(['a', 'b'], [1.0, 2.0]), None, None]
    )
    with pytest.raises(MissingBlendSizeError, match='train split has blend weights') as err:
        BlendedMegatronDatasetBuilder(MockGPTDataset, [None, None, None], lambda: True, cfg)
    assert isinstance(err.value, ValueError) and isinstance(err.value, AssertionError)


def _external_iterators():
    from megatron.training.datasets.data_loaders import build_train_valid_test_data_iterators
    from megatron.training.global_vars import set_args

    set_args(
        types.SimpleNamespace(
            iteration=0,
            train_samples=None,
            train_iters=3,
            eval_interval=2,
            eval_iters=1,
            global_batch_size=4,
            consumed_train_samples=0,
            consumed_valid_samples=0,
            dataloader_type='external',
            skip_train=False,
        )
    )
    asked = []

    def provider(num_samples):
        asked.append(list(num_samples))
        return 1, 2, 3  # anything: 'external' loaders are the user's own objects

    provider.is_distributed = True
    try:
        return build_train_valid_test_data_iterators(provider), asked
    finally:
        set_args(None)


def test_external_provider_objects_pass_through_unsized():
    iterators, asked = run_distributed(_external_iterators, world_size=1)[0]
    assert iterators == (1, 2, 3)
    # train_iters * gbs, (train_iters // eval_interval + 1) * eval_iters * gbs, eval_iters * gbs
    assert asked == [[12, 8, 4]]
