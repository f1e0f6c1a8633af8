"""Downstream tasks: `python tasks/main.py --task NAME ...`, as in Megatron's tasks/main.py.

Zero-shot GPT: LAMBADA, WIKITEXT103. BERT fine-tuning: MNLI, QQP (classification), RACE
(multiple choice). The task name is checked before Megatron is initialized, so a typo costs one
line and no start-up time.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir)))

from megatron.training.global_vars import get_args  # noqa: E402
from megatron.training.initialize import initialize_megatron  # noqa: E402
from megatron.training.run_control.errors import run_main  # noqa: E402
from megatron.training.validation.context_parallel_checks import refuse_context_parallel  # noqa: E402

#: Task name -> (module, the tokenizer Megatron's README uses for it).
TASKS = {
    'RACE': ('tasks.race.finetune', 'BertWordPieceLowerCase'),
    'MNLI': ('tasks.glue.finetune', 'BertWordPieceLowerCase'),
    'QQP': ('tasks.glue.finetune', 'BertWordPieceLowerCase'),
    'LAMBADA': ('tasks.zeroshot_gpt.evaluate', 'GPT2BPETokenizer'),
    'WIKITEXT103': ('tasks.zeroshot_gpt.evaluate', 'GPT2BPETokenizer'),
}
#: Tasks of Megatron's registry that this package does not implement (retrieval QA).
NOT_IMPLEMENTED = ('ICT-ZEROSHOT-NQ', 'RETRIEVER-EVAL', 'RET-FINETUNE-NQ')


def get_tasks_args(parser):
    """The "tasks" argument group (--pretrained-checkpoint is a core checkpointing flag)."""
    group = parser.add_argument_group(title='tasks')
    group.add_argument(
        '--task',
        type=str,
        required=True,
        help='Which task to run (e.g. LAMBADA, WIKITEXT103, MNLI, RACE).',
    )
    group.add_argument(
        '--epochs',
        type=int,
        default=None,
        help='Passes over the training data when fine-tuning; 0 only evaluates.',
    )
    group.add_argument(
        '--keep-last',
        action='store_true',
        help='Also use the final, possibly smaller, batch of each epoch.',
    )
    group.add_argument(
        '--train-data',
        nargs='+',
        default=None,
        help='Training data: one or more paths (or corpus names), separated by spaces.',
    )
    group.add_argument(
        '--valid-data', nargs='*', default=None, help='Validation data: one or more paths.'
    )
    group.add_argument(
        '--overlapping-eval',
        type=int,
        default=32,
        help='Stride of the overlapping evaluation windows, in tokens.',
    )
    group.add_argument(
        '--strict-lambada',
        action='store_true',
        help='Score LAMBADA the strict way (the whole last word must be predicted).',
    )
    group.add_argument(
        '--random-weights',
        action='store_true',
        help='Evaluate randomly initialized weights (a baseline). Without it, a task that only '
        'evaluates (the zero-shot tasks, or --epochs 0) needs a checkpoint in --load (or '
        '--pretrained-checkpoint).',
    )
    # Retriever args (parsed for command-line compatibility; the retrieval tasks are not built).
    group.add_argument(
        '--qa-data-dev', type=str, default=None, help='Question-answering dev set file.'
    )
    group.add_argument(
        '--qa-data-test', type=str, default=None, help='Question-answering test set file.'
    )
    group.add_argument(
        '--faiss-use-gpu',
        action='store_true',
        help='Build the FAISS inner-product index on the GPU.',
    )
    group.add_argument(
        '--faiss-match',
        type=str,
        default='string',
        choices=['regex', 'string'],
        help='How a retrieved passage is judged to contain the answer.',
    )
    group.add_argument(
        '--faiss-topk-retrievals',
        type=int,
        default=100,
        help='Passages retrieved per question (top-k).',
    )
    group.add_argument(
        '--eval-micro-batch-size',
        type=int,
        default=None,
        help='Evaluation micro-batch size per model replica.',
    )
    group.add_argument(
        '--train-with-neg',
        action='store_true',
        help='Train with negative passages as well.',
    )
    group.add_argument(
        '--train-hard-neg',
        type=int,
        default=0,
        help='Hard negative passages per question in training.',
    )
    group.add_argument(
        '--val-av-rank-hard-neg',
        type=int,
        default=30,
        help='Average-rank validation: hard negatives drawn from each question\'s pool.',
    )
    group.add_argument(
        '--val-av-rank-other-neg',
        type=int,
        default=30,
        help='Average-rank validation: other negatives drawn from each question\'s pool.',
    )
    return parser


def task_name(args_list=None):
    """The --task value, checked against the registry before any start-up work."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument('--task', type=str, default=None)
    known, _ = parser.parse_known_args(args_list)
    if known.task is None:
        raise ValueError('--task is required (one of ' + ', '.join(TASKS) + ')')
    if known.task in NOT_IMPLEMENTED:
        raise ValueError(
            f'--task {known.task}: retrieval tasks are not implemented in this package'
        )
    if known.task not in TASKS:
        raise ValueError(
            f'--task {known.task}: Task {known.task} is not implemented (known: {", ".join(TASKS)})'
        )
    return known.task


#: Zero-shot tasks: they only evaluate.
ZERO_SHOT = ('LAMBADA', 'WIKITEXT103')


def check_weights_to_evaluate(task, args_list=None):
    """A task that only evaluates reports its number on the checkpoint it is given: refuse to
    run on random weights unless --random-weights asks for them (before any start-up work).

    Raises:
        ValueError: naming the flag and the directory.
    """
    from megatron.training.checkpoint.checkpoint_layout import checkpoint_exists

    parser = argparse.ArgumentParser(add_help=False)
    for flag in ('--load', '--pretrained-checkpoint'):
        parser.add_argument(flag, type=str, default=None)
    parser.add_argument('--epochs', type=int, default=None)
    parser.add_argument('--random-weights', action='store_true')
    known, _ = parser.parse_known_args(args_list)
    evaluation_only = task in ZERO_SHOT or known.epochs == 0
    if not evaluation_only or known.random_weights:
        return
    sources = [('--load', known.load)]
    if task not in ZERO_SHOT:  # fine-tuning also starts from --pretrained-checkpoint
        sources.append(('--pretrained-checkpoint', known.pretrained_checkpoint))
    given = [(flag, path) for flag, path in sources if path is not None]
    if any(checkpoint_exists(d) for _, d in given):
        return
    if given:
        where = ' and '.join(f'{f} {d}' for f, d in given)
        raise ValueError(
            f'--task {task} evaluates a model, but {where} holds no checkpoint (no '
            f'latest_checkpointed_iteration.txt); give the checkpoint to evaluate, or pass '
            f'--random-weights to evaluate random weights'
        )
    raise ValueError(
        f'--task {task} evaluates a model, but no checkpoint is given: pass it with --load, or '
        f'--random-weights to evaluate random weights'
    )


def main(args_list=None):
    """Initialize Megatron with the tasks flags and run the task; returns the task's result."""
    import importlib

    task = task_name(args_list)
    check_weights_to_evaluate(task, args_list)
    module_name, tokenizer_type = TASKS[task]
    initialize_megatron(
        extra_args_provider=get_tasks_args,
        args_defaults={'tokenizer_type': tokenizer_type},
        args_list=args_list,
    )
    args = get_args()
    if args.num_layers_per_virtual_pipeline_stage is not None:
        raise ValueError(
            '--num-layers-per-virtual-pipeline-stage: the interleaved schedule is not '
            'supported for downstream tasks'
        )
    refuse_context_parallel(args, 'downstream task evaluation (tasks/main.py)')
    return importlib.import_module(module_name).main()


if __name__ == '__main__':
    run_main(main)
