"""The generation loops: sampling (`generate_tokens_probs_and_return_on_first_stage`), scoring
(`score_and_return_on_first_stage`) and beam search (`beam_search_and_return_on_first_stage`).

Every rank runs the same loop. The first pipeline stage feeds tokens, the last one samples; after
each step the new token column is copied from the last stage to the first over the embedding
group, and the "all rows done" flag is broadcast over the pipeline group so that every stage leaves
the loop together. Shapes: b batch, s = max prompt length + tokens_to_generate, v padded vocab.
"""

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as mpu
from megatron.core.utils import get_current_device
from megatron.inference.text_generation.beam_utils import BeamHypotheses
from megatron.inference.text_generation.communication import (
    broadcast_from_last_pipeline_stage,
    broadcast_from_last_to_first_pipeline_stage,
    copy_from_last_to_first_pipeline_stage,
)
from megatron.inference.text_generation.forward_step import ForwardStep
from megatron.inference.text_generation.sampling import sample
from megatron.inference.text_generation.tokenization import eod_id
from megatron.training.global_vars import get_args, get_tokenizer
from megatron.training.utils import get_ltor_masks_and_position_ids

#: GPT-2 ids of "\n\n" and "\n": stop_on_double_eol / stop_on_eol test these, whatever the
#: tokenizer (as Megatron does).
DOUBLE_EOL_ID = 628
EOL_ID = 198


def _check_sizes(batch_size, max_sequence_length, args):
    if max_sequence_length > args.max_position_embeddings:
        raise ValueError("Length of prompt + tokens_to_generate longer than allowed")
    if max_sequence_length * batch_size > args.max_tokens_to_oom:
        raise ValueError(
            "Too many tokens.  "
            + str(max_sequence_length * batch_size)
            + " is greater than "
            + str(args.max_tokens_to_oom)
        )


def _termination_id(args, tokenizer):
    if hasattr(args, 'eos_id'):
        return args.eos_id
    return eod_id(tokenizer)


def score_and_return_on_first_stage(model, tokens, lengths):
    """Log probabilities of the prompt tokens (tokens_to_generate == 0) in one forward.

    Args:
        tokens: [b, s] prompt tokens.
        lengths: [b] prompt lengths.

    Returns:
        (tokens, lengths, log probs [b, s - 1] of tokens[:, 1:] on the first stage, logits).
    """
    args = get_args()
    batch_size = tokens.size(0)
    max_prompt_length = lengths.max().item()
    assert max_prompt_length == tokens.size(1)
    _check_sizes(batch_size, max_prompt_length, args)

    # Forward step (its KV cache is allocated but not used afterwards).
    forward_step = ForwardStep(model, batch_size, max_prompt_length)

    output_log_probs = None
    output_log_probs_size = (batch_size, max_prompt_length - 1)
    if mpu.is_pipeline_last_stage():
        output_log_probs = torch.empty(
            output_log_probs_size, dtype=torch.float32, device=get_current_device()
        )

    attention_mask, position_ids = _build_attention_mask_and_position_ids(tokens)
    with torch.no_grad():
        logits = forward_step(tokens, position_ids, attention_mask)
        if mpu.is_pipeline_last_stage():
            # [b, s, v] -> log P(token k + 1 | tokens 0..k): [b, s - 1]
            log_probs = F.log_softmax(logits, dim=2)
            indices = torch.unsqueeze(tokens[:, 1:], 2)
            output_log_probs = torch.gather(log_probs[:, :-1], 2, indices).squeeze(2)

    output_log_probs = broadcast_from_last_to_first_pipeline_stage(
        output_log_probs_size, torch.float32, output_log_probs
    )
    return tokens, lengths, output_log_probs, logits


def generate_tokens_probs_and_return_on_first_stage(
    model,
    tokens,
    lengths,
    return_output_log_probs=False,
    top_k=0,
    top_p=0.0,
    top_p_decay=0.0,
    top_p_bound=0.0,
    temperature=1.0,
    use_eod_token_for_early_termination=True,
    stop_on_double_eol=False,
    stop_on_eol=False,
    prevent_newline_after_colon=True,
    step_callback=None,
    host_stop=False,
):
    """Generate tokens into the padding of `tokens`, in place.

    The loop runs context = min prompt length .. s - 1; each step feeds the columns not yet in the
    KV cache (the shared prefix first, then one column) and samples column `context` from the last
    position's logits. Rows whose prompt is longer than `context` keep their prompt token. A row
    ends on the termination id (or, with stop_on_eol / stop_on_double_eol, on "\\n" / "\\n\\n"
    instead), and its length then includes that token.

    Args:
        model: the model of this stage.
        tokens: [b, s] prompts right-padded to s.
        lengths: [b] prompt lengths.
        return_output_log_probs: also return log P(token k + 1 | tokens 0..k) from the raw
            logits (temperature 1, no filtering).
        top_k, top_p, temperature: see `sample`.
        top_p_decay, top_p_bound: after each step top_p *= top_p_decay, floored at top_p_bound.
        use_eod_token_for_early_termination: leave the loop once every row has ended.
        stop_on_double_eol, stop_on_eol: end rows on newlines rather than the termination id.
        prevent_newline_after_colon: forbid "\\n" right after ":".
        step_callback: called as step_callback(tokens, context_length) on the first stage once
            column `context_length` is there (streaming); with host_stop, a truthy return on
            global rank 0 ends the loop on every rank (stop sequences, a client gone).
        host_stop: every rank follows global rank 0's stop verdict after each step (one
            1-element broadcast per step over the default group); all ranks must agree on it.

    Returns:
        (tokens [b, context + 1], lengths [b], log probs [b, context] or None, None) on the first
        stage (tokens are cut at the last step run).
    """
    args = get_args()
    tokenizer = get_tokenizer()

    batch_size = tokens.size(0)
    min_prompt_length = lengths.min().item()
    max_sequence_length = tokens.size(1)
    _check_sizes(batch_size, max_sequence_length, args)

    forward_step = ForwardStep(model, batch_size, max_sequence_length)
    # Without log probs only the last position's logits are sampled from: the output layer
    # skips the other prompt positions (same tokens, less work on the first step).
    forward_step.inference_params.materialize_only_last_token_logits = not return_output_log_probs
    termination_id = _termination_id(args, tokenizer)
    device = get_current_device()

    # Only the last stage computes these; the first stage receives them at the end.
    output_log_probs, generated_sequence_lengths = _last_stage_outputs(
        batch_size, max_sequence_length, return_output_log_probs
    )
    # Whether each row has finished.
    is_generation_done = torch.zeros(batch_size, dtype=torch.uint8, device=device)

    colon_id, newline_id = _colon_and_newline_ids(tokenizer, prevent_newline_after_colon)

    attention_mask, position_ids = _build_attention_mask_and_position_ids(tokens)

    with torch.no_grad():
        prev_context_length = 0
        for context_length in range(min_prompt_length, max_sequence_length):
            # Pick the slice that we need to pass through the network.
            tokens2use = tokens[:, prev_context_length:context_length]
            positions2use = position_ids[:, prev_context_length:context_length]

            # logits will be meaningful only in the last pipeline stage: [b, width, v]
            logits = forward_step(tokens2use, positions2use, attention_mask)

            if mpu.is_pipeline_last_stage():
                _forbid_newline_after_colon(logits, tokens2use, colon_id, newline_id)
                # Sample from the last position.
                new_sample = sample(
                    logits[:, -1, :],
                    top_k=top_k,
                    top_p=top_p,
                    temperature=temperature,
                    vocab_size=tokenizer.vocab_size,
                )
                top_p = _decayed_top_p(top_p, top_p_decay, top_p_bound)

                # Rows still inside their prompt keep the prompt token.
                started = lengths <= context_length
                tokens[started, context_length] = new_sample[started]

                if return_output_log_probs:
                    _store_log_probs(
                        output_log_probs, logits, tokens, prev_context_length, context_length
                    )

            # The first stage needs the new column as its next input.
            copy_from_last_to_first_pipeline_stage(
                batch_size, torch.int64, tokens[:, context_length]
            )
            prev_context_length = context_length
            stop_requested = _call_step_callback(step_callback, tokens, context_length)

            done = None
            if mpu.is_pipeline_last_stage():
                done_token = _rows_ending_here(
                    new_sample,
                    tokens[:, context_length - 1],
                    started,
                    termination_id,
                    stop_on_double_eol,
                    stop_on_eol,
                )
                is_generation_done, done = _mark_finished_rows(
                    done_token, is_generation_done, generated_sequence_lengths, context_length
                )
            done = broadcast_from_last_pipeline_stage(1, torch.uint8, tensor=done)
            if use_eod_token_for_early_termination and bool(done):
                break
            if host_stop and _stop_verdict_from_rank_0(stop_requested):
                break

    # Cut to the columns actually generated.
    tokens = tokens[:, : (context_length + 1)]
    if mpu.is_pipeline_last_stage() and return_output_log_probs:
        output_log_probs = output_log_probs[:, :context_length].contiguous()

    # Lengths and log probs go to the first stage, where the results are post-processed.
    generated_sequence_lengths = broadcast_from_last_to_first_pipeline_stage(
        batch_size, torch.int64, generated_sequence_lengths
    )
    if return_output_log_probs:
        output_log_probs = broadcast_from_last_to_first_pipeline_stage(
            (batch_size, context_length), torch.float32, output_log_probs
        )
    return tokens, generated_sequence_lengths, output_log_probs, None


def _last_stage_outputs(batch_size, max_sequence_length, return_output_log_probs):
    """(log probs [b, s - 1] float32 or None, generated lengths [b] = s) on the last stage,
    (None, None) elsewhere."""
    if not mpu.is_pipeline_last_stage():
        return None, None
    device = get_current_device()
    output_log_probs = None
    if return_output_log_probs:
        output_log_probs = torch.empty(
            (batch_size, max_sequence_length - 1), dtype=torch.float32, device=device
        )
    lengths = torch.full((batch_size,), max_sequence_length, dtype=torch.int64, device=device)
    return output_log_probs, lengths


def _store_log_probs(output_log_probs, logits, tokens, prev_context_length, context_length):
    """log P(next token) of the fed positions [prev, context), from the raw logits [b, width, v]
    (temperature 1, no filtering), into output_log_probs[:, prev:context]."""
    log_probs = F.log_softmax(logits, dim=2)
    # The next token of each fed position: [b, width, 1]
    indices = torch.unsqueeze(tokens[:, (prev_context_length + 1) : (context_length + 1)], 2)
    output_log_probs[:, prev_context_length:context_length] = torch.gather(
        log_probs, 2, indices
    ).squeeze(2)


def _rows_ending_here(
    new_sample, previous, started, termination_id, stop_on_double_eol, stop_on_eol
):
    """uint8 [b]: started rows whose new token ends them. With stop_on_double_eol: "\\n\\n", or
    "\\n" after "\\n"; with stop_on_eol: either newline; otherwise the termination id."""
    started_u8 = started.byte()
    if stop_on_double_eol:
        hit_double_eol = (new_sample == DOUBLE_EOL_ID).byte() & started_u8
        hit_two_eols = (new_sample == EOL_ID).byte() & (previous == EOL_ID).byte() & started_u8
        return hit_double_eol | hit_two_eols
    if stop_on_eol:
        hit_double_eol = (new_sample == DOUBLE_EOL_ID).byte() & started_u8
        hit_eol = (new_sample == EOL_ID).byte() & started_u8
        return hit_double_eol | hit_eol
    return (new_sample == termination_id).byte() & started_u8


def _call_step_callback(step_callback, tokens, context_length):
    """The callback's stop verdict (first stage only). Its exceptions are the caller's (e.g. a
    closed stream): they stop this request instead of leaving this rank out of step."""
    if step_callback is None or not mpu.is_pipeline_first_stage():
        return False
    try:
        return bool(step_callback(tokens, context_length))
    except Exception as exc:
        print(f'step callback failed, stopping the generation: {type(exc).__name__}: {exc}')
        return True


def _stop_verdict_from_rank_0(stop_requested):
    """Global rank 0's stop verdict on every rank (a 1-element broadcast, default group)."""
    flag = torch.tensor([int(bool(stop_requested))], dtype=torch.uint8, device=get_current_device())
    torch.distributed.broadcast(flag, 0)
    return bool(flag.item())


def beam_search_and_return_on_first_stage(
    model,
    tokens,
    lengths,
    beam_size,
    stop_token,
    num_return_gen,
    length_penalty,
    prevent_newline_after_colon=True,
):
    """Beam search for one prompt.

    Each step adds each beam's running score to its last-position log probs over the padded
    vocabulary (on the first step only beam 0's row counts), keeps the best 2 * beam_size
    (beam, token) candidates, turns a `stop_token` candidate ranked within the first beam_size
    into a finished hypothesis (its row as it stands, the stop column still holding padding),
    and continues the best beam_size others; the KV cache rows follow their beams.

    Args:
        tokens: [1, s] the prompt right-padded to s.
        lengths: [1] prompt length.
        beam_size (int): beams kept.
        stop_token (int): id that finishes a hypothesis.
        num_return_gen (int): hypotheses returned.
        length_penalty (float): see `BeamHypotheses`.

    Returns:
        (tokens [num_return_gen, s'], scores [num_return_gen]) on the first stage.
    """
    args = get_args()
    tokenizer = get_tokenizer()

    batch_size = tokens.size(0)
    assert batch_size == 1
    prompt_length = lengths.item()
    final_sequence_length = tokens.size(1)
    final_sequence_length = min(final_sequence_length, args.max_position_embeddings)

    # If the context is too big, this happens.
    if prompt_length >= final_sequence_length:
        raise ValueError("context length + tokens_to_generate too large")

    forward_step = ForwardStep(model, beam_size, final_sequence_length)
    forward_step.inference_params.materialize_only_last_token_logits = True
    device = get_current_device()

    beam_hyp = BeamHypotheses(beam_size, length_penalty)
    best_batches = None
    done = torch.zeros(1, dtype=torch.uint8, device=device)
    scores = torch.zeros(beam_size, dtype=torch.float32, device=device).unsqueeze(1)
    # Run on every beam.
    tokens = tokens.repeat(beam_size, 1)
    attention_mask, position_ids = _build_attention_mask_and_position_ids(tokens)
    prev_context_length = 0

    colon_id, newline_id = _colon_and_newline_ids(tokenizer, prevent_newline_after_colon)

    with torch.no_grad():
        for context_length in range(prompt_length, final_sequence_length):
            tokens2use = tokens[:, prev_context_length:context_length]
            positions2use = position_ids[:, prev_context_length:context_length]

            # [beam, width, v] on the last stage
            logits = forward_step(tokens2use, positions2use, attention_mask)

            if mpu.is_pipeline_last_stage():
                _forbid_newline_after_colon(logits, tokens2use, colon_id, newline_id)
                vocab_size = logits.size(2)
                log_probs = F.log_softmax(logits, dim=2)
                new_scores = log_probs[:, -1, :] + scores
                # Ids of the vocabulary padding have no text: never pick them (Megatron did,
                # and detokenizing them then failed).
                new_scores[:, tokenizer.vocab_size :] = float('-inf')

                if tokens2use.size(1) == prompt_length:  # if this is the first one
                    sorted_scores, indices = torch.sort(new_scores[0, :], descending=True)
                else:
                    sorted_scores, indices = torch.sort(new_scores.view(-1), descending=True)

                best_beam_ids = torch.div(indices[: 2 * beam_size], vocab_size).trunc().long()
                best_words = indices[: 2 * beam_size] % vocab_size
                best_scores = sorted_scores[: 2 * beam_size]

                next_beams = _next_beams(
                    (best_words, best_scores, best_beam_ids),
                    beam_size,
                    stop_token,
                    beam_hyp,
                    tokens,
                    context_length + 1 - prompt_length,
                )

                if beam_hyp.is_done(best_scores.max().item(), context_length + 1 - prompt_length):
                    done = torch.ones(1, dtype=torch.uint8, device=device)

                best_batches = tokens.new([item[2] for item in next_beams])
                tokens = tokens[best_batches, :]
                tokens[:, context_length] = tokens.new([item[0] for item in next_beams])
                scores = scores.new([item[1] for item in next_beams]).unsqueeze(1)

            # Torch.distributed.all_reduce(done)
            done = broadcast_from_last_pipeline_stage(1, torch.uint8, done)
            if done:
                break

            # Update the tokens on the first stage so the next input to the network is correct.
            copy_from_last_to_first_pipeline_stage(tokens.size(), torch.int64, tokens)

            # Update the context length for the next token generation.
            best_batches = broadcast_from_last_pipeline_stage(beam_size, torch.int64, best_batches)
            forward_step.inference_params.swap_key_value_dict(best_batches)

            prev_context_length = context_length

        if mpu.is_pipeline_last_stage():
            # If we cannot find an eos token, take the best beams.
            if not done:
                for beam_id in range(beam_size):
                    beam_hyp.add(
                        tokens[beam_id].clone(),
                        scores[beam_id].squeeze(),
                        context_length + 1 - prompt_length,
                    )
        return _best_hypotheses_on_first_stage(beam_hyp, num_return_gen)


def _colon_and_newline_ids(tokenizer, prevent_newline_after_colon):
    """The ids of ":" and "\\n" when a newline right after a colon is forbidden, else Nones."""
    if not prevent_newline_after_colon:
        return None, None
    return tokenizer.tokenize(':')[0], tokenizer.tokenize('\n')[0]


def _forbid_newline_after_colon(logits, fed_tokens, colon_id, newline_id):
    """In place: rows whose last fed token is ":" cannot sample "\\n" next ([b, width, v])."""
    if colon_id is not None:
        logits[fed_tokens[:, -1] == colon_id, -1, newline_id] = -1e10


def _decayed_top_p(top_p, top_p_decay, top_p_bound):
    """top_p after one step: times top_p_decay, floored at top_p_bound (when each is set)."""
    if top_p > 0.0 and top_p_decay > 0.0:
        top_p = top_p * top_p_decay
        if top_p_bound > 0.0:
            top_p = max(top_p, top_p_bound)
    return top_p


def _mark_finished_rows(done_token, is_generation_done, generated_lengths, context_length):
    """Record the rows that end at column context_length: their length becomes
    context_length + 1 (in place in generated_lengths [b]).

    Returns:
        (the updated done flags [b] uint8, whether every row is done [1] uint8).
    """
    just_finished = (done_token & ~is_generation_done).bool()
    generated_lengths[just_finished.view(-1)] = context_length + 1
    is_generation_done = is_generation_done | done_token
    return is_generation_done, torch.all(is_generation_done).to(torch.uint8).view(1)


def _next_beams(candidates, beam_size, stop_token, beam_hyp, tokens, generated_length):
    """The beams to continue, from the 2 * beam_size best (token, score, beam) candidates in
    rank order: a stop token ranked within the first beam_size finishes its beam's hypothesis
    (added to beam_hyp as its row stands); the first beam_size other candidates continue.

    Returns:
        list of (token id, score, beam id), beam_size long.
    """
    next_beams = []
    for rank, (token_id, beam_score, beam_id) in enumerate(zip(*candidates)):
        if token_id.item() == stop_token:
            if rank >= beam_size:
                continue
            beam_hyp.add(tokens[beam_id].clone(), beam_score, generated_length)
        else:
            next_beams.append((token_id, beam_score, beam_id))
        if len(next_beams) == beam_size:
            break
    return next_beams


def _best_hypotheses_on_first_stage(beam_hyp, num_return_gen):
    """The num_return_gen best finished hypotheses of the last stage, by score, as
    (tokens [n, s'], scores [n]) on the first stage (their sizes broadcast first)."""
    scores = tokens = scores_size = tokens_size = None
    if mpu.is_pipeline_last_stage():
        device = get_current_device()
        sorted_hyps = sorted(beam_hyp.beams, key=lambda x: x[0], reverse=True)
        best = sorted_hyps[: min(num_return_gen, len(sorted_hyps))]
        scores = torch.stack([score for score, _ in best], dim=0)
        tokens = torch.stack([row for _, row in best])
        scores_size = torch.tensor(scores.shape, dtype=torch.int64, device=device)
        tokens_size = torch.tensor(tokens.shape, dtype=torch.int64, device=device)
    scores_size = broadcast_from_last_pipeline_stage(1, torch.int64, scores_size)
    tokens_size = broadcast_from_last_pipeline_stage(2, torch.int64, tokens_size)
    scores = broadcast_from_last_to_first_pipeline_stage(
        tuple(scores_size.tolist()), torch.float32, scores
    )
    tokens = broadcast_from_last_to_first_pipeline_stage(
        tuple(tokens_size.tolist()), torch.int64, tokens
    )
    return tokens, scores


def _build_attention_mask_and_position_ids(tokens):
    """(None, positions 0..s-1 for every row [b, s]).

    Megatron passes its left-to-right mask sliced to the fed columns ([..., prev:ctx, :ctx]).
    That is exactly the core attention's causal mask aligned to the last query, which the
    attention applies itself when the mask is None; it then runs through torch's fused
    scaled_dot_product_attention instead of materializing scores and a masked softmax.
    """
    _, _, position_ids = get_ltor_masks_and_position_ids(
        data=tokens,
        eod_token=None,
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
    )
    return None, position_ids
