"""The image inputs of a LLaVA server (megatron/inference/vlm_inputs.py): preprocessing equal to
transformers' CLIPImageProcessor for LLaVA on portrait, landscape, square and odd sizes; data
URLs only; the `<image>` markers one placeholder id per image, counted against the images."""

import base64
import io

import numpy as np
import pytest
import torch

from megatron.inference import vlm_inputs as vi

P = -200


def _image(h, w, seed=0):
    from PIL import Image

    pixels = np.random.RandomState(seed).randint(0, 256, (h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize("h, w, size", [(20, 28, 16), (37, 23, 16), (16, 16, 16), (50, 61, 24)])
def test_preprocessing_equals_clip_image_processor(h, w, size):
    transformers = pytest.importorskip("transformers")
    processor = transformers.CLIPImageProcessorPil(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    )
    img = _image(h, w)
    theirs = processor(images=img, return_tensors="pt")["pixel_values"][0]
    ours = vi.preprocess_image(img, size, size)
    assert ours.shape == (3, size, size) and ours.dtype == torch.float32
    assert (ours - theirs).abs().max().item() < 1e-5


def _png_base64():
    buf = io.BytesIO()
    _image(8, 8).save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode()


def test_only_data_urls_are_read():
    img = vi.image_from_url("data:image/png;base64," + _png_base64(), "x")
    assert img.size == (8, 8) and img.mode == "RGB"
    for url, reason in (
        ("https://example.com/cat.png", "not 'https'"),
        ("file:///etc/passwd", "not 'file'"),
        ("data:text/plain;base64,aGk=", "data:image/<type>;base64,<data>"),
        ("data:image/png;base64,%%%", "x is not valid base64"),
        ("data:image/png;base64,aGVsbG8=", "x is not a decodable image"),
    ):
        with pytest.raises(ValueError) as err:
            vi.image_from_url(url, "x")
        assert reason in str(err.value) and "\n" not in str(err.value)


def test_markers_become_placeholders_and_are_counted():
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    tok = _NullTokenizer(100)
    assert vi.ids_with_images(tok, "1 2 <image> 3", 1, P, "p") == [1, 2, P, 3]
    assert vi.ids_with_images(tok, "<image><image>4", 2, P, "p") == [P, P, 4]
    with pytest.raises(ValueError, match=r"p holds 1 image placeholder\(s\) .* gives 2 image"):
        vi.ids_with_images(tok, "<image> 5", 2, P, "p")
    rows = vi.api_prompt_ids(tok, ["<image> 1", "2", "3 <image>"], ["a", "b"], P)
    assert rows == [([P, 1], ["a"]), ([2], []), ([3, P], ["b"])]
    with pytest.raises(ValueError, match="the prompts hold 2 .* images holds 1"):
        vi.api_prompt_ids(tok, ["<image> 1", "<image>"], ["a"], P)


def test_chat_image_parts_become_markers_in_place():
    url = "data:image/png;base64," + _png_base64()
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "look: "},
                                     {"type": "image_url", "image_url": {"url": url}},
                                     {"type": "text", "text": " what?"}]},
    ]  # fmt: skip
    out, images = vi.split_image_parts(messages)
    assert out[0] == messages[0]
    assert out[1] == {"role": "user", "content": "look: <image> what?"}
    assert len(images) == 1
    with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\] must be"):
        vi.split_image_parts([{"role": "user", "content": [{"type": "audio"}]}])
