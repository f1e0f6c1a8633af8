"""RACE fine-tuning, as in Megatron's tasks/race/finetune.py."""

from megatron.core.enums import ModelType
from megatron.core.models.bert import bert_layer_specs
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import print_rank_0
from tasks.classification import MultipleChoice
from tasks.eval_utils import accuracy_func_provider
from tasks.finetune_utils import finetune
from tasks.race.data import RaceDataset


def train_valid_datasets_provider():
    args = get_args()
    tokenizer = get_tokenizer()
    train_dataset = RaceDataset('training', args.train_data, tokenizer, args.seq_length)
    valid_dataset = RaceDataset('validation', args.valid_data, tokenizer, args.seq_length)
    return train_dataset, valid_dataset


def model_provider(pre_process=True, post_process=True):
    args = get_args()
    print_rank_0('building multichoice model for RACE ...')
    return MultipleChoice(
        config=core_transformer_config_from_args(args),
        transformer_layer_spec=bert_layer_specs.bert_layer_local_spec,
        vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
    )


def display_name(datapath):
    """The path after the last 'RACE', '/' stripped, inner '/' -> '-' (dev/middle -> dev-middle)."""
    return datapath.split('RACE')[-1].strip('/').replace('/', '-')


def metrics_func_provider():
    def single_dataset_provider(datapath):
        args = get_args()
        return RaceDataset(display_name(datapath), [datapath], get_tokenizer(), args.seq_length)

    return accuracy_func_provider(single_dataset_provider)


def main():
    args = get_args()
    if args.epochs and not args.train_data:
        raise ValueError(f'--task RACE with --epochs {args.epochs} needs --train-data')
    if not args.valid_data:
        raise ValueError('--task RACE needs --valid-data')
    return finetune(
        train_valid_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        end_of_epoch_callback_provider=metrics_func_provider,
    )
