"""Imported once by the test harness's forkserver (see dist_utils._PRELOAD): builds the indices
of the mock-data plan most end-to-end jobs use (sequence length 16, seed 1234, split 98,2,0; the
flags of test_resume.RESUME_ARGS and convert_utils.COMMON_ARGS), so that every pool worker forked
afterwards finds them in the in-process index memo (megatron/core/datasets/index_memo.py)
instead of shuffling the mock corpus's ~12M training samples itself. The memo's arrays are
read-only and a fork shares their pages, so the workers hold one copy between them.

The built arrays are the same as a worker's own build (the memo key covers every input of the
indices; test_gpt_dataset checks a memoised build against a fresh one).
"""


def _warm():
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    config = GPTDatasetConfig(
        random_seed=1234,
        sequence_length=16,
        blend=None,
        split='98,2,0',
        tokenizer=_NullTokenizer(4095),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    # One sample per split: the memo key leaves num_samples out (one epoch either way).
    BlendedMegatronDatasetBuilder(MockGPTDataset, [1, 1, 1], lambda: True, config).build()


try:
    _warm()
except Exception as exc:  # a warm-up is an optimisation: never stop the forkserver
    print(f'mock_index_warmup: skipped ({exc!r})')
