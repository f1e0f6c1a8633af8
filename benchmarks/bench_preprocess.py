"""tools/preprocess_data.py with the compiled tokenizer library vs the pure-Python tokenizer.

The reference is the same tool with MEGATRON_TOKENIZER_BACKEND=python: the pure-Python BPE loop,
the algorithm of Megatron's megatron/training/tokenizer/gpt2_tokenization.py (Megatron's own tool
is not installed here; the issue measured this package's pure-Python tool at 1.42-1.56x of it, so
the ratio to Megatron is about this ratio times that). Both runs preprocess the same corpus with
the same workers, alternating, and the .bin/.idx outputs are checked byte-identical.
`--tokenizer bert` does the same for BertWordPieceLowerCase (with --split-sentences).

Usage: python benchmarks/bench_preprocess.py [--corpus data/corpus/mobydick.jsonl] [--workers 2]
       [--repeats 1] [--copies 1]   # --copies N concatenates the corpus N times
       [--tokenizer gpt2|bert]
"""

import argparse
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


TOKENIZER_ARGS = {
    'gpt2': [
        '--tokenizer-type',
        'GPT2BPETokenizer',
        '--vocab-file',
        str(REPO / 'data/gpt2/gpt2-vocab.json'),
        '--merge-file',
        str(REPO / 'data/gpt2/gpt2-merges.txt'),
        '--append-eod',
    ],
    'bert': [
        '--tokenizer-type',
        'BertWordPieceLowerCase',
        '--vocab-file',
        str(REPO / 'data/bert/bert-vocab.txt'),
        '--split-sentences',
    ],
}


def run_tool(corpus, out_prefix, workers, backend, tokenizer='gpt2'):
    env = dict(os.environ, MEGATRON_TOKENIZER_BACKEND=backend, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        str(REPO / 'tools' / 'preprocess_data.py'),
        '--input',
        str(corpus),
        '--output-prefix',
        str(out_prefix),
        *TOKENIZER_ARGS[tokenizer],
        '--workers',
        str(workers),
    ]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f'preprocess_data.py ({backend}) failed:\n{proc.stderr[-2000:]}')
    return elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--corpus', default=str(REPO / 'data/corpus/mobydick.jsonl'))
    parser.add_argument('--workers', type=int, default=2)
    parser.add_argument('--repeats', type=int, default=1)
    parser.add_argument('--copies', type=int, default=1)
    parser.add_argument('--tokenizer', choices=sorted(TOKENIZER_ARGS), default='gpt2')
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = pathlib.Path(tmp)
        corpus = tmp / 'corpus.jsonl'
        text = pathlib.Path(cli.corpus).read_bytes()
        corpus.write_bytes(text * cli.copies)
        size_mb = corpus.stat().st_size / 1e6
        times = {'fast': [], 'python': []}
        outputs = {}
        for r in range(cli.repeats):
            for name, backend in (('fast', 'auto'), ('python', 'python')):
                out = tmp / f'{name}{r}'
                out.mkdir()
                times[name].append(run_tool(corpus, out / 'c', cli.workers, backend, cli.tokenizer))
                outputs[name] = {p.name: p.read_bytes() for p in sorted(out.iterdir())}
        identical = outputs['fast'] == outputs['python']
    med = {k: statistics.median(v) for k, v in times.items()}
    print(
        f'corpus {cli.corpus} x{cli.copies} ({size_mb:.1f} MB JSON), {cli.tokenizer}, '
        f'{cli.workers} workers, '
        f'{cli.repeats} alternating repeat(s); outputs byte-identical: {identical}'
    )
    for name, t in med.items():
        print(
            f'{name:>7}: {t:7.2f} s  {size_mb / t:6.2f} MB/s  (runs: '
            + ', '.join(f'{x:.2f}' for x in times[name])
            + ')'
        )
    print(f'ratio fast / pure-Python (MB/s): {med["python"] / med["fast"]:.2f}')
    if not identical:
        raise SystemExit('outputs differ')


if __name__ == '__main__':
    main()
