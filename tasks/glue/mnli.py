"""MNLI dataset, as in Megatron's tasks/glue/mnli.py (label ids in alphabetical order)."""

from megatron.training.utils import print_rank_0
from tasks.data_utils import clean_text
from tasks.glue.data import GLUEAbstractDataset, read_tsv_rows

LABELS = {'contradiction': 0, 'entailment': 1, 'neutral': 2}


class MNLIDataset(GLUEAbstractDataset):
    """Columns: 0 uid, 8 sentence1, 9 sentence2, last gold_label; a 10-column header marks a
    test file (every label becomes test_label). A bad row raises a ValueError naming file and row
    before any training (Megatron asserts)."""

    def __init__(self, name, datapaths, tokenizer, max_seq_length, test_label='contradiction'):
        self.test_label = test_label
        super().__init__('MNLI', name, datapaths, tokenizer, max_seq_length)

    def process_samples_from_single_path(self, filename):
        print_rank_0(' > Processing {} ...'.format(filename))
        samples = []
        total = 0
        first = True
        is_test = False
        num_columns = None
        for row, cols in read_tsv_rows(filename):
            if first:
                first = False
                num_columns = len(cols)
                if num_columns == 10:
                    is_test = True
                    print_rank_0(
                        '   reading {}, {} and {} columns and setting labels to {}'.format(
                            cols[0].strip(), cols[8].strip(), cols[9].strip(), self.test_label
                        )
                    )
                else:
                    print_rank_0(
                        '    reading {} , {}, {}, and {} columns ...'.format(
                            cols[0].strip(), cols[8].strip(), cols[9].strip(), cols[-1].strip()
                        )
                    )
                continue
            if len(cols) != num_columns:
                raise ValueError(
                    f'{filename}: row {row}: {len(cols)} columns, the header has {num_columns}'
                )
            text_a = clean_text(cols[8].strip())
            text_b = clean_text(cols[9].strip())
            label = self.test_label if is_test else cols[-1].strip()
            try:
                unique_id = int(cols[0].strip())
            except ValueError:
                raise ValueError(
                    f'{filename}: row {row}: uid {cols[0]!r} is not an integer'
                ) from None
            if unique_id < 0 or not text_a or not text_b:
                raise ValueError(f'{filename}: row {row}: negative uid or empty sentence')
            if label not in LABELS:
                raise ValueError(
                    f'{filename}: row {row}: unknown label {label!r} '
                    f'(expected one of {sorted(LABELS)})'
                )
            samples.append(
                {'text_a': text_a, 'text_b': text_b, 'label': LABELS[label], 'uid': unique_id}
            )
            total += 1
            if total % 50000 == 0:
                print_rank_0('  > processed {} so far ...'.format(total))
        print_rank_0(' >> processed {} samples.'.format(len(samples)))
        return samples
