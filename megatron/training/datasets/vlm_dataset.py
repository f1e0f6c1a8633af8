"""Image-text samples for pretrain_vlm.py: the bundled digits captioned, a LLaVA-style JSON set,
and the batch getter.

Every sample is a dict of `tokens`, `labels`, `loss_mask`, `position_ids` (all [s]) and `image`
([3, img_h, img_w] float32), in later Megatron's placeholder layout: the image is one
`DEFAULT_IMAGE_TOKEN_INDEX` (-200) id in `tokens`, which LLaVAModel replaces by the image's
tokens and whose label and loss mask it expands. `labels[i]` is the target of `tokens[i]` (the
ids shifted left by one); the loss covers the answer and its end-of-document token only.
"""

import gzip
import json
import os
from typing import Dict, List, Sequence, Tuple

import numpy as np
import torch

from megatron.core.models.multimodal.llava_inputs import DEFAULT_IMAGE_TOKEN_INDEX
from megatron.core.utils import get_current_device

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
DIGITS_CSV = os.path.join(REPO, 'data', 'vision', 'digits.csv.gz')

NUMBER_WORDS = ['zero', 'one', 'two', 'three', 'four', 'five', 'six', 'seven', 'eight', 'nine']
DIGIT_PROMPT = 'which digit is this ?'
#: The word vocabulary of the digit captions, used with NullTokenizer (id = position here).
DIGIT_WORDS = ['<pad>', 'which', 'digit', 'is', 'this', '?', 'it', 'a', 'handwritten', '.'] + (
    NUMBER_WORDS
)
IMAGE_MARKER = '<image>'
#: CLIP's pixel statistics (later Megatron's CLIP_PIXEL_MEAN / CLIP_PIXEL_STD).
CLIP_PIXEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_PIXEL_STD = (0.26862954, 0.26130258, 0.27577711)


def digit_answer(label: int) -> str:
    """The caption of a digit image, e.g. 'it is a handwritten seven .'."""
    return f'it is a handwritten {NUMBER_WORDS[label]} .'


class TextEncoder:
    """Text -> ids: the digit word table under NullTokenizer (whose text is integer ids),
    otherwise the run's tokenizer."""

    def __init__(self, tokenizer, null_tokenizer: bool) -> None:
        self.tokenizer = tokenizer
        self.null = null_tokenizer
        self.eod = tokenizer.eod

    def __call__(self, text: str) -> List[int]:
        if self.null:
            unknown = [w for w in text.split() if w not in DIGIT_WORDS]
            if unknown:
                raise ValueError(
                    f"pretrain_vlm.py: with --tokenizer-type NullTokenizer only the digit caption "
                    f"words are known, got {unknown[:3]}; use a real tokenizer for other text"
                )
            return [DIGIT_WORDS.index(w) for w in text.split()]
        return list(self.tokenizer.tokenize(text))


def placeholder_sample(
    prompt: Sequence[int], answer: Sequence[int], eod: int, seq_length: int, image_first=True
) -> Dict[str, torch.Tensor]:
    """tokens/labels/loss_mask/position_ids [seq_length] for [image] + prompt + answer + [eod],
    padded with eod; the loss covers the answer and the eod. `prompt` may hold the placeholder
    itself (image_first=False)."""
    head = ([DEFAULT_IMAGE_TOKEN_INDEX] if image_first else []) + list(prompt)
    ids = head + list(answer) + [eod]
    if len(ids) > seq_length + 1:
        raise ValueError(
            f"pretrain_vlm.py: --seq-length {seq_length} is too short for a sample of "
            f"{len(ids) - 1} text tokens (placeholder, prompt and answer)"
        )
    target = [0.0] * (len(head) - 1) + [1.0] * (len(answer) + 1)
    pad = seq_length + 1 - len(ids)
    ids = ids + [eod] * pad
    target = target + [0.0] * (seq_length - len(target))
    return {
        'tokens': torch.tensor(ids[:seq_length], dtype=torch.int64),
        'labels': torch.tensor(ids[1:], dtype=torch.int64),
        'loss_mask': torch.tensor(target, dtype=torch.float32),
        'position_ids': torch.arange(seq_length, dtype=torch.int64),
    }


def load_digits(path: str = DIGITS_CSV) -> Tuple[np.ndarray, np.ndarray]:
    """(pixels [n, 8, 8] in 0..16, labels [n]) of the bundled digits CSV."""
    with gzip.open(path, 'rt') as f:
        rows = np.loadtxt(f, delimiter=',', dtype=np.int64)
    return rows[:, :64].reshape(-1, 8, 8), rows[:, 64]


def digit_image(pixels: np.ndarray, img_h: int, img_w: int) -> torch.Tensor:
    """An 8x8 grey digit -> [3, img_h, img_w], nearest-neighbour scaled, CLIP-normalised."""
    if img_h % 8 or img_w % 8:
        raise ValueError(
            f"pretrain_vlm.py: the bundled digits are 8x8 pixels; --img-h {img_h} and --img-w "
            f"{img_w} must be multiples of 8"
        )
    grey = torch.from_numpy(pixels.astype(np.float32) / 16.0)
    grey = grey.repeat_interleave(img_h // 8, 0).repeat_interleave(img_w // 8, 1)  # [H, W]
    mean = torch.tensor(CLIP_PIXEL_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_PIXEL_STD).view(3, 1, 1)
    return (grey.unsqueeze(0).expand(3, -1, -1) - mean) / std  # [3, H, W]


class DigitCaptionDataset(torch.utils.data.Dataset):
    """The bundled handwritten digits as image-text pairs: "which digit is this ?" ->
    "it is a handwritten seven .". The first 80% of a seeded permutation is the training
    split, the rest validation; indices wrap around (a new permutation each pass), so any
    sample count is served."""

    def __init__(self, split, num_samples, encode, seq_length, img_h, img_w, seed) -> None:
        pixels, labels = load_digits()
        order = np.random.RandomState(seed).permutation(len(labels))
        cut = int(0.8 * len(labels))
        self.indices = order[:cut] if split == 'train' else order[cut:]
        self.pixels, self.labels = pixels, labels
        self.num_samples = max(int(num_samples), len(self.indices))
        self.seed, self.seq_length, self.img_h, self.img_w = seed, seq_length, img_h, img_w
        self.prompt = encode(DIGIT_PROMPT)
        self.answers = [encode(digit_answer(d)) for d in range(10)]
        self.eod = encode.eod
        placeholder_sample(self.prompt, max(self.answers, key=len), self.eod, seq_length)

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        epoch, pos = divmod(int(idx), len(self.indices))
        if epoch:
            pos = np.random.RandomState(self.seed + epoch).permutation(len(self.indices))[pos]
        k = self.indices[pos]
        label = int(self.labels[k])
        sample = placeholder_sample(self.prompt, self.answers[label], self.eod, self.seq_length)
        sample['image'] = digit_image(self.pixels[k], self.img_h, self.img_w)
        return sample


def read_image(path: str, img_h: int, img_w: int) -> torch.Tensor:
    """An image file -> [3, img_h, img_w]: RGB, squashed to the size (bicubic, as later
    Megatron does), CLIP-normalised. An unreadable file is a one-line error naming it."""
    from PIL import Image

    try:
        with Image.open(path) as img:
            img = img.convert('RGB').resize((img_w, img_h), Image.Resampling.BICUBIC)
            array = np.asarray(img, dtype=np.float32) / 255.0  # [H, W, 3]
    except (OSError, ValueError) as exc:
        raise ValueError(f"pretrain_vlm.py: cannot decode image {path}: {exc}") from None
    pixels = torch.from_numpy(array).permute(2, 0, 1)  # [3, H, W]
    mean = torch.tensor(CLIP_PIXEL_MEAN).view(3, 1, 1)
    std = torch.tensor(CLIP_PIXEL_STD).view(3, 1, 1)
    return (pixels - mean) / std


class LlavaJsonDataset(torch.utils.data.Dataset):
    """A LLaVA-style JSON (a list) or JSONL file of {"image": path relative to the file's folder,
    "conversations": [{"from": "human", "value": "<image>\\n..."}, {"from": "gpt", ...}]}.

    One image per record, marked by one `<image>` in the first human turn (placed first when the
    marker is missing, as LLaVA's pretraining captions do); the loss covers the gpt turns."""

    def __init__(self, path, num_samples, encode, seq_length, img_h, img_w) -> None:
        with open(path) as f:
            text = f.read()
        stripped = text.lstrip()
        if stripped.startswith('['):
            self.records = json.loads(text)
        else:
            self.records = [json.loads(line) for line in text.splitlines() if line.strip()]
        if not self.records:
            raise ValueError(f"pretrain_vlm.py: {path} holds no samples")
        self.folder = os.path.dirname(os.path.abspath(path))
        self.num_samples = max(int(num_samples), len(self.records))
        self.encode, self.seq_length, self.img_h, self.img_w = encode, seq_length, img_h, img_w

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        record = self.records[int(idx) % len(self.records)]
        prompt, answer = [], []
        for turn in record['conversations']:
            value = turn['value']
            if turn['from'] == 'human':
                markers = value.count(IMAGE_MARKER)
                if markers > 1:
                    raise ValueError(
                        f"pretrain_vlm.py: record {record.get('id', idx)} has {markers} "
                        f"{IMAGE_MARKER} markers for its 1 image"
                    )
                before, _, after = value.rpartition(IMAGE_MARKER)
                if markers:
                    prompt += self.encode(before) if before.strip() else []
                    prompt.append(DEFAULT_IMAGE_TOKEN_INDEX)
                prompt += self.encode(after) if after.strip() else []
            else:
                answer += self.encode(value)
        if DEFAULT_IMAGE_TOKEN_INDEX not in prompt:
            prompt = [DEFAULT_IMAGE_TOKEN_INDEX] + prompt
        sample = placeholder_sample(
            prompt, answer, self.encode.eod, self.seq_length, image_first=False
        )
        image_path = os.path.join(self.folder, record['image'])
        sample['image'] = read_image(image_path, self.img_h, self.img_w)
        return sample


def vlm_batch(data_iterator) -> Dict[str, torch.Tensor]:
    """The next micro-batch on this rank's device (every rank reads its own, as the vision
    scripts do: the samples are a pure function of their index)."""
    batch = next(data_iterator)
    device = get_current_device()
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
