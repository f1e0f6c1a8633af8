"""Fast checks of the names the r0.8 contract scripts (tests/functional_tests/r08_contract/) use.

The functional test trains through those scripts; this one fails in a second when a name they
import disappears, a keyword they pass leaves a signature, or an `args.<attr>` they read is no
longer produced by the parser, so a removed piece of Megatron's entry-script surface is named
directly instead of surfacing as a traceback inside a spawned rank.
"""

import ast
import importlib
import inspect
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CONTRACT_DIR = os.path.join(REPO, 'tests', 'functional_tests', 'r08_contract')
SCRIPTS = ['gpt.py', 'bert.py', 't5.py']

# Every args attribute r0.8's three scripts read, per script (Megatron core_r0.8.0).
R08_ARGS = {
    'gpt.py': {
        'transformer_impl', 'yaml_cfg', 'use_legacy_models', 'spec', 'num_experts',
        'moe_grouped_gemm', 'qk_layernorm', 'padded_vocab_size', 'max_position_embeddings',
        'fp16_lm_cross_entropy', 'untie_embeddings_and_output_weights', 'position_embedding_type',
        'rotary_percent', 'rotary_base', 'context_parallel_size',
        'check_for_nan_in_loss_and_grad', 'seed', 'seq_length', 'data_path', 'train_data_path',
        'valid_data_path', 'test_data_path', 'split', 'num_dataset_builder_threads',
        'data_cache_path', 'mmap_bin_files', 'reset_position_ids', 'reset_attention_mask',
        'eod_mask_loss', 'create_attention_mask_in_dataloader', 's3_cache_path', 'mock_data',
    },
    'bert.py': {
        'bert_binary_head', 'use_legacy_models', 'spec', 'padded_vocab_size',
        'max_position_embeddings', 'untie_embeddings_and_output_weights', 'seed', 'seq_length',
        'data_path', 'train_data_path', 'valid_data_path', 'test_data_path', 'split',
        'data_cache_path', 'mask_prob', 'short_seq_prob',
    },
    't5.py': {
        'use_legacy_models', 'transformer_impl', 'encoder_num_layers', 'decoder_num_layers',
        'padded_vocab_size', 'max_position_embeddings', 'fp16_lm_cross_entropy',
        'untie_embeddings_and_output_weights', 'position_embedding_type', 'rotary_percent',
        'seed', 'encoder_seq_length', 'decoder_seq_length', 'data_path', 'train_data_path',
        'valid_data_path', 'test_data_path', 'split', 'data_cache_path', 'mask_prob',
        'short_seq_prob',
    },
}  # fmt: skip


def _tree(script):
    with open(os.path.join(CONTRACT_DIR, script)) as f:
        return ast.parse(f.read())


def _imported_names(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module.startswith('megatron'):
            for alias in node.names:
                yield node.module, alias.name, alias.asname or alias.name
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith('megatron'):
                    yield alias.name, None, None


def _args_read(tree):
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == 'args'
    }


def _keyword_calls(tree):
    """(callee name, keywords) of every call by a bare name that passes keywords."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.keywords and isinstance(node.func, ast.Name):
            yield node.func.id, {k.arg for k in node.keywords if k.arg is not None}


@pytest.mark.parametrize('script', SCRIPTS)
def test_every_imported_name_exists(script):
    for module_name, name, _ in _imported_names(_tree(script)):
        module = importlib.import_module(module_name)
        if name is not None and not hasattr(module, name):
            importlib.import_module(f'{module_name}.{name}')  # a submodule, else ImportError


@pytest.mark.parametrize('script', SCRIPTS)
def test_contract_scripts_read_exactly_the_r08_args(script):
    from megatron.training.arguments import parse_args

    read = _args_read(_tree(script))
    assert read == R08_ARGS[script], sorted(read ^ R08_ARGS[script])
    args = parse_args(args_list=[])
    # padded_vocab_size appears while the tokenizer is built, not at parse time.
    missing = sorted(a for a in read - {'padded_vocab_size'} if not hasattr(args, a))
    assert not missing, f'the parser no longer produces {missing}'


@pytest.mark.parametrize('script', SCRIPTS)
def test_keywords_passed_are_in_the_signatures(script):
    tree = _tree(script)
    namespace = {}
    for module_name, name, bound in _imported_names(tree):
        if name is not None:
            namespace[bound] = getattr(importlib.import_module(module_name), name)
    checked = 0
    for callee, keywords in _keyword_calls(tree):
        target = namespace.get(callee)
        # The legacy placeholders take anything: only the real constructors are checked.
        if callee == 'LegacyT5Model' or not (inspect.isclass(target) or inspect.isfunction(target)):
            continue
        params = inspect.signature(target).parameters
        missing = keywords - set(params)
        assert not missing, f'{callee} no longer takes {sorted(missing)}'
        checked += 1
    assert checked >= 3  # model constructor, dataset config, pretrain at least
