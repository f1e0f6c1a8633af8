"""Golden-value cases: tests/functional_tests/test_cases/<model>/<case>/{model_config.yaml,
golden_values.json}. The JSON follows Megatron's layout: metric -> {"start_step", "end_step",
"step_interval", "values": {"<step>": value}} with values rounded to 5 decimals. <model> (gpt, bert,
t5) picks the pretrain script and the preprocessed data (see MODELS)."""

import glob
import os

import yaml

from tests.functional_tests.bert_utils import prepare_bert_data, run_bert_pretrain
from tests.functional_tests.gpt_utils import prepare_data, run_pretrain
from tests.functional_tests.t5_utils import prepare_t5_data, run_pretrain_t5
from tests.unit_tests.dist_utils import run_distributed

CASES_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'test_cases')

#: Per model folder: (worker running pretrain on one rank, data preparation, pytest data fixture).
MODELS = {
    'gpt': (run_pretrain, prepare_data, 'gpt_data_prefix'),
    'bert': (run_bert_pretrain, prepare_bert_data, 'bert_data_prefix'),
    't5': (run_pretrain_t5, prepare_t5_data, 't5_data_prefix'),
}


def model_of(case):
    """'t5/t5_tiny_tp2_pp2_split1' -> 't5'."""
    return case.split('/')[0]


def list_cases():
    """Case directories (relative names like 'gpt/gpt_tiny_tp2_pp2')."""
    paths = sorted(glob.glob(os.path.join(CASES_DIR, '*', '*', 'model_config.yaml')))
    return [os.path.relpath(os.path.dirname(p), CASES_DIR) for p in paths]


def load_case(case):
    with open(os.path.join(CASES_DIR, case, 'model_config.yaml')) as f:
        return yaml.safe_load(f)


def flags_from_config(config):
    flags = []
    for key, value in config['MODEL_ARGS'].items():
        if value is True:
            flags.append(key)
        elif value is not False and value is not None:
            flags.extend([key, str(value)])
    return flags


def run_case(case, data_prefix, cache_dir):
    """Run a case; returns {metric: {step: value}} from the last rank."""
    config = load_case(case)
    args = config['MODEL_ARGS']
    tp = int(args.get('--tensor-model-parallel-size', 1))
    pp = int(args.get('--pipeline-model-parallel-size', 1))
    split = args.get('--pipeline-model-parallel-split-rank')
    extra = flags_from_config(config) + ['--data-path', data_prefix, '--data-cache-path', cache_dir]
    runner = MODELS[model_of(case)][0]
    result = run_distributed(
        runner,
        world_size=config['WORLD_SIZE'],
        tp=tp,
        pp=pp,
        split_rank=None if split is None else int(split),
        args=(extra,),
        timeout=600,
    )[-1]
    metrics = {}
    for metric in config['METRICS']:
        metrics[metric] = {
            step: losses[metric] for step, losses in sorted(result['train_losses'].items())
        }
    return metrics


def to_golden_json(metrics):
    out = {}
    for metric, values in metrics.items():
        steps = sorted(values)
        out[metric] = {
            'start_step': steps[0],
            'end_step': steps[-1],
            'step_interval': 1,
            'values': {str(s): round(float(values[s]), 5) for s in steps},
        }
    return out
