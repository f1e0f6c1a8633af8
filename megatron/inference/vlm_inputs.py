"""The image inputs of a vision-language (LLaVA) server: decoding, preprocessing and the prompt
ids that carry the image placeholder.

Images arrive as base64 PNG / JPEG (`PUT /api`'s `"images"`) or as OpenAI image content parts
whose `image_url.url` is a `data:image/...;base64,` URL (`/v1/chat/completions`); any other URL
(http, https, file, ...) is refused, so the server never reaches the network or the disk for a
request. Each image becomes one placeholder id in the prompt, where the `<image>` marker stands
in the prompt text (chat: where the image part sits in its message); the language model sees
its image tokens there.

Preprocessing is CLIPImageProcessor's for LLaVA: RGB, the shortest edge resized to the crop
size (bicubic), a center crop to --img-h x --img-w, pixels / 255, then CLIP's mean and std.
Every refusal is a `ValueError` of one line, answered with HTTP 400.
"""

import base64
import binascii
import io
from typing import List, Sequence, Tuple

import numpy as np
import torch

from megatron.legacy.data.image_transforms import CLIP_PIXEL_MEAN, CLIP_PIXEL_STD

#: The text that stands for one image in a prompt (LLaVA's marker).
IMAGE_MARKER = "<image>"
#: Most images one request may carry.
MAX_IMAGES = 16
_DATA_PREFIX = "data:"


def decode_image(data: bytes, name: str):
    """Image bytes -> an RGB PIL image; ValueError naming `name` if Pillow cannot read them."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            return img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ValueError(f"{name} is not a decodable image: {type(exc).__name__}: {exc}") from None


def image_from_base64(text, name: str):
    """A base64 string (PNG / JPEG bytes) -> an RGB PIL image."""
    if not isinstance(text, str):
        raise ValueError(f"{name} must be a base64 string, got a {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"{name} is not valid base64: {exc}") from None
    return decode_image(data, name)


def image_from_url(url, name: str):
    """An OpenAI image URL: only `data:image/...;base64,...` is read (no network fetches)."""
    if not isinstance(url, str):
        raise ValueError(f"{name} must be a string URL, got a {type(url).__name__}")
    if not url.startswith(_DATA_PREFIX):
        scheme = url.split(":", 1)[0] if ":" in url else url[:20]
        raise ValueError(
            f"{name}: only data:image/...;base64 URLs are accepted, not {scheme!r:.40} "
            f"(the server fetches nothing from the network or the disk)"
        )
    header, sep, payload = url[len(_DATA_PREFIX) :].partition(",")
    if not sep or not header.endswith(";base64") or not header.startswith("image/"):
        raise ValueError(f"{name}: a data URL must read data:image/<type>;base64,<data>")
    return image_from_base64(payload, name)


def preprocess_image(img, img_h: int, img_w: int) -> torch.Tensor:
    """An RGB PIL image -> [3, img_h, img_w] float32, as CLIPImageProcessor prepares LLaVA's
    input: the shortest edge resized to max(img_h, img_w) (the longer one in proportion,
    truncated), bicubic; a center crop; / 255; (x - CLIP mean) / CLIP std."""
    from PIL import Image

    size = max(img_h, img_w)
    w, h = img.size
    if w <= h:
        new_w, new_h = size, int(size * h / w)
    else:
        new_w, new_h = int(size * w / h), size
    img = img.resize((new_w, new_h), Image.Resampling.BICUBIC)
    top, left = (new_h - img_h) // 2, (new_w - img_w) // 2
    img = img.crop((left, top, left + img_w, top + img_h))
    pixels = np.asarray(img, dtype=np.float32) / np.float32(255.0)  # [H, W, 3]
    mean = np.asarray(CLIP_PIXEL_MEAN, dtype=np.float32)
    std = np.asarray(CLIP_PIXEL_STD, dtype=np.float32)
    pixels = (pixels - mean) / std
    return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))  # [3, H, W]


def images_tensor(images: Sequence, img_h: int, img_w: int) -> torch.Tensor:
    """PIL images -> [n, 3, img_h, img_w] (n may be 0)."""
    if not images:
        return torch.zeros(0, 3, img_h, img_w)
    return torch.stack([preprocess_image(img, img_h, img_w) for img in images])


def _encode_piece(tokenizer, piece: str) -> List[int]:
    """Ids of one stretch of text between image markers, without special tokens added (as a
    chat template tokenizes its rendered text)."""
    if not piece:
        return []
    from megatron.training.tokenizer.tokenizer import _NullTokenizer

    if isinstance(tokenizer, _NullTokenizer):
        return [int(x) for x in piece.split()]
    hf = getattr(tokenizer, "_tokenizer", None)
    if hf is not None and hasattr(hf, "encode"):
        return list(hf.encode(piece, add_special_tokens=False))
    return list(tokenizer.tokenize(piece))


def ids_with_images(tokenizer, text: str, num_images: int, placeholder: int, name: str):
    """The prompt ids of `text`, each `<image>` marker one `placeholder` id.

    Raises:
        ValueError: the markers are not one per image, or the text cannot be tokenized.
    """
    pieces = text.split(IMAGE_MARKER)
    if len(pieces) - 1 != num_images:
        raise ValueError(
            f"{name} holds {len(pieces) - 1} image placeholder(s) ({IMAGE_MARKER}) but the "
            f"request gives {num_images} image(s) for it"
        )
    ids: List[int] = []
    try:
        for i, piece in enumerate(pieces):
            if i:
                ids.append(placeholder)
            ids.extend(_encode_piece(tokenizer, piece))
    except Exception as exc:  # the request's text, not the server's fault
        raise ValueError(f"{name} cannot be tokenized: {type(exc).__name__}: {exc}") from None
    return ids


def split_image_parts(messages) -> Tuple[list, list]:
    """OpenAI messages whose content may be a list of parts -> (messages with string content,
    each image part replaced by the `<image>` marker and text parts joined as they are; the
    PIL images in order). Other roles and string contents pass through unchanged."""
    if not isinstance(messages, list):
        return messages, []
    out, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            out.append(message)
            continue
        texts = []
        for j, part in enumerate(content):
            name = f"messages[{i}].content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                texts.append(part["text"])
            elif kind == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else image_url
                images.append(image_from_url(url, name))
                texts.append(IMAGE_MARKER)
            else:
                raise ValueError(
                    f"{name} must be {{'type': 'text', 'text': ...}} or "
                    f"{{'type': 'image_url', 'image_url': {{'url': 'data:image/...'}}}}"
                )
            if len(images) > MAX_IMAGES:
                raise ValueError(f"a request may carry at most {MAX_IMAGES} images")
        out.append(dict(message, content="".join(texts)))
    return out, images


def api_images(body) -> list:
    """`PUT /api`'s `"images"` (a list of base64 PNG / JPEG strings) -> PIL images."""
    images = body.get("images", [])
    if not isinstance(images, list):
        raise ValueError("images must be a list of base64-encoded PNG or JPEG strings")
    if len(images) > MAX_IMAGES:
        raise ValueError(f"images holds {len(images)} images, at most {MAX_IMAGES}")
    return [image_from_base64(data, f"images[{i}]") for i, data in enumerate(images)]


def api_prompt_ids(tokenizer, prompts, images, placeholder, add_bos_id=None):
    """Each prompt's ids and its images: the `<image>` markers of all prompts take the images
    in order. Returns [(ids, [PIL images])]."""
    markers = [p.count(IMAGE_MARKER) for p in prompts]
    if sum(markers) != len(images):
        raise ValueError(
            f"the prompts hold {sum(markers)} image placeholder(s) ({IMAGE_MARKER}) but "
            f"images holds {len(images)}"
        )
    rows, start = [], 0
    for i, (prompt, k) in enumerate(zip(prompts, markers)):
        ids = ids_with_images(tokenizer, prompt, k, placeholder, f"prompts[{i}]")
        if add_bos_id is not None:
            ids = [add_bos_id] + ids
        if not ids:
            raise ValueError(f"prompts[{i}] has no tokens")
        rows.append((ids, images[start : start + k]))
        start += k
    return rows
