"""Text helpers of the fine-tuning tasks, as in Megatron's tasks/data_utils.py."""

import re

import numpy as np


def clean_text(text):
    """Newlines to spaces, whitespace runs to one space, ' . ' to '. ' (ends kept)."""
    text = text.replace("\n", " ")
    text = re.sub(r'\s+', ' ', text)
    for _ in range(3):
        text = text.replace(' . ', '. ')
    return text


def build_sample(ids, types, paddings, label, unique_id):
    """The sample dict the fine-tuning loaders batch."""
    return {
        'text': np.array(ids, dtype=np.int64),
        'types': np.array(types, dtype=np.int64),
        'padding_mask': np.array(paddings, dtype=np.int64),
        'label': int(label),
        'uid': int(unique_id),
    }


def build_tokens_types_paddings_from_text(text_a, text_b, tokenizer, max_seq_length):
    """[CLS] A [SEP] (B [SEP]) PAD... from text, with the tokenizer's cls/sep/pad ids."""
    text_a_ids = tokenizer.tokenize(text_a)
    text_b_ids = None
    if text_b is not None:
        text_b_ids = tokenizer.tokenize(text_b)
    return build_tokens_types_paddings_from_ids(
        text_a_ids, text_b_ids, max_seq_length, tokenizer.cls, tokenizer.sep, tokenizer.pad
    )


def build_tokens_types_paddings_from_ids(
    text_a_ids, text_b_ids, max_seq_length, cls_id, sep_id, pad_id
):
    """Megatron's pair layout: cut from the END (B first, then A) to max_seq_length - 1 when the
    length reaches max_seq_length, a final [SEP] (type 1 when B was given), pads whose TYPE ids
    are also pad_id.

    Returns:
        (ids, types, paddings), each of length max_seq_length.
    """
    ids = [cls_id]
    types = [0]
    ids.extend(text_a_ids)
    types.extend([0] * len(text_a_ids))
    ids.append(sep_id)
    types.append(0)
    if text_b_ids is not None:
        ids.extend(text_b_ids)
        types.extend([1] * len(text_b_ids))
    trimmed = False
    if len(ids) >= max_seq_length:
        max_seq_length_m1 = max_seq_length - 1
        ids = ids[0:max_seq_length_m1]
        types = types[0:max_seq_length_m1]
        trimmed = True
    if (text_b_ids is not None) or trimmed:
        ids.append(sep_id)
        types.append(0 if text_b_ids is None else 1)
    paddings = [1] * len(ids)
    padding_length = max_seq_length - len(ids)
    if padding_length > 0:
        ids.extend([pad_id] * padding_length)
        types.extend([pad_id] * padding_length)
        paddings.extend([0] * padding_length)
    return ids, types, paddings
