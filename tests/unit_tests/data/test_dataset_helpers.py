"""The C++ index helpers against slow pure-Python versions of the same algorithms.

The references below are written from the algorithms of Megatron's
megatron/core/datasets/helpers.cpp, not from our C++ source; small hand-worked vectors are
checked as well.
"""

import os
import subprocess
import sys

import numpy
import pytest

from megatron.core.datasets import helpers

# ---------------------------------------------------------------------------------------------
# Pure-Python references
# ---------------------------------------------------------------------------------------------


class MT19937:
    """std::mt19937 (32-bit Mersenne twister)."""

    def __init__(self, seed):
        self.mt = [0] * 624
        self.mt[0] = seed & 0xFFFFFFFF
        for i in range(1, 624):
            self.mt[i] = (1812433253 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 30)) + i) & 0xFFFFFFFF
        self.index = 624

    def __call__(self):
        if self.index >= 624:
            for i in range(624):
                y = (self.mt[i] & 0x80000000) | (self.mt[(i + 1) % 624] & 0x7FFFFFFF)
                self.mt[i] = self.mt[(i + 397) % 624] ^ (y >> 1) ^ (0x9908B0DF if y & 1 else 0)
            self.index = 0
        y = self.mt[self.index]
        self.index += 1
        y ^= y >> 11
        y ^= (y << 7) & 0x9D2C5680
        y ^= (y << 15) & 0xEFC60000
        y ^= y >> 18
        return y & 0xFFFFFFFF


class MT19937_64:
    """std::mt19937_64."""

    N, M = 312, 156
    MASK = (1 << 64) - 1

    def __init__(self, seed):
        self.mt = [0] * self.N
        self.mt[0] = seed & self.MASK
        for i in range(1, self.N):
            self.mt[i] = (
                6364136223846793005 * (self.mt[i - 1] ^ (self.mt[i - 1] >> 62)) + i
            ) & self.MASK
        self.index = self.N

    def __call__(self):
        n, m = self.N, self.M
        upper, lower = 0xFFFFFFFF80000000, 0x7FFFFFFF
        if self.index >= n:
            for i in range(n):
                x = (self.mt[i] & upper) | (self.mt[(i + 1) % n] & lower)
                xa = x >> 1
                if x & 1:
                    xa ^= 0xB5026F5AA96619E9
                self.mt[i] = self.mt[(i + m) % n] ^ xa
            self.index = 0
        x = self.mt[self.index]
        self.index += 1
        x ^= (x >> 29) & 0x5555555555555555
        x ^= (x << 17) & 0x71D67FFFEDA60000
        x ^= (x << 37) & 0xFFF7EEE000000000
        x ^= x >> 43
        return x & self.MASK


def ref_build_sample_idx(
    sizes, doc_idx, seq_length, num_epochs, tokens_per_epoch, drop_last=True, extra=1
):
    """Walk the document stream, cutting samples of seq_length + extra tokens overlapping by
    extra."""
    total = num_epochs * tokens_per_epoch - extra
    if drop_last:
        n = total // seq_length
    else:
        n = -(-total // seq_length)
    n = max(n, 0)
    rows = [(0, 0)]
    p, o = 0, 0
    for _ in range(n):
        need = seq_length + extra
        while need != 0:
            avail = int(sizes[doc_idx[p]]) - o
            need -= avail
            if need <= 0:
                o += need + avail - extra
                need = 0
            elif p == len(doc_idx) - 1:
                o = int(sizes[doc_idx[p]]) - extra
                break
            else:
                p += 1
                o = 0
        rows.append((p, o))
    return numpy.array(rows, dtype=numpy.int64)


def ref_blending(weights, size):
    counts = [0] * len(weights)
    d_index, s_index = [], []
    for s in range(size):
        s_ = max(float(s), 1.0)
        errors = [w * s_ - c for w, c in zip(weights, counts)]
        best = 0
        for d in range(1, len(weights)):
            if errors[d] > errors[best]:
                best = d
        d_index.append(best)
        s_index.append(counts[best])
        counts[best] += 1
    return d_index, s_index


def ref_exhaustive_blending(sizes):
    total = sum(sizes)
    weights = [s / total for s in sizes]
    counts = [0] * len(sizes)
    d_index, s_index = [], []
    for s in range(total):
        s_ = max(float(s), 1.0)
        best = None
        for d in range(len(sizes)):
            if counts[d] < sizes[d]:
                e = weights[d] * s_ - counts[d]
                if best is None or e > best[0]:
                    best = (e, d)
        d = best[1]
        d_index.append(d)
        s_index.append(counts[d])
        counts[d] += 1
    return d_index, s_index


def _shuffle_rows(rows, seed):
    gen = MT19937_64(seed + 1)
    for i in range(len(rows) - 1, 0, -1):
        j = gen() % (i + 1)
        rows[i], rows[j] = rows[j], rows[i]
    return rows


def ref_build_mapping(
    docs, sizes, num_epochs, max_num_samples, max_seq_length, short_seq_prob, seed, min_num_sent
):
    ratio = int(round(1.0 / short_seq_prob)) if short_seq_prob > 0 else 0
    gen = MT19937(seed)

    def target():
        if ratio == 0:
            return max_seq_length
        r = gen()
        if r % ratio == 0:
            return 2 + r % (max_seq_length - 1)
        return max_seq_length

    rows = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        for doc in range(len(docs) - 1):
            first, last = int(docs[doc]), int(docs[doc + 1])
            remain = last - first
            long_sentence = remain > 1 and any(int(sizes[k]) > 512 for k in range(first, last))
            if remain < min_num_sent or long_sentence:
                continue
            start, seq_len, num_sent = first, 0, 0
            tgt = target()
            for k in range(first, last):
                seq_len += int(sizes[k])
                num_sent += 1
                remain -= 1
                if (seq_len >= tgt and remain > 1 and num_sent >= min_num_sent) or remain == 0:
                    rows.append((start, k + 1, tgt))
                    start = k + 1
                    tgt = target()
                    seq_len, num_sent = 0, 0
    return numpy.array(_shuffle_rows(rows, seed), dtype=numpy.int64).reshape(-1, 3)


def ref_build_blocks_mapping(
    docs, sizes, titles, num_epochs, max_num_samples, max_seq_length, seed, one_sent
):
    min_num_sent = 1 if one_sent else 2
    rows = []
    for _ in range(num_epochs):
        if len(rows) >= max_num_samples:
            break
        block_id = len(rows)
        for doc in range(len(docs) - 1):
            first, last = int(docs[doc]), int(docs[doc + 1])
            tgt = max_seq_length - int(titles[doc])
            remain = last - first
            long_sentence = remain >= min_num_sent and any(
                int(sizes[k]) > 512 for k in range(first, last)
            )
            if remain < min_num_sent or long_sentence:
                continue
            start, seq_len, num_sent = first, 0, 0
            for k in range(first, last):
                seq_len += int(sizes[k])
                num_sent += 1
                remain -= 1
                if (
                    seq_len >= tgt and remain >= min_num_sent and num_sent >= min_num_sent
                ) or remain == 0:
                    rows.append((start, k + 1, doc, block_id))
                    block_id += 1
                    start = k + 1
                    seq_len, num_sent = 0, 0
    return numpy.array(_shuffle_rows(rows, seed), dtype=numpy.int64).reshape(-1, 4)


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


def test_reference_generators_match_the_cpp_standard():
    # The C++ standard fixes the 10000th output of both engines with the default seed 5489.
    g32, g64 = MT19937(5489), MT19937_64(5489)
    for _ in range(9999):
        g32(), g64()
    assert g32() == 4123659995
    assert g64() == 9981545732273789042


def test_build_sample_idx_hand_vectors():
    sizes = numpy.array([5, 3, 7], dtype=numpy.int32)
    out = helpers.build_sample_idx(sizes, numpy.array([0, 1, 2], dtype=numpy.int32), 4, 1, 15)
    assert out.tolist() == [[0, 0], [0, 4], [2, 0], [2, 4]]
    assert out.dtype == numpy.int32
    out = helpers.build_sample_idx(sizes, numpy.array([2, 0, 1], dtype=numpy.int32), 4, 1, 15)
    assert out.tolist() == [[0, 0], [0, 4], [1, 1], [2, 0]]


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("extra", [1, 0])
def test_build_sample_idx_random(drop_last, extra):
    rng = numpy.random.default_rng(7 + extra + 2 * drop_last)
    for trial in range(30):
        num_docs = int(rng.integers(1, 40))
        sizes = rng.integers(0 if trial % 3 else 1, 30, size=num_docs + 5).astype(numpy.int32)
        docs = rng.choice(num_docs + 5, size=num_docs, replace=False).astype(numpy.int32)
        tokens_per_epoch = int(sizes[docs].sum())
        if tokens_per_epoch <= extra:
            continue
        epochs = int(rng.integers(1, 4))
        doc_idx = numpy.tile(docs, epochs)
        rng.shuffle(doc_idx)
        seq = int(rng.integers(1, 20))
        out = helpers.build_sample_idx(
            sizes, doc_idx, seq, epochs, tokens_per_epoch, drop_last, extra
        )
        ref = ref_build_sample_idx(sizes, doc_idx, seq, epochs, tokens_per_epoch, drop_last, extra)
        numpy.testing.assert_array_equal(out, ref)


def test_build_sample_idx_samples_are_contiguous_windows():
    """Independent of the walk: sample j covers stream tokens [j*S, j*S + S + 1)."""
    rng = numpy.random.default_rng(3)
    sizes = rng.integers(1, 50, size=60).astype(numpy.int32)
    doc_idx = rng.permutation(60).astype(numpy.int32)
    seq = 16
    out = helpers.build_sample_idx(sizes, doc_idx, seq, 1, int(sizes.sum()))
    starts = numpy.concatenate([[0], numpy.cumsum(sizes[doc_idx])])
    for j, (p, o) in enumerate(out):
        assert starts[p] + o == j * seq
    assert len(out) - 1 == (int(sizes.sum()) - 1) // seq


def test_blending_hand_vectors():
    di = numpy.zeros(10, dtype=numpy.int16)
    ds = numpy.zeros(10, dtype=numpy.int64)
    helpers.build_blending_indices(di, ds, [0.3, 0.7], 2, 10, False)
    assert di.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert ds.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    helpers.build_blending_indices(di, ds, [0.2, 0.3, 0.5], 3, 10, False)
    assert di.tolist() == [2, 1, 0, 2, 1, 2, 0, 2, 1, 2]


def test_blending_random():
    rng = numpy.random.default_rng(11)
    for _ in range(20):
        n = int(rng.integers(1, 8))
        w = rng.random(n) + 0.01
        w = (w / w.sum()).tolist()
        size = int(rng.integers(1, 500))
        di = numpy.zeros(size, dtype=numpy.int16)
        ds = numpy.zeros(size, dtype=numpy.int64)
        helpers.build_blending_indices(di, ds, w, n, size, False)
        ref_d, ref_s = ref_blending(w, size)
        assert di.tolist() == ref_d
        assert ds.tolist() == ref_s


def test_exhaustive_blending_random():
    rng = numpy.random.default_rng(12)
    for _ in range(20):
        sizes = rng.integers(1, 60, size=int(rng.integers(1, 6))).tolist()
        total = sum(sizes)
        di = numpy.zeros(total, dtype=numpy.int16)
        ds = numpy.zeros(total, dtype=numpy.int64)
        helpers.build_exhaustive_blending_indices(di, ds, sizes, len(sizes))
        ref_d, ref_s = ref_exhaustive_blending(sizes)
        assert di.tolist() == ref_d
        assert ds.tolist() == ref_s
        assert numpy.bincount(di, minlength=len(sizes)).tolist() == sizes


def _random_sentences(rng, num_docs):
    sent_counts = rng.integers(0, 8, size=num_docs)
    docs = numpy.concatenate([[0], numpy.cumsum(sent_counts)]).astype(numpy.int64)
    sizes = rng.integers(1, 60, size=int(docs[-1])).astype(numpy.int32)
    if len(sizes) > 3:
        sizes[rng.integers(0, len(sizes))] = 600  # one over-long sentence excludes its document
    return docs, sizes


@pytest.mark.parametrize("min_num_sent", [1, 2])
def test_build_mapping_random(min_num_sent):
    rng = numpy.random.default_rng(13 + min_num_sent)
    for trial in range(6):
        docs, sizes = _random_sentences(rng, int(rng.integers(2, 30)))
        args = (
            docs,
            sizes,
            int(rng.integers(1, 4)),
            int(rng.integers(1, 200)),
            int(rng.integers(8, 120)),
            [0.0, 0.1, 0.5][trial % 3],
            int(rng.integers(1, 1000)),
        )
        out = helpers.build_mapping(*args, False, min_num_sent)
        ref = ref_build_mapping(*args, min_num_sent)
        assert out.dtype == numpy.uint32
        numpy.testing.assert_array_equal(out.astype(numpy.int64), ref)


@pytest.mark.parametrize("one_sent", [False, True])
def test_build_blocks_mapping_random(one_sent):
    rng = numpy.random.default_rng(17 + one_sent)
    for _ in range(6):
        docs, sizes = _random_sentences(rng, int(rng.integers(2, 30)))
        titles = rng.integers(0, 6, size=len(docs) - 1).astype(numpy.int32)
        args = (
            docs,
            sizes,
            titles,
            int(rng.integers(1, 4)),
            int(rng.integers(1, 200)),
            int(rng.integers(16, 120)),
            int(rng.integers(1, 1000)),
        )
        out = helpers.build_blocks_mapping(*args, False, one_sent)
        ref = ref_build_blocks_mapping(*args, one_sent)
        numpy.testing.assert_array_equal(out.astype(numpy.int64), ref)


def test_compile_helpers_reports_missing_compiler(tmp_path):
    """With no compiler on PATH the on-first-use build fails with one clear message."""
    code = (
        "import os, megatron.core.datasets.utils as u\n"
        "u._HELPERS_DIR = os.environ['TMPD']\n"
        "u._HELPERS_SRC = os.path.join(os.environ['TMPD'], 'helpers.cpp')\n"
        "open(u._HELPERS_SRC, 'w').write('')\n"
        "try:\n    u.compile_helpers()\nexcept RuntimeError as e:\n    print('ERR', e)\n"
    )
    env = dict(os.environ, PATH=str(tmp_path), TMPD=str(tmp_path))
    env.pop("CXX", None)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert "ERR" in out.stdout and "no C++ compiler was found" in out.stdout, (
        out.stdout + out.stderr
    )


def test_compile_helpers_builds_a_working_module(tmp_path):
    """compile_helpers() builds helpers.cpp into an importable extension (the on-first-use path)."""
    code = (
        "import os, shutil, sys, importlib, numpy\nimport megatron.core.datasets.utils as u\nd = "
        "os.environ['TMPD']\nshutil.copy(u._HELPERS_SRC, os.path.join(d, 'helpers.cpp'))\n"
        "u._HELPERS_DIR = d; u._HELPERS_SRC = os.path.join(d, 'helpers.cpp')\nu.compile_helpers()\n"
        "sys.path.insert(0, d)\nm = importlib.import_module('helpers_cpp')\n"
        "print(m.build_sample_idx_int32(numpy.array([5,3,7],'int32'), "
        "numpy.array([0,1,2],'int32'), 4, 1, 15, True, 1).tolist())\n"
    )
    env = dict(os.environ, TMPD=str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[[0, 0], [0, 4], [2, 0], [2, 4]]"
