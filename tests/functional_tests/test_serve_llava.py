"""A LLaVA checkpoint served with images, as users serve it.

A tiny random Hugging Face LlavaForConditionalGeneration (Llama text model, 2-layer CLIP tower,
feature layer -2, class token dropped) with a tiny ChatML tokenizer that knows `<image>` is
converted by tools/checkpoint/convert.py --model-type LLAVA and served by
tools/run_text_generation_server.py (one process, loopback port, always stopped). A chat request
with one OpenAI image part and a `PUT /api` request with one base64 image give transformers'
greedy tokens (`generate` on the same prompt, the image preprocessed by its CLIPImageProcessor);
an http URL, undecodable base64 and a count of images that is not the count of placeholders
are refused with HTTP 400 in one line.
"""

import base64
import io
import json

import numpy as np
import pytest

from tests.functional_tests.server_utils import REQUEST_TIMEOUT, Server

requests = pytest.importorskip("requests")
pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("flask_restful")

STEPS = 6
QUESTION = "What is the title of chapter 12?"


def _hf_llava(vocab, image_id):
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    from tests.unit_tests.models import vision_test_utils as vu

    vision = CLIPVisionConfig(
        hidden_size=vu.HIDDEN, intermediate_size=vu.FFN, num_hidden_layers=vu.LAYERS,
        num_attention_heads=vu.HEADS, image_size=vu.IMG, patch_size=vu.PATCH,
        hidden_act='quick_gelu', attention_dropout=0.0,
    )  # fmt: skip
    text = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-6,
        max_position_embeddings=128, tie_word_embeddings=False,
    )  # fmt: skip
    config = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=image_id,
        image_seq_length=(vu.IMG // vu.PATCH) ** 2, vision_feature_layer=-2,
        vision_feature_select_strategy='default', projector_hidden_act='gelu',
        multimodal_projector_bias=True, tie_word_embeddings=False,
    )  # fmt: skip
    import torch

    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _png(seed, size=(20, 28)):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (*size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def _hf_greedy(hf, tokenizer, text, png):
    """transformers' greedy new ids for `text` (one `<image>`) and the image."""
    import torch
    from PIL import Image
    from transformers import CLIPImageProcessorPil

    from tests.unit_tests.models import vision_test_utils as vu

    processor = CLIPImageProcessorPil(
        size={"shortest_edge": vu.IMG}, crop_size={"height": vu.IMG, "width": vu.IMG}
    )
    pixels = processor(images=Image.open(io.BytesIO(png)), return_tensors="pt")["pixel_values"]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    image_id = hf.config.image_token_index
    expanded = []
    for t in ids:
        expanded += [image_id] * hf.config.image_seq_length if t == image_id else [t]
    ids = torch.tensor([expanded])
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pixels,
            max_new_tokens=STEPS, do_sample=False,
        )  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


@pytest.fixture(scope="module")
def llava_server(tmp_path_factory):
    from transformers import AutoTokenizer

    from tests.functional_tests import convert_utils as cu
    from tests.unit_tests.data.sft_utils import build_chat_tokenizer

    root = tmp_path_factory.mktemp("serve_llava")
    hf_dir, ckpt = str(root / "hf"), str(root / "ckpt")
    build_chat_tokenizer(hf_dir, extra_special=("<image>",))
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    hf = _hf_llava(len(tokenizer), tokenizer.convert_tokens_to_ids("<image>"))
    hf.save_pretrained(hf_dir)
    cu.convert(
        "--model-type", "LLAVA", "--loader", "hf", "--saver", "mcore",
        "--load-dir", hf_dir, "--save-dir", ckpt,
    )  # fmt: skip
    flags = ["--load", ckpt, "--use-checkpoint-args", "--tokenizer-type", "HuggingFaceTokenizer",
             "--tokenizer-model", hf_dir]  # fmt: skip
    srv = Server(ckpt, 1, str(root / "server.log"), flags=flags)
    try:
        yield srv, hf, tokenizer
    finally:
        srv.stop()


def _data_url(png):
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _chat(server, content, **extra):
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": STEPS,
            "temperature": 0, **extra}  # fmt: skip
    return requests.post(server.url + "/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT)


def _until_eos(ids, tokenizer):
    eos = tokenizer.convert_tokens_to_ids(tokenizer.eos_token)
    return ids[: ids.index(eos)] if eos in ids else ids


def test_chat_and_api_with_an_image_give_transformers_greedy_tokens(llava_server):
    server, hf, tokenizer = llava_server
    png = _png(1)
    parts = [{"type": "image_url", "image_url": {"url": _data_url(png)}},
             {"type": "text", "text": "\n" + QUESTION}]  # fmt: skip
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>\n" + QUESTION}], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    want = _until_eos(_hf_greedy(hf, tokenizer, text, png), tokenizer)
    answer = _chat(server, parts)
    assert answer.status_code == 200, (answer.text, server.read_log())
    body = answer.json()
    assert body["choices"][0]["message"]["content"] == tokenizer.decode(want)
    assert body["usage"]["completion_tokens"] == len(want)
    assert body["usage"]["prompt_tokens"] == len(tokenizer(text)["input_ids"]) + 15
    streamed = _chat(server, parts, stream=True)
    pieces = [
        json.loads(line[len("data: ") :])["choices"][0]["delta"].get("content", "")
        for line in streamed.text.splitlines()
        if line.startswith("data: {")
    ]
    assert "".join(pieces) == tokenizer.decode(want)

    prompt = "<image> " + QUESTION
    want = _hf_greedy(hf, tokenizer, prompt, _png(2))
    put = server.put({"prompts": [prompt], "images": [base64.b64encode(_png(2)).decode()],
                      "tokens_to_generate": STEPS, "top_k": 1, "no_log": True})  # fmt: skip
    assert put.status_code == 200, (put.text, server.read_log())
    segments = put.json()["segments"][0]
    assert segments[-len(want) :] == tokenizer.convert_ids_to_tokens(want)
    assert segments.count("<image>") == 1


def test_bad_image_inputs_are_refused_in_one_line(llava_server):
    server, _, _ = llava_server
    web = _chat(server, [{"type": "image_url", "image_url": {"url": "http://example.com/a.png"}},
                         {"type": "text", "text": "hi"}])  # fmt: skip
    assert web.status_code == 400
    message = web.json()["error"]["message"]
    assert "only data:image/...;base64 URLs are accepted, not 'http'" in message
    assert "\n" not in message
    garbage = _chat(
        server,
        [{"type": "image_url", "image_url": {"url": "data:image/png;base64,bm90IGFuIGltYWdl"}}],
    )
    assert garbage.status_code == 400
    assert garbage.json()["error"]["message"].startswith(
        "messages[0].content[0] is not a decodable image"
    )
    extra = _chat(server, "<image> and <image>")
    assert extra.status_code == 400
    assert (
        "holds 2 image placeholder(s) (<image>) but the request gives 0"
        in (extra.json()["error"]["message"])
    )
    image = base64.b64encode(_png(3)).decode()
    missing = server.put({"prompts": ["no marker"], "images": [image], "no_log": True})
    assert missing.status_code == 400
    assert missing.json() == (
        "the prompts hold 0 image placeholder(s) (<image>) but images holds 1"
    )
    bad = server.put({"prompts": ["<image>"], "images": ["@@@"], "no_log": True})
    assert bad.status_code == 400 and bad.json().startswith("images[0] is not valid base64")
    # The server goes on serving, text-only requests included.
    assert _chat(server, "hello", max_tokens=2).status_code == 200
    text = requests.post(
        server.url + "/v1/completions",
        json={"prompt": "Call me", "max_tokens": 3, "temperature": 0},
        timeout=REQUEST_TIMEOUT,
    )
    assert text.status_code == 200 and text.json()["usage"]["completion_tokens"] <= 3
    health = requests.get(server.url + "/health", timeout=REQUEST_TIMEOUT).json()
    assert health["ready"] is True


def test_tensor_parallel_server_with_an_image(llava_server):
    """Two ranks (the checkpoint converted to TP 2): rank 1 follows rank 0's broadcasts of the
    prompt, the image and each sampled token; the answer is the same."""
    from tests.functional_tests import convert_utils as cu

    server, hf, tokenizer = llava_server
    root = server.log_path.rsplit("/", 1)[0]
    ckpt, tp2 = server.flags[1], root + "/ckpt_tp2"
    cu.convert(
        "--model-type", "LLAVA", "--loader", "mcore", "--saver", "mcore",
        "--load-dir", ckpt, "--save-dir", tp2, "--target-tensor-parallel-size", "2",
    )  # fmt: skip
    png = _png(4)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "<image>" + QUESTION}], tokenize=False,
        add_generation_prompt=True,
    )  # fmt: skip
    want = tokenizer.decode(_until_eos(_hf_greedy(hf, tokenizer, text, png), tokenizer))
    parts = [{"type": "image_url", "image_url": {"url": _data_url(png)}},
             {"type": "text", "text": QUESTION}]  # fmt: skip
    flags = ["--load", tp2] + server.flags[2:]
    srv = Server(tp2, 2, root + "/server_tp2.log", flags=flags)
    try:
        answers = [_chat(srv, parts) for _ in range(2)]
        for answer in answers:
            assert answer.status_code == 200, (answer.text, srv.read_log())
            assert answer.json()["choices"][0]["message"]["content"] == want
    finally:
        srv.stop()
