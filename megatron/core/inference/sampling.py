"""Sampling of next tokens from last-position logits: greedy, temperature, top-k, top-p.

Same algorithm as Megatron's generate() (`megatron/inference/text_generation/sampling.py`):
top_k == 1 is argmax (no temperature); otherwise the logits are divided by the temperature, then
filtered by top-k (everything strictly below the k-th largest logit dropped, ties kept) or top-p
(a token is dropped when the mass of the tokens ranked before it already exceeds p, so the top
token is always kept), and one token is drawn from the softmax. Samples are clamped to
[0, vocab_size - 1]: ids of the vocabulary padding map onto the last real id, as in Megatron.

Rows may each have their own settings and their own `torch.Generator` (`sample_rows`), which
makes a request's sampled tokens independent of the other rows of the batch.
"""

from typing import List, Optional, Sequence

import torch


def _filter_top_k(logits: torch.Tensor, top_k: int) -> None:
    """In place: every logit strictly below the k-th largest of its row becomes -inf."""
    kth = torch.topk(logits, top_k)[0][..., -1, None]
    logits.masked_fill_(logits < kth, float('-inf'))


def _filter_top_p(logits: torch.Tensor, top_p: float) -> None:
    """In place: nucleus filtering with Megatron's shift-by-one rule."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative_probs > top_p
    # Keep the token that crosses top_p (and always the first one).
    drop[..., 1:] = drop[..., :-1].clone()
    drop[..., 0] = False
    drop = drop.scatter(-1, sorted_indices, drop)
    logits.masked_fill_(drop, float('-inf'))


def _finite_probs(logits: torch.Tensor, raw_logits: torch.Tensor) -> torch.Tensor:
    """softmax(logits) without NaN. A row whose scaled logits overflowed (a temperature so small
    that logits / temperature is infinite) or hold no finite value samples its largest raw logit:
    the limit of the distribution as the temperature goes to 0 (Megatron's sampling raised in
    torch.multinomial instead, taking the request's ranks down)."""
    probs = logits.softmax(dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    if bad.any():
        largest = torch.finfo(raw_logits.dtype).max
        raw = torch.nan_to_num(raw_logits[bad], nan=-largest, posinf=largest, neginf=-largest)
        greedy = torch.zeros_like(probs[bad])
        greedy.scatter_(1, raw.argmax(dim=-1, keepdim=True), 1.0)
        probs[bad] = greedy
    return probs


def sample(
    logits: torch.Tensor,
    top_k: int = 0,
    top_p: float = 0.0,
    temperature: float = 1.0,
    vocab_size: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """One token per row of logits [b, v] with one setting for all rows.

    Returns:
        int64 [b].
    """
    assert top_p == 0.0 or top_k == 0, 'Cannot have top-p and top-k both greater than zero'
    assert top_p <= 1.0, 'top-p should be in (0,1]'
    if top_k == 1:
        samples = torch.argmax(logits, dim=-1)
    else:
        raw_logits = logits
        logits = logits.clone()
        if temperature != 1.0:
            logits.div_(temperature)
        if top_k > 1:
            assert top_k <= logits.size(-1), 'top-k is larger than logit size.'
            if vocab_size:
                assert top_k < vocab_size, 'top-k is larger than vocab size.'
            _filter_top_k(logits, top_k)
        elif top_p > 0.0:
            _filter_top_p(logits, top_p)
        probs = _finite_probs(logits, raw_logits)
        samples = torch.multinomial(probs, num_samples=1, generator=generator).view(-1)
    if vocab_size:
        samples = torch.clamp(samples, min=0, max=vocab_size - 1)
    return samples


def sample_rows(
    logits: torch.Tensor,
    params: Sequence,
    vocab_size: Optional[int] = None,
    generators: Optional[List[Optional[torch.Generator]]] = None,
) -> torch.Tensor:
    """One token per row of logits [b, v], row i sampled with params[i] (a SamplingParams).

    Greedy rows are one argmax. Rows without a generator that share a setting are sampled
    together from the global random generator (exactly what Megatron's generate() draws for a
    batch with one setting); a row with its own generator is sampled alone from it.

    Returns:
        int64 [b].
    """
    batch = logits.size(0)
    out = torch.empty(batch, dtype=torch.long, device=logits.device)
    generators = generators if generators is not None else [None] * batch
    greedy = [i for i in range(batch) if params[i].top_k == 1]
    if len(greedy) == batch:  # every row greedy: one argmax, without copying the logits
        return sample(logits, top_k=1, vocab_size=vocab_size)
    if greedy:
        idx = torch.tensor(greedy, device=logits.device)
        out[idx] = sample(logits.index_select(0, idx), top_k=1, vocab_size=vocab_size)
    groups = {}
    for i in range(batch):
        if params[i].top_k == 1:
            continue
        if generators[i] is not None:
            p = params[i]
            out[i] = sample(
                logits[i : i + 1], p.top_k, p.top_p, p.temperature, vocab_size, generators[i]
            )[0]
        else:
            groups.setdefault(params[i].sampling_key(), []).append(i)
    for (temperature, top_k, top_p), rows in groups.items():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = sample(logits.index_select(0, idx), top_k, top_p, temperature, vocab_size)
    return out


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[..., token] (raw logits, over the padded vocabulary; fp32 at least).

    Args:
        logits: [..., v].
        tokens: [...] int64.
    """
    if logits.dtype not in (torch.float32, torch.float64):
        logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return torch.gather(log_probs, -1, tokens.unsqueeze(-1)).squeeze(-1)
