"""Build small task files in the exact layouts Megatron's tasks/ read, from the bundled corpora.

    python tasks/make_fixture_data.py --output-dir /tmp/task_data

Writes (deterministically, from data/corpus/{mobydick,fortunes,austen_emma_excerpt}.jsonl):

- MNLI/train.tsv (12 columns), MNLI/dev_matched.tsv (16 columns), MNLI/test_matched.tsv (10):
  a 3-way task whose label says which book both passages come from (contradiction = Moby Dick,
  entailment = fortunes, neutral = Emma).
- QQP/train.tsv, QQP/dev.tsv (6 columns), QQP/test.tsv (3): label 1 when both passages come from
  the same book.
- RACE/train/middle/*.txt, RACE/dev/middle/*.txt: one JSON document per line; each question asks
  which of 4 passages follows the article; the distractors come from the other books.
- lambada_test.jsonl: {"text": ...} passages whose target is the last word.
- wiki.test.tokens: a WikiText-103-layout article (word-level tokens, " @-@ ", " @,@ ", " @.@ ",
  " = = heading = = " lines).

These files test the code paths (formats, metrics, training loop), not language ability: the
labels are about which book a passage comes from, not about entailment or reading comprehension.
"""

import argparse
import json
import os
import random
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOKS = ('mobydick', 'fortunes', 'austen_emma_excerpt')
MNLI_LABELS = ('contradiction', 'entailment', 'neutral')  # book 0, 1, 2
MNLI_TRAIN_HEADER = [
    'index',
    'promptID',
    'pairID',
    'genre',
    'sentence1_binary_parse',
    'sentence2_binary_parse',
    'sentence1_parse',
    'sentence2_parse',
    'sentence1',
    'sentence2',
    'label1',
    'gold_label',
]
MNLI_DEV_HEADER = MNLI_TRAIN_HEADER[:11] + ['label2', 'label3', 'label4', 'label5', 'gold_label']
MNLI_TEST_HEADER = MNLI_TRAIN_HEADER[:10]
QQP_HEADER = ['id', 'qid1', 'qid2', 'question1', 'question2', 'is_duplicate']
QQP_TEST_HEADER = ['id', 'question1', 'question2']


def read_passages(name, words=24):
    """Passages of about `words` words (whitespace collapsed) from one bundled corpus, in order."""
    passages = []
    with open(os.path.join(REPO, 'data', 'corpus', name + '.jsonl'), encoding='utf-8') as f:
        for line in f:
            tokens = json.loads(line)['text'].replace('\ufeff', '').replace('\t', ' ').split()
            for i in range(0, len(tokens) - words + 1, words):
                passages.append(' '.join(tokens[i : i + words]))
    return passages


def _write_tsv(path, header, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, 'w', encoding='utf-8') as f:
        f.write('\t'.join(header) + '\n')
        for row in rows:
            f.write('\t'.join(str(x) for x in row) + '\n')


def _pairs(rng, books, count, offset):
    """(book index, passage a, passage b) drawn from the book's passages after `offset`."""
    out = []
    for i in range(count):
        b = i % len(BOOKS)
        pool = books[b][offset : offset + 400]
        out.append((b, rng.choice(pool), rng.choice(pool)))
    return out


def write_mnli(out_dir, books, rng, n_train, n_dev):
    """MNLI-layout train (12 cols), dev_matched (16 cols) and test_matched (10 cols) files."""
    train = []
    for i, (b, a, c) in enumerate(_pairs(rng, books, n_train, 0)):
        label = MNLI_LABELS[b]
        train.append([i, i, f'{i}e', BOOKS[b], '', '', '', '', a, c, label, label])
    dev = []
    for i, (b, a, c) in enumerate(_pairs(rng, books, n_dev, 400)):
        label = MNLI_LABELS[b]
        dev.append([i, i, f'{i}e', BOOKS[b], '', '', '', '', a, c] + [label] * 5 + [label])
    test = [
        [i, i, f'{i}e', BOOKS[b], '', '', '', '', a, c]
        for i, (b, a, c) in enumerate(_pairs(rng, books, 6, 400))
    ]
    _write_tsv(os.path.join(out_dir, 'MNLI', 'train.tsv'), MNLI_TRAIN_HEADER, train)
    _write_tsv(os.path.join(out_dir, 'MNLI', 'dev_matched.tsv'), MNLI_DEV_HEADER, dev)
    _write_tsv(os.path.join(out_dir, 'MNLI', 'test_matched.tsv'), MNLI_TEST_HEADER, test)


def write_qqp(out_dir, books, rng, n_train, n_dev):
    """QQP-layout train/dev (6 cols; label 1 = same book) and test (3 cols) files."""

    def rows(count, offset):
        out = []
        for i in range(count):
            b1 = i % len(BOOKS)
            b2 = b1 if i % 2 == 0 else (b1 + 1) % len(BOOKS)
            a = rng.choice(books[b1][offset : offset + 400])
            c = rng.choice(books[b2][offset : offset + 400])
            out.append([i, 2 * i, 2 * i + 1, a, c, int(b1 == b2)])
        return out

    _write_tsv(os.path.join(out_dir, 'QQP', 'train.tsv'), QQP_HEADER, rows(n_train, 0))
    _write_tsv(os.path.join(out_dir, 'QQP', 'dev.tsv'), QQP_HEADER, rows(n_dev, 400))
    test = [[r[0], r[3], r[4]] for r in rows(6, 400)]
    _write_tsv(os.path.join(out_dir, 'QQP', 'test.tsv'), QQP_TEST_HEADER, test)


def _race_document(books, rng, b, start, num_questions):
    """One RACE-layout document: the article is passages[start], the answer the next passage."""
    article = books[b][start]
    questions, options, answers = [], [], []
    for q in range(num_questions):
        others = [x for x in range(len(BOOKS)) if x != b]
        distractors = [rng.choice(books[others[k % 2]]) for k in range(3)]
        answer = rng.randrange(4)
        choice = list(distractors)
        choice.insert(answer, books[b][start + 1])
        questions.append(
            'Which passage follows the article?'
            if q % 2 == 0
            else 'The passage after the article is _ .'
        )
        options.append(choice)
        answers.append('ABCD'[answer])
    return {
        'article': article,
        'questions': questions,
        'options': options,
        'answers': answers,
        'id': f'{BOOKS[b]}{start}.txt',
    }


def write_race(out_dir, books, rng, n_train_docs, n_dev_docs):
    """RACE-layout directories: one JSON document per *.txt file (2 questions each)."""
    for split, count, offset in (('train', n_train_docs, 0), ('dev', n_dev_docs, 400)):
        directory = os.path.join(out_dir, 'RACE', split, 'middle')
        os.makedirs(directory, exist_ok=True)
        for i in range(count):
            b = i % len(BOOKS)
            doc = _race_document(books, rng, b, offset + 2 * (i // len(BOOKS)), 2)
            with open(os.path.join(directory, f'{i}.txt'), 'w', encoding='utf-8') as f:
                f.write(json.dumps(doc) + '\n')


def write_lambada(out_dir, books, count):
    """LAMBADA-layout JSON lines: Moby Dick passages; the target is the last word."""
    with open(os.path.join(out_dir, 'lambada_test.jsonl'), 'w', encoding='utf-8') as f:
        for passage in books[0][:count]:
            f.write(json.dumps({'text': passage.rstrip('.,;:!?"\'')}) + '\n')


def wikitext_tokenize(text):
    """Word-level WikiText-103 tokenization of running text."""
    text = re.sub(r'(?<=\w)-(?=\w)', ' @-@ ', text)
    text = re.sub(r'(?<=\d),(?=\d)', ' @,@ ', text)
    text = re.sub(r'(?<=\d)\.(?=\d)', ' @.@ ', text)
    text = re.sub(r"([.,;:!?()\"])", r' \1 ', text)
    text = re.sub(r"(\w)'s\b", r"\1 's", text)
    return ' '.join(text.split())


def write_wikitext(out_dir, num_paragraphs):
    """A WikiText-layout article: ' = Title = ' lines, ' = = Section = = ' and tokenized text."""
    with open(os.path.join(REPO, 'data', 'corpus', 'mobydick.jsonl'), encoding='utf-8') as f:
        f.readline()  # the Project Gutenberg header
        chapter = json.loads(f.readline())['text']
    paragraphs = [p for p in chapter.split('\n\n') if len(p.split()) > 5][:num_paragraphs]
    lines = [' \n', ' = Moby @-@ Dick = \n', ' \n']
    for i, paragraph in enumerate(paragraphs):
        if i % 3 == 0:
            lines += [' \n', f' = = Part {i // 3 + 1} = = \n', ' \n']
        lines.append(' ' + wikitext_tokenize(paragraph.replace('\n', ' ')) + ' \n')
    with open(os.path.join(out_dir, 'wiki.test.tokens'), 'w', encoding='utf-8') as f:
        f.write(''.join(lines))


def build_all(
    output_dir,
    seed=1234,
    n_train=240,
    n_dev=60,
    race_train_docs=90,
    race_dev_docs=30,
    lambada=40,
    wiki_paragraphs=12,
):
    """Write every fixture under output_dir; returns output_dir."""
    rng = random.Random(seed)
    books = [read_passages(name) for name in BOOKS]
    os.makedirs(output_dir, exist_ok=True)
    write_mnli(output_dir, books, rng, n_train, n_dev)
    write_qqp(output_dir, books, rng, n_train, n_dev)
    write_race(output_dir, books, rng, race_train_docs, race_dev_docs)
    write_lambada(output_dir, books, lambada)
    write_wikitext(output_dir, wiki_paragraphs)
    return output_dir


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--output-dir', required=True)
    parser.add_argument('--seed', type=int, default=1234)
    args = parser.parse_args()
    build_all(args.output_dir, args.seed)
    print(f'task fixtures written to {args.output_dir} (code-path tests, not language benchmarks)')


if __name__ == '__main__':
    main()
