"""training.py and checkpointing.py were split by concern; their names stay importable from them.

Megatron scripts import from `megatron.training.training` (get_model, train_step, training_log,
evaluate_and_print_results, build_train_valid_test_data_iterators, ...) and from
`megatron.training.checkpointing` (save_checkpoint, load_checkpoint, get_checkpoint_name, ...).
The names are listed literally: a name dropped from a re-export fails here, not in a user's script.
Also checks the code guideline: every file in megatron/training stays under 1,000 lines.
"""

import importlib
import os

import pytest

import megatron.training

# Every public name defined in megatron/training/training.py before the split (plus
# num_floating_point_operations, which its __all__ re-exports from utils.py).
TRAINING_NAMES = [
    'pretrain',
    'update_train_iters',
    'get_model',
    'get_optimizer_param_scheduler',
    'setup_model_and_optimizer',
    'train_step',
    'format_log_line',
    'training_log',
    'save_checkpoint_and_time',
    'train',
    'evaluate',
    'format_validation_line',
    'evaluate_and_print_results',
    'cyclic_iter',
    'get_train_valid_test_num_samples',
    'build_train_valid_test_datasets',
    'build_train_valid_test_data_loaders',
    'build_train_valid_test_data_iterators',
    'stimer',
    'num_floating_point_operations',
]

# Where the moved names live now; megatron.training.training must hand out the same objects.
MOVED = {
    'megatron.training.logging.training_log': [
        '_TIMERS_TO_LOG',
        '_format_tflops',
        'format_log_line',
        'training_log',
    ],
    'megatron.training.loop.evaluation': [
        'evaluate',
        'format_validation_line',
        'evaluate_and_print_results',
    ],
    'megatron.training.datasets.data_loaders': [
        'cyclic_iter',
        'get_train_valid_test_num_samples',
        'build_train_valid_test_datasets',
        'build_train_valid_test_data_loaders',
        '_check_training_data',
        'build_train_valid_test_data_iterators',
    ],
    'megatron.training.run_control.time_limit': ['_exit_flag'],
}

# Every public name defined in megatron/training/checkpointing.py before the split.
CHECKPOINTING_NAMES = [
    'CHECKPOINT_VERSION',
    'TRACKER_FILENAME',
    'MODEL_CHECKPOINT_BASENAME',
    'DISTRIB_OPTIM_BASENAME',
    'SAFE_GLOBALS',
    'set_checkpoint_version',
    'get_checkpoint_version',
    'print_rank_0',
    'ensure_directory_exists',
    'get_checkpoint_name',
    'get_distributed_optimizer_checkpoint_name',
    'find_checkpoint_rank_0',
    'get_checkpoint_tracker_filename',
    'checkpoint_exists',
    'read_metadata',
    'get_rng_state',
    'generate_state_dict',
    'save_checkpoint',
    'check_checkpoint_args',
    'load_args_from_checkpoint',
    'load_checkpoint',
]

CHECKPOINT_LAYOUT_NAMES = [
    'TRACKER_FILENAME',
    'MODEL_CHECKPOINT_BASENAME',
    'DISTRIB_OPTIM_BASENAME',
    'ensure_directory_exists',
    'get_checkpoint_name',
    'get_distributed_optimizer_checkpoint_name',
    'find_checkpoint_rank_0',
    'get_checkpoint_tracker_filename',
    'checkpoint_exists',
    '_parse_tracker',
    'read_metadata',
]

MAX_LINES = 1000


def test_training_names_importable():
    from megatron.training.training import (
        build_train_valid_test_data_iterators,
        build_train_valid_test_data_loaders,
        build_train_valid_test_datasets,
        cyclic_iter,
        evaluate,
        evaluate_and_print_results,
        format_log_line,
        format_validation_line,
        get_model,
        get_optimizer_param_scheduler,
        get_train_valid_test_num_samples,
        num_floating_point_operations,
        pretrain,
        save_checkpoint_and_time,
        setup_model_and_optimizer,
        stimer,
        train,
        train_step,
        training_log,
        update_train_iters,
    )

    imported = {
        'pretrain': pretrain,
        'update_train_iters': update_train_iters,
        'get_model': get_model,
        'get_optimizer_param_scheduler': get_optimizer_param_scheduler,
        'setup_model_and_optimizer': setup_model_and_optimizer,
        'train_step': train_step,
        'format_log_line': format_log_line,
        'training_log': training_log,
        'save_checkpoint_and_time': save_checkpoint_and_time,
        'train': train,
        'evaluate': evaluate,
        'format_validation_line': format_validation_line,
        'evaluate_and_print_results': evaluate_and_print_results,
        'cyclic_iter': cyclic_iter,
        'get_train_valid_test_num_samples': get_train_valid_test_num_samples,
        'build_train_valid_test_datasets': build_train_valid_test_datasets,
        'build_train_valid_test_data_loaders': build_train_valid_test_data_loaders,
        'build_train_valid_test_data_iterators': build_train_valid_test_data_iterators,
        'stimer': stimer,
        'num_floating_point_operations': num_floating_point_operations,
    }
    assert sorted(imported) == sorted(TRAINING_NAMES)
    for name, value in imported.items():
        assert callable(value), name


def test_training_all_importable():
    training = importlib.import_module('megatron.training.training')
    namespace = {}
    exec('from megatron.training.training import *', namespace)
    assert set(training.__all__) <= set(namespace)
    assert set(training.__all__) <= set(TRAINING_NAMES)


@pytest.mark.parametrize('module_name', sorted(MOVED))
def test_moved_names_are_the_same_objects(module_name):
    training = importlib.import_module('megatron.training.training')
    module = importlib.import_module(module_name)
    for name in MOVED[module_name]:
        assert getattr(training, name) is getattr(module, name), name


def test_train_start_time_reads_through():
    from megatron.training.run_control import time_limit
    from megatron.training.training import _TRAIN_START_TIME

    assert _TRAIN_START_TIME == time_limit.get_train_start_time()


def test_checkpointing_names_importable():
    from megatron.training.checkpointing import (
        CHECKPOINT_VERSION,
        DISTRIB_OPTIM_BASENAME,
        MODEL_CHECKPOINT_BASENAME,
        SAFE_GLOBALS,
        TRACKER_FILENAME,
        check_checkpoint_args,
        checkpoint_exists,
        ensure_directory_exists,
        find_checkpoint_rank_0,
        generate_state_dict,
        get_checkpoint_name,
        get_checkpoint_tracker_filename,
        get_checkpoint_version,
        get_distributed_optimizer_checkpoint_name,
        get_rng_state,
        load_args_from_checkpoint,
        load_checkpoint,
        print_rank_0,
        read_metadata,
        save_checkpoint,
        set_checkpoint_version,
    )

    imported = {
        'CHECKPOINT_VERSION': CHECKPOINT_VERSION,
        'TRACKER_FILENAME': TRACKER_FILENAME,
        'MODEL_CHECKPOINT_BASENAME': MODEL_CHECKPOINT_BASENAME,
        'DISTRIB_OPTIM_BASENAME': DISTRIB_OPTIM_BASENAME,
        'SAFE_GLOBALS': SAFE_GLOBALS,
        'set_checkpoint_version': set_checkpoint_version,
        'get_checkpoint_version': get_checkpoint_version,
        'print_rank_0': print_rank_0,
        'ensure_directory_exists': ensure_directory_exists,
        'get_checkpoint_name': get_checkpoint_name,
        'get_distributed_optimizer_checkpoint_name': get_distributed_optimizer_checkpoint_name,
        'find_checkpoint_rank_0': find_checkpoint_rank_0,
        'get_checkpoint_tracker_filename': get_checkpoint_tracker_filename,
        'checkpoint_exists': checkpoint_exists,
        'read_metadata': read_metadata,
        'get_rng_state': get_rng_state,
        'generate_state_dict': generate_state_dict,
        'save_checkpoint': save_checkpoint,
        'check_checkpoint_args': check_checkpoint_args,
        'load_args_from_checkpoint': load_args_from_checkpoint,
        'load_checkpoint': load_checkpoint,
    }
    assert sorted(imported) == sorted(CHECKPOINTING_NAMES)
    assert CHECKPOINT_VERSION == 3.0
    assert TRACKER_FILENAME == 'latest_checkpointed_iteration.txt'
    assert MODEL_CHECKPOINT_BASENAME == 'model_optim_rng.pt'
    assert DISTRIB_OPTIM_BASENAME == 'distrib_optim.pt'
    assert SAFE_GLOBALS
    for name, value in imported.items():
        if name.islower():
            assert callable(value), name


def test_checkpoint_layout_names_are_the_same_objects():
    checkpointing = importlib.import_module('megatron.training.checkpointing')
    layout = importlib.import_module('megatron.training.checkpoint.checkpoint_layout')
    for name in CHECKPOINT_LAYOUT_NAMES:
        assert getattr(checkpointing, name) is getattr(layout, name), name


def test_training_files_under_line_limit():
    root = os.path.dirname(megatron.training.__file__)
    too_long = {}
    for directory, _, files in os.walk(root):
        for filename in files:
            if filename.endswith('.py'):
                path = os.path.join(directory, filename)
                with open(path, encoding='utf-8') as f:
                    lines = sum(1 for _ in f)
                if lines >= MAX_LINES:
                    too_long[os.path.relpath(path, root)] = lines
    assert too_long == {}, f'files in megatron/training with {MAX_LINES}+ lines: {too_long}'
