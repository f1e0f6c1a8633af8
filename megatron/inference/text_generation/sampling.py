"""Sampling of the next token from the last position's logits: greedy, temperature, top-k, top-p.

Every tensor-parallel rank of the last pipeline stage samples on its own copy of the (gathered,
identical) logits; the ranks agree because their RNG states are identical, so no sampled token is
communicated within the tensor-parallel group.
"""

import torch


def modify_logits_for_top_k_filtering(logits, top_k):
    """Set every logit strictly below the k-th largest of its row to -inf (ties survive)."""
    filter_ = logits < torch.topk(logits, top_k)[0][..., -1, None]
    logits.masked_fill_(filter_, float('-Inf'))


def modify_logits_for_top_p_filtering(logits, top_p):
    """Nucleus filtering: keep the smallest prefix of the descending-sorted tokens whose
    probability mass reaches top_p. A token is dropped when the mass of the tokens ranked *before*
    it already exceeds top_p, so the top token is always kept."""
    sorted_logits, sorted_indices = torch.sort(logits, descending=True)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)

    # Filteration based on the cumulative sum.
    filter_ = cumulative_probs > top_p
    # Shift by one so the token that crosses top_p is kept (the first token always is).
    filter_[:, 1:] = filter_[:, :-1].clone()
    filter_[..., 0] = 0

    # Fill in the filtered part.
    filter_ = filter_.scatter(1, sorted_indices, filter_)
    logits.masked_fill_(filter_, float('-Inf'))


def _finite_probs(logits, raw_logits):
    """softmax(logits) without NaN. A row whose scaled logits overflowed (a temperature so small
    that logits / temperature is infinite) or hold no finite value at all samples its largest
    raw logit: the limit of the distribution as the temperature goes to 0."""
    probs = logits.softmax(dim=-1)
    bad = ~torch.isfinite(probs).all(dim=-1) | ~torch.isfinite(logits).any(dim=-1)
    if bad.any():
        finite_max = torch.finfo(raw_logits.dtype).max
        raw = torch.nan_to_num(raw_logits[bad], nan=-finite_max, posinf=finite_max)
        greedy = torch.zeros_like(probs[bad])
        greedy.scatter_(1, raw.argmax(dim=-1, keepdim=True), 1.0)
        probs[bad] = greedy
    return probs


def sample(logits, top_k=0, top_p=0.0, temperature=1.0, vocab_size=None):
    """Sample one token per row of logits [b, v] (fp32).

    top_k == 1 is greedy (argmax, temperature ignored). Otherwise the logits are divided by the
    temperature, filtered by top-k (k > 1) or top-p (p > 0), and one token is drawn from the
    softmax; with top_k == 0 and top_p == 0 that is the full distribution at that temperature.
    Sampled ids are clamped to [0, vocab_size - 1] (ids of the vocabulary padding map onto the
    last real id).

    Returns:
        int64 [b] token ids.
    """
    assert logits.ndim == 2, 'expected the logits to be of [b, v] shape.'
    assert logits.dtype == torch.float32, 'input logits should be floats.'

    if top_k == 1:
        assert top_p == 0.0, 'cannot set both greedy and top-p samplings.'
        samples = torch.argmax(logits, dim=-1)
    else:
        raw_logits = logits
        # Clone so that when we modify for top-p we do not change the logits.
        logits = logits.clone()
        if temperature != 1.0:
            logits.div_(temperature)

        if top_k > 1:
            assert top_p == 0.0, 'cannot set both top-k and top-p samplings.'
            assert top_k <= logits.size(1), 'top-k is larger than logit size.'
            if vocab_size:
                assert top_k < vocab_size, 'top-k is larger than vocab size.'
            modify_logits_for_top_k_filtering(logits, top_k)
        elif top_p > 0.0:
            assert top_p <= 1.0, 'top-p should be in (0, 1].'
            modify_logits_for_top_p_filtering(logits, top_p)

        probs = _finite_probs(logits, raw_logits)
        samples = torch.multinomial(probs, num_samples=1).view(-1)

    # If vocab size is provided, make sure the samples are in the range [0, vocab_size).
    if vocab_size:
        samples = torch.clamp(samples, min=0, max=(vocab_size - 1))
    return samples
