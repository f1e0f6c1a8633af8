"""`PUT /api` on a vision-language (LLaVA) server: Megatron's request fields plus `"images"`,
a list of base64 PNG / JPEG images taken in order by the `<image>` markers of the prompts.

The answer keeps Megatron's shape: each `text` is the prompt followed by the generation (the
end-of-text token included when it came), `segments` the prompt's and the generation's token
strings with `<image>` for each image, and the prompts of a request run one after another (a
shorter prompt generates up to the longest prompt's positions + tokens_to_generate, as in
Megatron's padded batch). The generate() loop's batch rules (beam search, top_p decay, the
colon and newline rules) and log probabilities are not part of this path: HTTP 400. A model
that takes no images answers a request with `"images"` with HTTP 400.
"""

from flask import jsonify

from megatron.inference.text_generation.tokenization import eod_id, token_strings
from megatron.inference.vlm_inputs import (
    IMAGE_MARKER,
    api_images,
    api_prompt_ids,
    images_tensor,
)


def _unsupported(params):
    """The first field this path does not serve, or None."""
    if params['beam_width'] is not None:
        return 'beam_width'
    for name in ('top_p_decay', 'top_p_bound'):
        if params[name] > 0.0:
            return name
    for name in ('prevent_newline_after_colon', 'stop_on_eol', 'stop_on_double_eol', 'logprobs'):
        if params[name]:
            return name
    return None


def _segments(tokenizer, ids, placeholder):
    strings = token_strings(tokenizer, [t for t in ids if t != placeholder])
    out, k = [], 0
    for t in ids:
        if t == placeholder:
            out.append(IMAGE_MARKER)
        else:
            out.append(strings[k])
            k += 1
    return out


def vision_language_api(serving, params, body):
    """(answer, status) of a validated `PUT /api` request with (or on a server of) images."""
    from megatron.inference.sampling_from_api import engine_sampling_params

    if not serving.takes_images:
        return "images: this server's model takes no images (a text-only GPT model)", 400
    field = _unsupported(params)
    if field is not None:
        return f"{field} is not supported by a vision-language model's generation", 400
    tokenizer = serving.tokenizer
    try:
        images = api_images(body)
        bos = eod_id(tokenizer) if params['add_BOS'] else None
        rows = api_prompt_ids(tokenizer, params['prompts'], images, serving.placeholder, bos)
    except ValueError as exc:
        return str(exc), 400
    prompts = [ids for ids, _ in rows]
    pixels = [images_tensor(imgs, *serving.image_size) for _, imgs in rows]
    lengths = [serving.prompt_length(ids) for ids in prompts]
    choice_params = engine_sampling_params(params, lengths, eod_id(tokenizer))
    try:
        generation = serving.generation(prompts, choice_params, images=pixels)
    except ValueError as exc:
        return str(exc), 400
    generation.wait()
    if generation.error is not None:
        return f"generation failed: {generation.error}", 500
    texts, segments = [], []
    for prompt, choice in zip(params['prompts'], generation.choices):
        texts.append(prompt + (tokenizer.detokenize(choice.generated) if choice.generated else ''))
        segments.append(
            _segments(tokenizer, choice.prompt_ids + choice.generated, serving.placeholder)
        )
    return jsonify({"text": texts, "segments": segments, "logprobs": None})
