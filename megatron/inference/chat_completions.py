"""`POST /v1/chat/completions`: OpenAI's chat protocol on the text generation server.

The conversation (`messages`, OpenAI-style `{"role", "content"}` objects) is rendered up to the
assistant's turn by the tokenizer's chat template (`megatron/training/tokenizer/chat_template.py`:
a Hugging Face tokenizer's `chat_template`, or an `SFTTokenizer`'s prompt format, which renders
exactly the tokens the model was fine-tuned on); a tokenizer without one answers HTTP 400 saying
which tokenizer flags give one. The prompt then runs on the dynamic-batching engine like a
completion, and generation stops at the tokenizer's end-of-text token (for a chat template, the
end of the assistant's turn), `max_tokens` / `max_completion_tokens` (default: up to the maximum
sequence length), or a `stop` string.

Fields: `messages`, `model`, `max_tokens` / `max_completion_tokens`, `temperature` (0: greedy),
`top_p`, `n` (1), `stop`, `seed`, `ignore_eos`, `logprobs` (bool: the returned tokens' log
probabilities), `top_logprobs` (0 only), `stream` (`chat.completion.chunk` events, the first
with the assistant's role) with `stream_options.include_usage`, `chat_template_kwargs` (passed
to a Hugging Face template). Tools, functions, penalties, `logit_bias` and structured outputs are
refused with HTTP 400.

On a vision-language (LLaVA) server a message's `content` may be a list of OpenAI parts:
`{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}`; each image stands where its part sits in the message (any other
URL scheme is refused with HTTP 400: the server fetches nothing).
"""

import time
import uuid

from flask import jsonify

from megatron.inference.completions import (
    UNSUPPORTED,
    CompletionError,
    check_length,
    error_of,
    error_response,
    parse_max_tokens,
    parse_sampling,
    parse_stop,
    parse_stream_options,
    refuse_unsupported,
    sampling_params,
    start_generation,
    stream_events,
    usage,
)
from megatron.inference.json_io import BadRequest, read_json_object
from megatron.training.tokenizer.chat_template import chat_prompt_token_ids

CHAT_UNSUPPORTED = dict(
    UNSUPPORTED,
    tools=(None, []),
    tool_choice=(None, "none"),
    functions=(None, []),
    function_call=(None, "none"),
    response_format=(None, {"type": "text"}),
)
del CHAT_UNSUPPORTED["suffix"], CHAT_UNSUPPORTED["echo"], CHAT_UNSUPPORTED["best_of"]


def parse_chat_request(body, limits):
    """Validate a chat completions body (CompletionError naming the field)."""
    if "messages" not in body:
        raise CompletionError("Missing 'messages' field", "messages")
    params = {"messages": body["messages"]}
    max_tokens = parse_max_tokens(body, limits, "max_completion_tokens", default=None)
    if max_tokens is None:
        max_tokens = parse_max_tokens(body, limits, "max_tokens", default=None)
    params["max_tokens"] = max_tokens
    params.update(parse_sampling(body))
    params["stops"] = parse_stop(body)
    logprobs = body.get("logprobs", False)
    if logprobs is None:
        logprobs = False
    if not isinstance(logprobs, bool):
        raise CompletionError(f"'logprobs' must be a boolean, got {logprobs!r}", "logprobs")
    params["logprobs"] = logprobs
    if body.get("top_logprobs") not in (None, 0):
        raise CompletionError(
            f"'top_logprobs' = {body['top_logprobs']!r} is not supported (0 only)", "top_logprobs"
        )
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise CompletionError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    params["template_kwargs"] = kwargs
    params["stream"], params["include_usage"], model = parse_stream_options(body)
    refuse_unsupported(body, CHAT_UNSUPPORTED)
    params["model"] = model or limits.get('model_name')
    return params


def _prompt_ids(tokenizer, params):
    try:
        ids = chat_prompt_token_ids(
            tokenizer, params["messages"], template_kwargs=params["template_kwargs"]
        )
    except ValueError as exc:
        raise CompletionError(str(exc), "messages") from None
    if not ids:
        raise CompletionError("the chat template rendered no tokens", "messages")
    return ids


def _has_image_part(messages) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict)
        and isinstance(m.get("content"), list)
        and any(isinstance(p, dict) and p.get("type") == "image_url" for p in m["content"])
        for m in messages
    )


def _prompt_and_images(serving, params):
    """(prompt ids, [images tensor] or None). A vision-language server reads OpenAI's image
    content parts: each becomes the `<image>` marker in its message's text, then one placeholder
    id in the rendered prompt (vlm_inputs.py)."""
    if not serving.takes_images:
        if _has_image_part(params["messages"]):
            raise CompletionError(
                "this server's model takes no images (a text-only GPT model): image_url content "
                "parts need a vision-language (LLaVA) checkpoint",
                "messages",
            )
        return _prompt_ids(serving.tokenizer, params), None
    from megatron.inference.vlm_inputs import ids_with_images, images_tensor, split_image_parts
    from megatron.training.tokenizer.chat_template import apply_chat_template

    try:
        messages, images = split_image_parts(params["messages"])
        text = apply_chat_template(
            serving.tokenizer, messages, template_kwargs=params["template_kwargs"]
        )
        ids = ids_with_images(serving.tokenizer, text, len(images), serving.placeholder, "messages")
    except ValueError as exc:
        raise CompletionError(str(exc), "messages") from None
    if not ids:
        raise CompletionError("the chat template rendered no tokens", "messages")
    return ids, [images_tensor(images, *serving.image_size)]


def _logprobs_content(choice, generated):
    """OpenAI's chat logprobs: one entry per returned token."""
    content = []
    for token_id, logprob in zip(generated, choice.log_probs or []):
        piece = choice.tokenizer.detokenize([token_id])
        content.append(
            {
                "token": piece,
                "logprob": logprob,
                "bytes": list(piece.encode("utf-8")),
                "top_logprobs": [],
            }
        )
    return {"content": content}


def _chat(serving, limits, body):
    params = parse_chat_request(body, limits)
    ids, images = _prompt_and_images(serving, params)
    length = serving.prompt_length(ids)
    if params["max_tokens"] is None:
        params["max_tokens"] = max(1, limits['max_sequence_length'] - length)
    check_length(length, params["max_tokens"], limits)
    generation = start_generation(
        serving, [ids], [sampling_params(params, params["max_tokens"])], params["stops"], images
    )
    meta = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time())}
    meta["model"] = params["model"]
    if params["stream"]:
        started = []

        def chunk_of(index, text, finish, choice):
            delta = {"content": text} if text else {}
            if not started:
                # OpenAI's first chunk carries the role.
                delta = dict({"role": "assistant", "content": ""}, **delta)
                started.append(True)
            if not delta and finish is None:
                return None
            block = None
            if finish is not None and params["logprobs"]:
                block = _logprobs_content(choice, choice.completion()[1])
            out = {"index": index, "delta": delta, "logprobs": block, "finish_reason": finish}
            return {"object": "chat.completion.chunk", "choices": [out]}

        return stream_events(generation, meta, params, [length], chunk_of, "chat.completion.chunk")
    generation.wait()
    generation.log(meta["id"], params["max_tokens"])
    if generation.error is not None:
        raise CompletionError(generation.error, status=500, kind='server_error')
    (choice,) = generation.choices
    text, generated, finish = choice.completion()
    out = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": _logprobs_content(choice, generated) if params["logprobs"] else None,
        "finish_reason": finish,
    }
    return jsonify(
        dict(
            meta,
            object="chat.completion",
            choices=[out],
            usage=usage([length], len(generated)),
        )
    )


def register_chat_completions(app, serving, limits, model_name):
    """Add `POST /v1/chat/completions` to the Flask app."""
    limits = dict(limits, model_name=model_name)

    @app.route('/v1/chat/completions', methods=['POST'])
    def chat_completions():
        try:
            return _chat(serving, limits, read_json_object(limits['max_request_bytes']))
        except BadRequest as exc:
            return error_response(str(exc))
        except CompletionError as exc:
            return error_of(exc)
