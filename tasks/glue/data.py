"""GLUE dataset base, as in Megatron's tasks/glue/data.py: parse TSV rows into raw samples,
build the pair layout lazily per item."""

import os

from megatron.training.utils import print_rank_0
from tasks.data_utils import build_sample, build_tokens_types_paddings_from_text


class GLUEAbstractDataset:
    """Samples {text_a, text_b, label, uid} from every path; items are built on access.

    Subclasses implement process_samples_from_single_path(path).
    """

    def __init__(self, task_name, dataset_name, datapaths, tokenizer, max_seq_length):
        self.task_name = task_name
        self.dataset_name = dataset_name
        self.tokenizer = tokenizer
        self.max_seq_length = max_seq_length
        print_rank_0(' > building {} dataset for {}:'.format(self.task_name, self.dataset_name))
        string = '  > paths:'
        for path in datapaths:
            string += ' ' + path
        print_rank_0(string)
        self.samples = []
        for datapath in datapaths:
            if not os.path.isfile(datapath):
                raise ValueError(f'{datapath}: no such file ({task_name} data)')
            self.samples.extend(self.process_samples_from_single_path(datapath))
        print_rank_0('  >> total number of samples: {}'.format(len(self.samples)))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        raw_sample = self.samples[idx]
        ids, types, paddings = build_tokens_types_paddings_from_text(
            raw_sample['text_a'], raw_sample['text_b'], self.tokenizer, self.max_seq_length
        )
        return build_sample(ids, types, paddings, raw_sample['label'], raw_sample['uid'])

    def process_samples_from_single_path(self, datapath):
        raise NotImplementedError


def read_tsv_rows(path):
    """(row number, columns) of every line: stripped and split on TAB (no CSV quoting)."""
    with open(path, 'r', encoding='utf-8') as f:
        for row, line in enumerate(f, start=1):
            yield row, line.strip().split('\t')
