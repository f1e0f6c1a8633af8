"""Fill-in-the-middle (FIM) rewriting of a token window (Bavarian et al. 2022, "Efficient
Training of Language Models to Fill in the Middle"), as later Megatron's GPTFIMDataset applies it.

A window is split at end-of-document ids into segments. Each non-empty segment is, with
probability `fim_rate`, decoded to text, cut at two character positions drawn uniformly from
[0, len(text)] into prefix, middle and suffix, each part re-encoded on its own, and laid out as

- PSM (probability 1 - spm_rate): <PRE> prefix <SUF> suffix <MID> middle
- SPM (probability spm_rate):     <PRE> <SUF> suffix <MID> prefix middle   (the paper's variant 2)

Nothing is appended after the middle; the segment's end-of-document id follows. With a split
token (`split_id`), a segment that contains it is, with probability `fim_rate`, cut into
fragments at that token, and each non-empty fragment is rewritten with probability
`fragment_rate` (split tokens stay in place). A piece whose text starts with `no_prefix` is left
as it is. The random draws per piece come in Megatron's order: FIM or not, the two cut points,
SPM or not.

Differences from Megatron, on purpose: every end-of-document id and split token is kept (Megatron
drops an EOD after an empty document and a split token before an empty fragment, so its output
does not always reassemble to its input); an empty tail after the last EOD is not rewritten (it
would be three sentinels around nothing); the random generator is given per window by the caller
(a sample then depends on its index only, not on the order samples are read).
"""

from dataclasses import dataclass
from typing import Callable, List, Optional

import numpy


@dataclass
class FIMTokenIds:
    """Ids of the FIM sentinels and of the document separator."""

    prefix: int
    middle: int
    suffix: int
    pad: int
    eod: int


def _permute(
    piece: List[int],
    rate: float,
    rng: numpy.random.Generator,
    ids: FIMTokenIds,
    encode: Callable[[str], List[int]],
    decode: Callable[[List[int]], str],
    spm_rate: float,
    no_prefix: Optional[str],
) -> List[int]:
    """One piece, rewritten with probability `rate` (see the module docstring)."""
    if not rng.binomial(1, rate):
        return piece
    text = decode(piece)
    if no_prefix is not None and text.startswith(no_prefix):
        return piece
    lo, hi = sorted(int(x) for x in rng.integers(0, len(text) + 1, size=2))
    prefix, middle, suffix = encode(text[:lo]), encode(text[lo:hi]), encode(text[hi:])
    if rng.binomial(1, spm_rate):
        return [ids.prefix, ids.suffix] + suffix + [ids.middle] + prefix + middle
    return [ids.prefix] + prefix + [ids.suffix] + suffix + [ids.middle] + middle


def fim_transform(
    window: numpy.ndarray,
    rng: numpy.random.Generator,
    ids: FIMTokenIds,
    encode: Callable[[str], List[int]],
    decode: Callable[[List[int]], str],
    fim_rate: float,
    spm_rate: float,
    split_id: Optional[int] = None,
    fragment_rate: Optional[float] = None,
    no_prefix: Optional[str] = None,
) -> numpy.ndarray:
    """The window rewritten segment by segment (its length changes; see `fit_length`).

    Args:
        window: token ids (int64 [n]).
        rng: the generator of this window.
        ids: sentinel and EOD ids.
        encode / decode: text <-> ids without special tokens (exact round trip for text).
        fim_rate: probability of rewriting a segment.
        spm_rate: probability of SPM rather than PSM.
        split_id: the split token of --fim-split-sample, or None.
        fragment_rate: probability of rewriting each fragment (with split_id).
        no_prefix: leave pieces whose text starts with this as they are.
    """
    args = (rng, ids, encode, decode, spm_rate, no_prefix)
    tokens = numpy.asarray(window, dtype=numpy.int64).tolist()
    out: List[int] = []
    start = 0
    while start <= len(tokens):
        try:
            end = tokens.index(ids.eod, start)
        except ValueError:
            end = len(tokens)
        segment = tokens[start:end]
        if segment:
            if split_id is not None and split_id in segment:
                if rng.binomial(1, fim_rate):
                    out += _permute_fragments(segment, split_id, fragment_rate, args)
                else:
                    out += segment
            else:
                out += _permute(segment, fim_rate, *args)
        if end < len(tokens):
            out.append(ids.eod)
        start = end + 1
    return numpy.asarray(out, dtype=numpy.int64)


def _permute_fragments(segment, split_id, fragment_rate, args) -> List[int]:
    out: List[int] = []
    fragment: List[int] = []
    for token in segment + [None]:
        if token is None or token == split_id:
            if fragment:
                out += _permute(fragment, fragment_rate, *args)
            if token is not None:
                out.append(split_id)
            fragment = []
        else:
            fragment.append(token)
    return out


def fit_length(tokens: numpy.ndarray, length: int, pad_id: int) -> numpy.ndarray:
    """Cut at the tail, or right-pad with `pad_id`, to exactly `length` tokens."""
    if len(tokens) >= length:
        return tokens[:length]
    return numpy.concatenate((tokens, numpy.full(length - len(tokens), pad_id, dtype=tokens.dtype)))
