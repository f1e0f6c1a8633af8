"""tools/preprocess_data.py on a machine it could overload: --workers above the core count is
capped with a warning, and one huge document shows that it is still being encoded."""

import json
import os
import re

from megatron.core.datasets.indexed_dataset import IndexedDataset
from tests.unit_tests.data.test_preprocess_data import DATA, GPT2, preprocess


def _jsonl(tmp_path, texts):
    path = tmp_path / 'in.jsonl'
    path.write_text(''.join(json.dumps({'text': t}) + '\n' for t in texts), encoding='utf-8')
    return str(path)


def _cores():
    return len(os.sched_getaffinity(0)) if hasattr(os, 'sched_getaffinity') else os.cpu_count()


def test_workers_above_core_count_are_capped(tmp_path, capsys):
    path = _jsonl(tmp_path, ['one small document', 'and another'])
    requested = _cores() + 62
    preprocess.main(
        ['--input', path, '--output-prefix', str(tmp_path / 'out'), '--workers', str(requested)]
        + GPT2
    )
    err = capsys.readouterr().err
    assert (
        f'WARNING: --workers {requested} is more than the {_cores()} CPU cores available; '
        f'using {_cores()} workers'
    ) in err
    assert len(IndexedDataset(str(tmp_path / 'out_text_document'))) == 2


def test_one_huge_document_shows_progress(tmp_path, capsys, monkeypatch):
    with open(DATA / 'corpus' / 'mobydick.jsonl', encoding='utf-8') as f:
        huge = ' '.join(json.loads(line)['text'] for line, _ in zip(f, range(150)))
    path = _jsonl(tmp_path, ['a short one', huge])
    monkeypatch.setattr(preprocess, 'STILL_ENCODING_INTERVAL', 0.5)
    # The compiled tokenizers encode this document in well under the interval.
    monkeypatch.setenv('MEGATRON_TOKENIZER_BACKEND', 'python')
    preprocess.main(
        ['--input', path, '--output-prefix', str(tmp_path / 'out'), '--workers', '1'] + GPT2
    )
    err = capsys.readouterr().err
    # Documents travel in chunks: the line names the first one not yet finished.
    assert re.search(
        r'Processed [01] documents; still encoding document [12] \(\d+ s so far\)', err
    ), err[-2000:]
    ds = IndexedDataset(str(tmp_path / 'out_text_document'))
    assert len(ds) == 2 and len(ds[1]) > 10000
