"""RACE dataset, as in Megatron's tasks/race/data.py: 4-way multiple choice, one JSON document
per line of every *.txt file directly inside each data directory."""

import glob
import json
import os

from megatron.training.utils import print_rank_0
from tasks.data_utils import build_sample, build_tokens_types_paddings_from_ids, clean_text

NUM_CHOICES = 4
MAX_QA_LENGTH = 128


class RaceDataset:
    """Items hold [4, seq] text/types/padding_mask (one row per option), label 0..3 and a uid
    that restarts at 0 for every data directory; sample_multiplier = 4."""

    def __init__(
        self, dataset_name, datapaths, tokenizer, max_seq_length, max_qa_length=MAX_QA_LENGTH
    ):
        self.dataset_name = dataset_name
        print_rank_0(' > building RACE dataset for {}:'.format(self.dataset_name))
        string = '  > paths:'
        for path in datapaths:
            string += ' ' + path
        print_rank_0(string)
        self.samples = []
        for datapath in datapaths:
            self.samples.extend(
                process_single_datapath(datapath, tokenizer, max_qa_length, max_seq_length)
            )
        print_rank_0('  >> total number of samples: {}'.format(len(self.samples)))
        self.sample_multiplier = NUM_CHOICES

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, idx):
        return self.samples[idx]


def _check_document(filename, row, data):
    """One-line ValueError naming file and row for a malformed document."""
    keys = ('article', 'questions', 'options', 'answers')
    if not isinstance(data, dict) or any(k not in data for k in keys):
        raise ValueError(f'{filename}: row {row}: needs keys {list(keys)}')
    n = len(data['questions'])
    if len(data['options']) != n or len(data['answers']) != n:
        raise ValueError(
            f'{filename}: row {row}: {n} questions but {len(data["options"])} option '
            f'lists and {len(data["answers"])} answers'
        )
    for options, answer in zip(data['options'], data['answers']):
        if len(options) != NUM_CHOICES:
            raise ValueError(f'{filename}: row {row}: {len(options)} options, expected 4')
        if answer not in ('A', 'B', 'C', 'D'):
            raise ValueError(f'{filename}: row {row}: unknown answer {answer!r} (A-D)')


def process_single_datapath(datapath, tokenizer, max_qa_length, max_seq_length):
    """Samples of every *.txt in the directory datapath."""
    print_rank_0('   > working on {}'.format(datapath))
    if not os.path.isdir(datapath):
        raise ValueError(f'{datapath}: no such directory (RACE data is a directory of *.txt)')
    filenames = glob.glob(os.path.join(datapath, '*.txt'))
    samples = []
    num_docs = 0
    num_questions = 0
    num_samples = 0
    for filename in filenames:
        with open(filename, 'r', encoding='utf-8') as f:
            for row, line in enumerate(f, start=1):
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ValueError(f'{filename}: row {row}: not JSON ({exc.msg})') from None
                _check_document(filename, row, data)
                num_docs += 1
                context = clean_text(data['article'])
                context_ids = tokenizer.tokenize(context)
                for qi, question in enumerate(data['questions']):
                    num_questions += 1
                    label = ord(data['answers'][qi]) - ord('A')
                    ids_list, types_list, paddings_list = [], [], []
                    for option in data['options'][qi]:
                        if '_' in question:
                            qa = question.replace('_', option)
                        else:
                            qa = ' '.join([question, option])
                        qa_ids = tokenizer.tokenize(clean_text(qa))[:max_qa_length]
                        ids, types, paddings = build_tokens_types_paddings_from_ids(
                            qa_ids,
                            context_ids,
                            max_seq_length,
                            tokenizer.cls,
                            tokenizer.sep,
                            tokenizer.pad,
                        )
                        ids_list.append(ids)
                        types_list.append(types)
                        paddings_list.append(paddings)
                    samples.append(
                        build_sample(ids_list, types_list, paddings_list, label, num_samples)
                    )
                    num_samples += 1
    print_rank_0(
        '    > processed {} document, {} questions, and {} samples'.format(
            num_docs, num_questions, num_samples
        )
    )
    return samples
