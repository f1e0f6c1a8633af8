"""The surface Megatron core_r0.8.0's pretrain_gpt.py, pretrain_bert.py and pretrain_t5.py use,
written out literally: the keywords they pass to the dataset configs and model constructors, the
callee signatures, the `pretrain()` and `forward_step` / `loss_func` contracts, the timers and the
straggler detector. `tests/functional_tests/test_megatron_r08_scripts.py` trains through contract
scripts written against that surface; this file says exactly which names and keywords it holds.
"""

import dataclasses
import inspect
import os
from types import SimpleNamespace

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BERT_VOCAB = os.path.join(REPO, 'data', 'bert', 'bert-vocab.txt')

# Keywords each r0.8 script passes to its dataset config (all by keyword).
GPT_DATASET_KEYWORDS = {
    'random_seed',
    'sequence_length',
    'blend',
    'blend_per_split',
    'split',
    'num_dataset_builder_threads',
    'path_to_cache',
    'mmap_bin_files',
    'tokenizer',
    'reset_position_ids',
    'reset_attention_mask',
    'eod_mask_loss',
    'create_attention_mask',
    's3_cache_path',
}
_MASKED_KEYWORDS = {
    'random_seed',
    'sequence_length',
    'blend',
    'blend_per_split',
    'split',
    'path_to_cache',
    'tokenizer',
    'masking_probability',
    'short_sequence_probability',
    'masking_max_ngram',
    'masking_do_full_word',
    'masking_do_permutation',
    'masking_use_longer_ngrams',
    'masking_use_geometric_distribution',
}
BERT_DATASET_KEYWORDS = _MASKED_KEYWORDS | {'classification_head'}
T5_DATASET_KEYWORDS = _MASKED_KEYWORDS | {'sequence_length_decoder'}

# Keywords of the model constructors (all by keyword).
GPT_MODEL_KEYWORDS = {
    'config',
    'transformer_layer_spec',
    'vocab_size',
    'max_sequence_length',
    'pre_process',
    'post_process',
    'fp16_lm_cross_entropy',
    'parallel_output',
    'share_embeddings_and_output_weights',
    'position_embedding_type',
    'rotary_percent',
    'rotary_base',
    'seq_len_interpolation_factor',  # in the signature, not passed by the script
}
BERT_MODEL_KEYWORDS = {
    'config',
    'transformer_layer_spec',
    'vocab_size',
    'max_sequence_length',
    'num_tokentypes',
    'add_binary_head',
    'share_embeddings_and_output_weights',
    'parallel_output',
    'pre_process',
    'post_process',
}
T5_MODEL_KEYWORDS = {
    'config',
    'transformer_encoder_layer_spec',
    'transformer_decoder_layer_spec',
    'vocab_size',
    'max_sequence_length',
    'pre_process',
    'post_process',
    'fp16_lm_cross_entropy',
    'parallel_output',
    'share_embeddings_and_output_weights',
    'position_embedding_type',
    'rotary_percent',
}


def _init_fields(cls):
    return {f.name for f in dataclasses.fields(cls) if f.init}


def _bert_tokenizer(extra_ids=0):
    from megatron.training.tokenizer.tokenizer import _BertWordPieceTokenizer

    return _BertWordPieceTokenizer(BERT_VOCAB, lower_case=True, vocab_extra_ids=extra_ids)


def test_dataset_configs_take_the_r08_keywords():
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig

    for cls, keywords in (
        (GPTDatasetConfig, GPT_DATASET_KEYWORDS),
        (BERTMaskedWordPieceDatasetConfig, BERT_DATASET_KEYWORDS),
        (T5MaskedWordPieceDatasetConfig, T5_DATASET_KEYWORDS),
    ):
        missing = keywords - _init_fields(cls)
        assert not missing, f'{cls.__name__} lacks {sorted(missing)}'
        # Non-init at r0.8: passing them is a TypeError.
        for name in ('mock', 'split_matrix'):
            assert name in {f.name for f in dataclasses.fields(cls)} and name not in _init_fields(
                cls
            )
    assert 'sequence_length_encoder' not in _init_fields(T5MaskedWordPieceDatasetConfig)
    defaults = {f.name: f.default for f in dataclasses.fields(GPTDatasetConfig)}
    assert defaults['drop_last_partial_validation_sequence'] is True
    assert defaults['add_extra_token_to_sequence'] is True
    assert defaults['s3_cache_path'] is None
    for cls in (BERTMaskedWordPieceDatasetConfig, T5MaskedWordPieceDatasetConfig):
        defaults = {f.name: f.default for f in dataclasses.fields(cls)}
        assert defaults['num_dataset_builder_threads'] == 1 and defaults['mmap_bin_files'] is True


def _r08_blends(data_path=None):
    from megatron.core.datasets.utils import get_blend_from_list

    return dict(
        blend=get_blend_from_list(data_path),
        blend_per_split=[get_blend_from_list(None)] * 3,
    )


def test_gpt_dataset_config_built_as_r08_does():
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    kwargs = dict(
        random_seed=1234,
        sequence_length=16,
        split='969, 30, 1',
        num_dataset_builder_threads=1,
        path_to_cache=None,
        mmap_bin_files=True,
        tokenizer=_NullTokenizer(100),
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=True,
        s3_cache_path=None,
        **_r08_blends(),
    )
    assert set(kwargs) == GPT_DATASET_KEYWORDS
    config = GPTDatasetConfig(**kwargs)
    # No blend: mock, and the split becomes an even "1,1,1".
    assert config.mock is True and config.split == '1,1,1'
    with pytest.raises(TypeError):
        GPTDatasetConfig(**kwargs, mock=True)
    with pytest.raises(ValueError, match=r's3_cache_path.*--s3-cache-path'):
        GPTDatasetConfig(**{**kwargs, 's3_cache_path': '/tmp/s3-cache'})


def test_masked_dataset_configs_built_as_r08_does():
    from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDatasetConfig
    from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDatasetConfig

    common = dict(
        random_seed=1234,
        split='969, 30, 1',
        path_to_cache=None,
        masking_probability=0.15,
        short_sequence_probability=0.1,
        masking_do_full_word=True,
        masking_do_permutation=False,
        masking_use_longer_ngrams=False,
        **_r08_blends(['prefix']),
    )
    bert = dict(
        common,
        sequence_length=32,
        tokenizer=_bert_tokenizer(),
        masking_max_ngram=3,
        masking_use_geometric_distribution=False,
        classification_head=True,
    )
    assert set(bert) == BERT_DATASET_KEYWORDS
    config = BERTMaskedWordPieceDatasetConfig(**bert)
    assert config.mock is False and config.num_dataset_builder_threads == 1
    t5 = dict(
        common,
        sequence_length=32,
        sequence_length_decoder=16,
        tokenizer=_bert_tokenizer(extra_ids=100),
        masking_max_ngram=10,
        masking_use_geometric_distribution=True,
    )
    assert set(t5) == T5_DATASET_KEYWORDS
    config = T5MaskedWordPieceDatasetConfig(**t5)
    assert config.sequence_length_encoder == 32 and config.sequence_length_decoder == 16
    with pytest.raises(TypeError):
        T5MaskedWordPieceDatasetConfig(**t5, sequence_length_encoder=32)
    # T5's sentinels come from the tokenizer's additional special tokens.
    with pytest.raises(ValueError):
        T5MaskedWordPieceDatasetConfig(**{**t5, 'tokenizer': _bert_tokenizer()})
    # Masking rules checked at construction.
    with pytest.raises(ValueError):
        BERTMaskedWordPieceDatasetConfig(**{**bert, 'masking_probability': 1.0})
    with pytest.raises(ValueError):
        BERTMaskedWordPieceDatasetConfig(
            **{**bert, 'masking_do_permutation': True, 'masking_use_geometric_distribution': True}
        )


def _parameters(fn):
    return inspect.signature(fn).parameters


def test_model_constructors_take_the_r08_keywords():
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.T5 import T5Model

    for cls, keywords in (
        (GPTModel, GPT_MODEL_KEYWORDS),
        (BertModel, BERT_MODEL_KEYWORDS),
        (T5Model, T5_MODEL_KEYWORDS),
    ):
        missing = keywords - set(_parameters(cls.__init__))
        assert not missing, f'{cls.__name__} lacks {sorted(missing)}'
    assert _parameters(BertModel.__init__)['num_tokentypes'].default is inspect.Parameter.empty
    # r0.8's T5 script passes neither: the stage's stacks follow the pipeline split.
    assert _parameters(T5Model.__init__)['add_encoder'].default is None
    assert _parameters(T5Model.__init__)['add_decoder'].default is None


def test_pretrain_and_config_builder_signatures():
    from megatron.training import pretrain
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.yaml_arguments import core_transformer_config_from_yaml

    params = list(_parameters(pretrain).items())[:7]
    assert [(name, p.default) for name, p in params] == [
        ('train_valid_test_dataset_provider', inspect.Parameter.empty),
        ('model_provider', inspect.Parameter.empty),
        ('model_type', inspect.Parameter.empty),
        ('forward_step_func', inspect.Parameter.empty),
        ('process_non_loss_data_func', None),
        ('extra_args_provider', None),
        ('args_defaults', {}),
    ]
    assert list(_parameters(core_transformer_config_from_args)) == ['args', 'config_class']
    # Megatron's spelling of the second parameter.
    assert list(_parameters(core_transformer_config_from_yaml))[:2] == ['args', 'transfomer_key']


def test_layer_spec_getters_as_the_scripts_call_them():
    from megatron.core.models.bert.bert_layer_specs import (
        bert_layer_local_spec,
        bert_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.T5 import t5_spec
    from megatron.core.transformer.spec_utils import ModuleSpec, import_module
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    for getter in (get_gpt_layer_local_spec, get_gpt_layer_with_transformer_engine_spec):
        assert isinstance(getter(None, False, False), ModuleSpec)  # 3 positional
    # BERT: module objects, not functions.
    assert isinstance(bert_layer_local_spec, ModuleSpec)
    assert isinstance(bert_layer_with_transformer_engine_spec, ModuleSpec)
    for name in (
        'get_t5_encoder_with_local_block_spec',
        'get_t5_decoder_with_local_block_spec',
        'get_t5_encoder_with_transformer_engine_block_spec',
        'get_t5_decoder_with_transformer_engine_block_spec',
    ):
        block = getattr(t5_spec, name)(3)
        assert isinstance(block, TransformerBlockSubmodules) and len(block.layer_specs) == 3
        assert block.layer_norm is not None
    # --spec MODULE ATTR: two items, the attribute returned uncalled; `--spec local` (one item)
    # fails for GPT as it does in Megatron.
    spec = ['megatron.core.models.bert.bert_layer_specs', 'bert_layer_local_spec']
    assert import_module(spec) is bert_layer_local_spec
    with pytest.raises(ValueError):
        import_module(['local'])


def test_straggler_detector_and_timers_as_the_scripts_use_them():
    from megatron.core.timers import Timers
    from megatron.core.utils import StragglerDetector

    stimer = StragglerDetector()
    assert StragglerDetector() is stimer and stimer(bdata=True) is stimer
    with stimer(bdata=True):
        pass
    with pytest.raises(KeyError):  # never swallows an exception
        with stimer:
            raise KeyError('x')

    timers = Timers(0, 'minmax')  # --timing-log-level 0 (the default)
    first = timers('batch-generator', log_level=2)
    first.start()
    second = timers('batch-generator')  # the second call passes no log_level
    second.stop()
    assert first is second and 'batch-generator' not in timers._timers  # both no-ops
    timers = Timers(2, 'minmax')
    timers('batch generator', log_level=2).start()  # T5's name, with a space
    timers('batch generator').stop()
    assert timers('batch generator').elapsed(reset=False) >= 0.0


class _Chunk(torch.nn.Module):
    """A model chunk as the schedules see it: set_input_tensor and a model type."""

    def __init__(self):
        super().__init__()
        from megatron.core.enums import ModelType

        self.model_type = ModelType.encoder_or_decoder
        self.weight = torch.nn.Parameter(torch.ones(()))

    def set_input_tensor(self, tensor):
        pass


def _loss_contracts():
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.microbatch_step import forward_step

    config = ModelParallelConfig()
    out = {}
    model = _Chunk()

    def three_tuple(data_iterator, model):  # GPT / T5: (sum, tokens, {key: (sum, count)})
        losses = model.weight * torch.tensor([2.0, 4.0, 6.0])
        tokens = torch.tensor(3, dtype=torch.int)
        return losses, lambda o: (o.sum(), tokens, {'lm loss': (o.sum().detach(), tokens)})

    def two_tuple(data_iterator, model):  # BERT: (mean, {key: tensor})
        loss = model.weight * 5.0
        return loss, lambda o: (o, {'lm loss': o.detach()})

    for name, fn in (('three', three_tuple), ('two', two_tuple)):
        store = []
        loss, num_tokens = forward_step(fn, None, model, 4, None, store, config)
        out[name] = (float(loss), int(num_tokens), store)
    return out


def test_loss_func_tuples_scale_as_megatron():
    """3-tuple: divided by its token count and the micro-batch count; 2-tuple: by the micro-batch
    count only; the dict is stored for the iteration's reduction."""
    out = run_distributed(_loss_contracts, world_size=2)[0]
    assert out['three'][:2] == (12.0 / 3 / 4, 3)
    assert out['two'][:2] == (5.0 / 4, 0)
    assert float(out['three'][2][0]['lm loss'][0]) == 12.0
    assert float(out['two'][2][0]['lm loss']) == 5.0


def test_iteration_reduction_of_the_loss_dicts():
    """(numerator, denominator) pairs are summed over micro-batches before dividing; tensors are
    averaged."""
    from megatron.training.training import reduce_losses_over_microbatches

    stores = [
        {'lm loss': (torch.tensor(6.0), torch.tensor(3)), 'sop loss': torch.tensor(1.0)},
        {'lm loss': (torch.tensor(2.0), torch.tensor(1)), 'sop loss': torch.tensor(3.0)},
    ]
    reduced = reduce_losses_over_microbatches(stores)
    assert float(reduced['lm loss']) == 2.0 and float(reduced['sop loss']) == 2.0


def _tp_batch_keys():
    from megatron.training import global_vars
    from megatron.training.utils import get_batch_on_this_cp_rank, get_batch_on_this_tp_rank

    global_vars.set_args(
        SimpleNamespace(
            pipeline_model_parallel_size=1,
            micro_batch_size=1,
            seq_length=4,
            create_attention_mask_in_dataloader=False,
            context_parallel_size=1,
        )
    )
    sample = {
        'tokens': torch.arange(4).view(1, 4),
        'labels': torch.arange(1, 5).view(1, 4),
        'loss_mask': torch.ones(1, 4),
        'position_ids': torch.arange(4).view(1, 4),
    }
    try:
        batch = get_batch_on_this_tp_rank(
            iter([sample]) if torch.distributed.get_rank() == 0 else None
        )
        same = get_batch_on_this_cp_rank(batch) is batch
    finally:
        global_vars.set_args(None)
    return list(batch), same, [None if v is None else v.tolist() for v in batch.values()]


def test_gpt_batch_dict_order_is_what_the_script_unpacks():
    """pretrain_gpt unpacks `.values()` as tokens, labels, loss_mask, attention_mask,
    position_ids; TP rank 1 gets rank 0's tensors."""
    outs = run_distributed(_tp_batch_keys, world_size=2, tp=2)
    for keys, same, values in outs:
        assert keys == ['tokens', 'labels', 'loss_mask', 'attention_mask', 'position_ids']
        assert same and values == outs[0][2]
    assert outs[1][2][0] == [[0, 1, 2, 3]] and outs[1][2][3] is None
