"""Megatron core_r0.8.0's public names import from the same modules and behave as Megatron's:
the names its pretrain_gpt.py / pretrain_bert.py / pretrain_t5.py import, the top-level
`megatron.core` names, the parallel_state additions, the legacy-model module and the YAML model
config."""

import logging
import textwrap

import pytest
import torch
import torch.nn.functional as F

from tests.unit_tests.dist_utils import run_distributed

# The import block of Megatron core_r0.8.0's pretrain_gpt.py, as a user's edited copy has it.
PRETRAIN_GPT_R08_IMPORTS = """
import os
import torch
from functools import partial

from typing import Union
from megatron.training import get_args
from megatron.training import print_rank_0
from megatron.training import get_timers
from megatron.training import get_tokenizer
from megatron.core import mpu
from megatron.core.enums import ModelType
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.datasets.gpt_dataset import GPTDatasetConfig
from megatron.core.datasets.gpt_dataset import MockGPTDataset, GPTDataset
import megatron.legacy.model
from megatron.core.models.gpt import GPTModel
from megatron.training import pretrain
from megatron.core.utils import StragglerDetector
from megatron.core.transformer.spec_utils import import_module
from megatron.training.utils import (
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.yaml_arguments import core_transformer_config_from_yaml
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)

stimer = StragglerDetector()
"""

# The import blocks of core_r0.8.0's pretrain_bert.py and pretrain_t5.py.
PRETRAIN_BERT_R08_IMPORTS = """
from functools import partial

import torch
import torch.nn.functional as F

from megatron.training import get_args
from megatron.training import get_tokenizer
from megatron.training import print_rank_0
from megatron.training import get_timers
from megatron.core import tensor_parallel
from megatron.core.enums import ModelType
import megatron.legacy.model
from megatron.core.models.bert.bert_model import BertModel
from megatron.training import pretrain
from megatron.training.utils import average_losses_across_data_parallel_group
from megatron.training.arguments import core_transformer_config_from_args
from megatron.core.transformer.spec_utils import import_module
from megatron.core.models.bert.bert_layer_specs import bert_layer_with_transformer_engine_spec, bert_layer_local_spec
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.bert_dataset import BERTMaskedWordPieceDataset, BERTMaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core import mpu, tensor_parallel
"""  # noqa: E501 (Megatron's lines as written)

PRETRAIN_T5_R08_IMPORTS = """
from copy import deepcopy
from functools import partial
from typing import Union

import torch

from megatron.training import (
    get_args,
    get_timers,
    get_tokenizer,
    pretrain,
    print_rank_0
)
from megatron.core import mpu, tensor_parallel
from megatron.core.enums import ModelType
from megatron.core.models.T5 import T5Model
from megatron.training import pretrain
from megatron.training.arguments import core_transformer_config_from_args
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.t5_dataset import T5MaskedWordPieceDataset, T5MaskedWordPieceDatasetConfig
from megatron.core.datasets.utils import get_blend_from_list
from megatron.core.models.T5.t5_spec import (get_t5_encoder_with_transformer_engine_block_spec,
                                            get_t5_decoder_with_transformer_engine_block_spec,
                                            get_t5_encoder_with_local_block_spec,
                                            get_t5_decoder_with_local_block_spec)
from megatron.legacy.model import T5Model as LegacyT5Model
"""  # noqa: E501 (Megatron's lines as written)


def test_pretrain_gpt_r08_import_block_runs():
    namespace = {}
    exec(compile(PRETRAIN_GPT_R08_IMPORTS, 'pretrain_gpt_r08_imports', 'exec'), namespace)
    from megatron.core import parallel_state

    assert namespace['mpu'] is parallel_state
    assert namespace['stimer'] is namespace['StragglerDetector']()
    assert callable(namespace['core_transformer_config_from_yaml'])


def test_top_level_core_names():
    import megatron.core
    from megatron.core import (
        DistributedDataParallel,
        Timers,
        init_num_microbatches_calculator,
        mpu,
        parallel_state,
        tensor_parallel,
    )
    from megatron.core.distributed import DistributedDataParallel as DDP
    from megatron.core.enums import ModelType
    from megatron.core.num_microbatches_calculator import (
        init_num_microbatches_calculator as init_calculator,
    )
    from megatron.core.timers import Timers as CoreTimers

    assert mpu is parallel_state and DistributedDataParallel is DDP and Timers is CoreTimers
    assert init_num_microbatches_calculator is init_calculator
    assert tensor_parallel.ColumnParallelLinear is not None
    assert {m.name for m in ModelType} >= {'encoder_or_decoder', 'encoder_and_decoder'}
    for name in (
        'parallel_state',
        'tensor_parallel',
        'utils',
        'DistributedDataParallel',
        'init_num_microbatches_calculator',
        'ModelParallelConfig',
        'Timers',
    ):
        assert name in megatron.core.__all__


def test_training_names():
    from megatron.training import get_args, get_timers, get_tokenizer, pretrain, print_rank_0
    from megatron.training.arguments import core_transformer_config_from_args
    from megatron.training.utils import (
        average_losses_across_data_parallel_group,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    )

    for fn in (
        get_args,
        get_timers,
        get_tokenizer,
        pretrain,
        print_rank_0,
        core_transformer_config_from_args,
        average_losses_across_data_parallel_group,
        get_batch_on_this_cp_rank,
        get_batch_on_this_tp_rank,
    ):
        assert callable(fn)


def test_dataset_names():
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.core.datasets.gpt_dataset import (
        GPTDataset,
        GPTDatasetConfig,
        MockGPTDataset,
    )
    from megatron.core.datasets.utils import get_blend_from_list

    assert issubclass(MockGPTDataset, GPTDataset) and callable(BlendedMegatronDatasetBuilder)
    assert get_blend_from_list(['0.3', 'a', '0.7', 'b']) == (['a', 'b'], [0.3, 0.7])
    assert get_blend_from_list(['a']) == (['a'], None)
    assert 'reset_position_ids' in GPTDatasetConfig.__dataclass_fields__


def test_import_module_resolves_a_spec_path():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import import_module

    # --spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec
    fn = import_module(('megatron.core.models.gpt.gpt_layer_specs', 'get_gpt_layer_local_spec'))
    assert fn is get_gpt_layer_local_spec


def test_te_spec_getter_returns_local_spec_with_one_line_warning(caplog):
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_layer_local_spec,
        get_gpt_layer_with_transformer_engine_spec,
    )

    with caplog.at_level(logging.WARNING):
        spec = get_gpt_layer_with_transformer_engine_spec(None, False, True)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and '\n' not in warnings[0] and 'local spec' in warnings[0]
    assert repr(spec) == repr(get_gpt_layer_local_spec(None, False, True))
    with pytest.raises(ValueError, match='fp8'):
        get_gpt_layer_with_transformer_engine_spec(fp8='hybrid')


@pytest.mark.parametrize(
    'name',
    [
        'GPTModel',
        'BertModel',
        'T5Model',
        'Float16Module',
        'LayerNorm',
        'RMSNorm',
        'get_language_model',
    ],
)
def test_legacy_models_refuse_with_one_line(name):
    import megatron.legacy.model

    with pytest.raises(NotImplementedError) as err:
        getattr(megatron.legacy.model, name)(None, num_tokentypes=0)
    assert '\n' not in str(err.value)
    assert 'legacy models are not included' in str(err.value)


def test_timers_write_resets_by_default():
    from megatron.core.timers import Timers

    class Scalars:
        def __init__(self):
            self.values = {}

        def add_scalar(self, name, value, iteration):
            self.values[name] = value

    timers = Timers(0, 'minmax')
    timers('interval', 0)._elapsed = 0.5
    writer = Scalars()
    timers.write(['interval'], writer, iteration=3)
    assert writer.values == {'interval-time': 0.5}
    assert timers('interval').elapsed(reset=False) == 0.0  # reset by write, as in Megatron
    timers('interval')._elapsed = 0.25
    timers.write(['interval'], writer, iteration=4, reset=False)
    assert timers('interval').elapsed(reset=False) == 0.25


def _parallel_state_names():
    from megatron.core import parallel_state as ps

    def ranks(group):
        return torch.distributed.get_process_group_ranks(group)

    nccl = None
    if hasattr(torch.distributed, 'ProcessGroupNCCL'):
        opts = ps.get_nccl_options('tp', {'tp': {'max_ctas': 16}})
        nccl = (opts.config.cga_cluster_size, opts.config.max_ctas, opts.config.min_ctas)
    return {
        'is_initialized': ps.is_initialized(),
        'mp': ranks(ps.get_model_parallel_group()),
        'mp_ep': ranks(ps.get_model_parallel_group(with_expert_parallel=True)),
        'tp_ep_size': ps.get_tensor_and_expert_parallel_world_size(),
        'tp_ep_rank': ps.get_tensor_and_expert_parallel_rank(),
        'amax': ranks(ps.get_amax_reduction_group()),
        'amax_cp': ranks(ps.get_amax_reduction_group(with_context_parallel=True)),
        'no_nccl_cfg': ps.get_nccl_options('dp', {'tp': {}}),
        'nccl': nccl,
    }


def test_parallel_state_additions():
    from megatron.core import parallel_state as ps

    assert ps.is_initialized() is False
    # 4 ranks: tp=2, ep=2 (dp=2 split by ep). Model parallel = tp x pp; with ep: tp x ep x pp.
    outs = run_distributed(_parallel_state_names, world_size=4, tp=2, ep=2)
    for rank, out in enumerate(outs):
        tp_pair = [rank - rank % 2, rank - rank % 2 + 1]
        assert out['is_initialized'] is True
        assert out['mp'] == tp_pair and out['mp_ep'] == [0, 1, 2, 3]
        assert (out['tp_ep_size'], out['tp_ep_rank']) == (4, rank)
        assert out['amax'] == tp_pair and out['amax_cp'] == tp_pair
        assert out['no_nccl_cfg'] is None
        assert out['nccl'] in (None, (4, 16, 1))


YAML_R08 = textwrap.dedent("""
    language_model:
      num_layers: 2
      hidden_size: 64
      num_attention_heads: 4
      num_query_groups: null
      ffn_hidden_size: 128
      kv_channels: null
      hidden_dropout: 0.0
      attention_dropout: 0.0
      layernorm_epsilon: 1.e-5
      add_bias_linear: False
      bias_activation_fusion: False
      gated_linear_unit: False
      activation_func: swiglu
      num_moe_experts: null
      init_method: null
      init_method_std: 0.02
      apply_query_key_layer_scaling: False
      attention_softmax_in_fp32: False
      bias_swiglu_fusion: True
      normalization: "RMSNorm"
      recompute_granularity: null
    model_parallel:
      tensor_model_parallel_size: 1
      pipeline_model_parallel_size: 1
      virtual_pipeline_model_parallel_size: null
      sequence_parallel: False
      perform_initialization: True
      use_cpu_initialization: null
      fp16: False
      bf16: True
      params_dtype: null
      timers: null
      overlap_p2p_comm: False
      batch_p2p_comm: True
    micro_batch_size: 2
    global_batch_size: 8
""")


def test_core_transformer_config_from_yaml_matches_the_flags(tmp_path, capsys):
    from megatron.training.arguments import (
        core_transformer_config_from_args,
        parse_args,
        validate_args,
    )
    from megatron.training.yaml_arguments import core_transformer_config_from_yaml, load_yaml

    path = tmp_path / 'gpt_config.yaml'
    path.write_text(YAML_R08)
    args = load_yaml(str(path))
    assert args.yaml_cfg == str(path) and args.model_parallel.bf16 is True
    config = core_transformer_config_from_yaml(args, 'language_model')
    assert (config.num_layers, config.hidden_size, config.ffn_hidden_size) == (2, 64, 128)
    assert config.activation_func is F.silu and config.gated_linear_unit
    assert config.params_dtype == config.pipeline_dtype == torch.bfloat16
    assert config.normalization == 'RMSNorm' and config.add_bias_linear is False

    flags = parse_args(
        args_list=[
            '--num-layers',
            '2',
            '--hidden-size',
            '64',
            '--num-attention-heads',
            '4',
            '--ffn-hidden-size',
            '128',
            '--seq-length',
            '16',
            '--max-position-embeddings',
            '16',
            '--micro-batch-size',
            '2',
            '--train-iters',
            '1',
            '--hidden-dropout',
            '0.0',
            '--attention-dropout',
            '0.0',
            '--disable-bias-linear',
            '--swiglu',
            '--bf16',
            '--normalization',
            'RMSNorm',
            '--no-persist-layer-norm',
        ]
    )
    flags.world_size, flags.rank = 1, 0
    from_flags = core_transformer_config_from_args(validate_args(flags, {}))
    for field in (
        'num_layers',
        'hidden_size',
        'ffn_hidden_size',
        'num_attention_heads',
        'kv_channels',
        'gated_linear_unit',
        'add_bias_linear',
        'normalization',
        'params_dtype',
        'layernorm_epsilon',
        'hidden_dropout',
        'init_method_std',
        'bias_activation_fusion',
        'num_query_groups',
    ):
        assert getattr(config, field) == getattr(from_flags, field), field

    with pytest.raises(ValueError, match="activation_func: 'relu' is not a supported"):
        path.write_text(YAML_R08.replace('activation_func: swiglu', 'activation_func: relu'))
        core_transformer_config_from_yaml(load_yaml(str(path)))


def test_bert_t5_model_and_inference_names():
    from megatron.core import InferenceParams
    from megatron.core.inference_params import InferenceParams as CoreInferenceParams
    from megatron.core.models.bert.bert_layer_specs import (
        bert_layer_local_spec,
        bert_layer_with_transformer_engine_spec,
    )
    from megatron.core.models.bert.bert_model import BertModel
    from megatron.core.models.T5 import T5Model
    from megatron.core.models.T5.t5_spec import (
        get_t5_decoder_with_local_block_spec,
        get_t5_decoder_with_transformer_engine_block_spec,
        get_t5_encoder_with_local_block_spec,
        get_t5_encoder_with_transformer_engine_block_spec,
    )
    from megatron.core.transformer.spec_utils import ModuleSpec

    assert InferenceParams is CoreInferenceParams
    assert isinstance(bert_layer_local_spec, ModuleSpec)
    assert isinstance(bert_layer_with_transformer_engine_spec, ModuleSpec)
    assert callable(BertModel) and callable(T5Model)
    for getter in (
        get_t5_encoder_with_local_block_spec,
        get_t5_decoder_with_local_block_spec,
        get_t5_encoder_with_transformer_engine_block_spec,
        get_t5_decoder_with_transformer_engine_block_spec,
    ):
        assert callable(getter)


def test_bert_t5_dataset_names_and_script_imports():
    from megatron.core.datasets.bert_dataset import (  # noqa: F401
        BERTMaskedWordPieceDataset,
        BERTMaskedWordPieceDatasetConfig,
    )
    from megatron.core.datasets.t5_dataset import (  # noqa: F401
        T5MaskedWordPieceDataset,
        T5MaskedWordPieceDatasetConfig,
    )

    for block in (PRETRAIN_BERT_R08_IMPORTS, PRETRAIN_T5_R08_IMPORTS):
        exec(compile(block, 'pretrain_r08_imports', 'exec'), {})
