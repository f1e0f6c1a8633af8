"""GLUE fine-tuning (MNLI, QQP), as in Megatron's tasks/glue/finetune.py."""

from megatron.core.enums import ModelType
from megatron.core.models.bert import bert_layer_specs
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.classification import Classification
from tasks.eval_utils import accuracy_func_provider
from tasks.finetune_utils import finetune


def glue_classification(num_classes, Dataset, name_from_datapath_func):
    """Fine-tune a BERT classifier on Dataset with num_classes labels."""

    def train_valid_datasets_provider():
        args = get_args()
        tokenizer = get_tokenizer()
        train_dataset = Dataset('training', args.train_data, tokenizer, args.seq_length)
        valid_dataset = Dataset('validation', args.valid_data, tokenizer, args.seq_length)
        return train_dataset, valid_dataset

    def model_provider(pre_process=True, post_process=True):
        args = get_args()
        print_rank_0('building classification model for {} ...'.format(args.task))
        return Classification(
            config=core_transformer_config_from_args(args),
            transformer_layer_spec=bert_layer_specs.bert_layer_local_spec,
            vocab_size=args.padded_vocab_size,
            max_sequence_length=args.max_position_embeddings,
            num_classes=num_classes,
            pre_process=pre_process,
            post_process=post_process,
        )

    def metrics_func_provider():
        def single_dataset_provider(datapath):
            args = get_args()
            tokenizer = get_tokenizer()
            name = name_from_datapath_func(datapath)
            return Dataset(name, [datapath], tokenizer, args.seq_length)

        return accuracy_func_provider(single_dataset_provider)

    return finetune(
        train_valid_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        end_of_epoch_callback_provider=metrics_func_provider,
    )


def display_name(datapath, task):
    """Megatron's name: after the last `task`, strip the characters . t s v, then '/', and
    '_' -> '-' (so dev_matched.tsv -> dev-matched, but test.tsv -> te)."""
    return datapath.split(task)[-1].strip('.tsv').strip('/').replace('_', '-')


def main():
    args = get_args()
    _check_data_args(args)
    if args.task == 'MNLI':
        from tasks.glue.mnli import MNLIDataset as Dataset

        num_classes = 3
    elif args.task == 'QQP':
        from tasks.glue.qqp import QQPDataset as Dataset

        num_classes = 2
    else:
        raise NotImplementedError('GLUE task {} is not implemented.'.format(args.task))
    return glue_classification(num_classes, Dataset, lambda p: display_name(p, args.task))


def _check_data_args(args):
    """--train-data (when training) and --valid-data files exist, before any work."""
    if args.epochs and not args.train_data:
        raise ValueError(f'--task {args.task} with --epochs {args.epochs} needs --train-data')
    if not args.valid_data:
        raise ValueError(f'--task {args.task} needs --valid-data')
    for path in (args.train_data or []) + list(args.valid_data):
        import os

        if not os.path.isfile(path):
            raise ValueError(f'{path}: no such file ({args.task} data)')
