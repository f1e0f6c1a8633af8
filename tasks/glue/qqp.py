"""QQP dataset, as in Megatron's tasks/glue/qqp.py: malformed rows are skipped with a warning."""

from megatron.training.utils import print_rank_0
from tasks.data_utils import clean_text
from tasks.glue.data import GLUEAbstractDataset, read_tsv_rows

LABELS = [0, 1]


class QQPDataset(GLUEAbstractDataset):
    """Train/dev: 6 columns (uid, qid1, qid2, question1, question2, is_duplicate); test: 3
    columns (uid, question1, question2) with labels set to test_label."""

    def __init__(self, name, datapaths, tokenizer, max_seq_length, test_label=0):
        self.test_label = test_label
        super().__init__('QQP', name, datapaths, tokenizer, max_seq_length)

    def process_samples_from_single_path(self, filename):
        print_rank_0(' > Processing {} ...'.format(filename))
        samples = []
        first = True
        is_test = False
        for row, cols in read_tsv_rows(filename):
            if first:
                first = False
                if len(cols) == 3:
                    is_test = True
                elif len(cols) != 6:
                    raise ValueError(
                        f'{filename}: row {row}: header has {len(cols)} columns, '
                        f'expected 6 (train/dev) or 3 (test)'
                    )
                continue
            if is_test:
                if len(cols) != 3:
                    raise ValueError(f'{filename}: row {row}: {len(cols)} columns, expected 3')
                uid, text_a, text_b, label = int(cols[0]), cols[1], cols[2], self.test_label
            else:
                if len(cols) != 6:
                    print_rank_0(
                        '***WARNING*** {}: row {}: {} columns, skipping'.format(
                            filename, row, len(cols)
                        )
                    )
                    continue
                uid, text_a, text_b = int(cols[0]), cols[3], cols[4]
                try:
                    label = int(cols[5])
                except ValueError:
                    raise ValueError(
                        f'{filename}: row {row}: label {cols[5]!r} is not 0 or 1'
                    ) from None
            text_a, text_b = clean_text(text_a.strip()), clean_text(text_b.strip())
            if not text_a or not text_b:
                print_rank_0(
                    '***WARNING*** {}: row {}: empty question, skipping'.format(filename, row)
                )
                continue
            if label not in LABELS:
                raise ValueError(
                    f'{filename}: row {row}: unknown label {label!r} (expected 0 or 1)'
                )
            samples.append({'text_a': text_a, 'text_b': text_b, 'label': label, 'uid': uid})
        print_rank_0(' >> processed {} samples.'.format(len(samples)))
        return samples
