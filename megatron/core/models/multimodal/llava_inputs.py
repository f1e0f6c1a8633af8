"""Merging image embeddings into the text sequence of a LLaVA batch, with its labels and loss mask.

Notation: b batch, s text length, S combined length, k tokens per image tile, h hidden size.

Placeholder mode (later Megatron's `_preprocess_data`): every `image_token_index` id in
`input_ids` stands for one image, whose tiles' k-token embeddings replace it, so a sample grows
from s to s - n_img + sum(tiles * k) tokens; shorter samples are right-padded with zero
embeddings. `labels[i]` is the target of `input_ids[i]` (the ids shifted left by one). In the
combined sequence:

- a text position keeps its label and loss mask, except when its label is an image placeholder
  (the token just before an image): label `IGNORE_INDEX`, mask 0;
- an image position gets `IGNORE_INDEX` and mask 0, except the last position of each image: its
  label is the placeholder's label (the first text token after the image) and its mask is 0, as
  in Megatron, or the placeholder's mask with `supervise_first_token_after_image` (what HF
  LLaVA trains);
- padding gets `IGNORE_INDEX` and mask 0.

Example (k = 3): ids [10, 11, P, 12, 13], labels [11, P, 12, 13, 14], mask all 1 give the tokens
[t10, t11, i0, i1, i2, t12, t13], labels [11, -100, -100, -100, 12, 13, 14] and mask
[1, 0, 0, 0, 0, 1, 1].
"""

from typing import List, Optional, Tuple

import torch
from torch import Tensor

#: Later Megatron's placeholder id of an image in `input_ids` (`DEFAULT_IMAGE_TOKEN_INDEX`).
DEFAULT_IMAGE_TOKEN_INDEX = -200
#: The label of positions without a target (`IGNORE_INDEX`).
IGNORE_INDEX = -100


def count_placeholders(input_ids: Tensor, image_token_index: int) -> Tensor:
    """Placeholders per sample [b]."""
    return (input_ids == image_token_index).sum(dim=1)


def check_image_counts(input_ids: Tensor, num_images: int, image_token_index: int) -> List[int]:
    """The placeholders of each sample; ValueError unless they add up to `num_images`."""
    per_sample = count_placeholders(input_ids, image_token_index).tolist()
    total = sum(per_sample)
    if total != num_images:
        more_or_fewer = 'more' if total > num_images else 'fewer'
        raise ValueError(
            f"LLaVA: {more_or_fewer} image tokens ({image_token_index}) in input_ids than images: "
            f"{total} placeholders for {num_images} images (placeholders per sample: {per_sample})"
        )
    return per_sample


def _sample_layout(ids: Tensor, image_token_index: int, image_lengths: Tensor):
    """For one sample [s]: the combined start of every text position and placeholder [s], the
    placeholder positions [n_img] and the combined length."""
    is_image = ids == image_token_index
    extra = torch.zeros_like(ids)
    extra[is_image] = image_lengths - 1
    starts = torch.arange(ids.numel(), device=ids.device) + torch.cumsum(extra, 0) - extra
    return starts, is_image.nonzero(as_tuple=True)[0], int(ids.numel() + extra.sum())


def plan_placeholder_batch(
    input_ids: Tensor,
    n_tiles: int,
    tokens_per_tile: int,
    num_image_tiles: Optional[Tensor],
    image_token_index: int,
    max_sequence_length: int,
):
    """Check a placeholder batch and lay it out, before any image is encoded.

    ValueError when the placeholders and the images do not match in number, when
    `num_image_tiles` does not add up to `n_tiles`, or when an image's tokens would end beyond
    `max_sequence_length`.

    Returns:
        (per-sample layouts, tiles per image [n_img], tokens per image [n_img], combined length)
    """
    if num_image_tiles is None:
        num_image_tiles = torch.ones(n_tiles, dtype=torch.long)
    num_image_tiles = torch.as_tensor(num_image_tiles, dtype=torch.long).cpu()
    if int(num_image_tiles.sum()) != n_tiles:
        raise ValueError(
            f"LLaVA: num_image_tiles adds up to {int(num_image_tiles.sum())} tiles but "
            f"{n_tiles} image tiles were given"
        )
    per_sample = check_image_counts(input_ids, num_image_tiles.numel(), image_token_index)
    image_lengths = (num_image_tiles * tokens_per_tile).to(input_ids.device)  # [n_img]
    layouts, image_id = [], 0
    for i in range(input_ids.shape[0]):
        n = per_sample[i]
        lengths = image_lengths[image_id : image_id + n]
        layouts.append((image_id, n) + _sample_layout(input_ids[i], image_token_index, lengths))
        image_id += n
    _check_truncation(layouts, image_lengths, max_sequence_length)
    combined_len = min(max(layout[-1] for layout in layouts), max_sequence_length)
    return layouts, num_image_tiles, image_lengths, combined_len


def merge_placeholder_batch(
    text_embeddings: Tensor,
    image_embeddings: Optional[Tensor],
    input_ids: Tensor,
    num_image_tiles: Optional[Tensor],
    image_token_index: int,
    max_sequence_length: int,
    labels: Optional[Tensor] = None,
    loss_mask: Optional[Tensor] = None,
    supervise_first_token_after_image: bool = False,
) -> Tuple[Tensor, Optional[Tensor], Optional[Tensor]]:
    """Replace the image placeholders with the image embeddings (module docstring).

    Args:
        text_embeddings: [s, b, h] embeddings of `input_ids` (placeholders embedded as any id).
        image_embeddings: [n_tiles, k, h] projected image tokens, tiles in placeholder order
            (sample by sample, left to right); None or 0 tiles for a text-only batch.
        input_ids: [b, s] ids with `image_token_index` placeholders.
        num_image_tiles: [n_img] tiles of each image (None: one each).
        image_token_index: the placeholder id.
        max_sequence_length: the combined sequence is cut to this length; ValueError when that
            would cut an image's tokens.
        labels, loss_mask: [b, s] or None.
        supervise_first_token_after_image: train the first text token after each image.

    Returns:
        (embeddings [S, b, h], labels [b, S] or None, loss_mask [b, S] or None).
    """
    b, s = input_ids.shape
    h = text_embeddings.shape[-1]
    n_tiles = 0 if image_embeddings is None else image_embeddings.shape[0]
    k = 0 if image_embeddings is None else image_embeddings.shape[1]
    layouts, num_image_tiles, image_lengths, combined_len = plan_placeholder_batch(
        input_ids, n_tiles, k, num_image_tiles, image_token_index, max_sequence_length
    )
    tile_offsets = torch.cumsum(num_image_tiles, 0) - num_image_tiles  # [n_img]

    rows = []
    for i, (first, n, starts, places, _) in enumerate(layouts):
        is_text = torch.ones(s, dtype=torch.bool, device=input_ids.device)
        is_text[places] = False
        index = [starts[is_text]]
        source = [text_embeddings[:, i][is_text]]  # [s_text, h]
        for j in range(n):
            img = first + j
            t0, nt = int(tile_offsets[img]), int(num_image_tiles[img])
            start = int(starts[places[j]])
            index.append(torch.arange(start, start + nt * k, device=input_ids.device))
            source.append(image_embeddings[t0 : t0 + nt].reshape(nt * k, h))  # [tiles*k, h]
        index, source = torch.cat(index), torch.cat(source)
        keep = index < combined_len
        row = text_embeddings.new_zeros(combined_len, h)
        rows.append(row.index_copy(0, index[keep], source[keep]))
    embeddings = torch.stack(rows, dim=1)  # [S, b, h]

    new_labels = new_mask = None
    if labels is not None or loss_mask is not None:
        new_labels, new_mask = _expand_labels(
            layouts, image_lengths, input_ids, labels, loss_mask, image_token_index,
            combined_len, supervise_first_token_after_image,
        )  # fmt: skip
    return embeddings, (new_labels if labels is not None else None), new_mask


def expand_placeholder_labels(
    input_ids: Tensor,
    n_tiles: int,
    tokens_per_tile: int,
    num_image_tiles: Optional[Tensor],
    image_token_index: int,
    max_sequence_length: int,
    labels: Optional[Tensor],
    loss_mask: Optional[Tensor],
    supervise_first_token_after_image: bool = False,
) -> Tuple[Optional[Tensor], Optional[Tensor]]:
    """The labels and loss mask [b, s] -> [b, S] that `merge_placeholder_batch` returns, from the
    ids and the image counts alone: a later pipeline stage, which has no embeddings, builds the
    same targets as the first stage's merge (same checks, same combined length S).
    """
    layouts, _, image_lengths, combined_len = plan_placeholder_batch(
        input_ids, n_tiles, tokens_per_tile, num_image_tiles, image_token_index,
        max_sequence_length,
    )  # fmt: skip
    if labels is None and loss_mask is None:
        return None, None
    new_labels, new_mask = _expand_labels(
        layouts, image_lengths, input_ids, labels, loss_mask, image_token_index, combined_len,
        supervise_first_token_after_image,
    )  # fmt: skip
    return (new_labels if labels is not None else None), new_mask


def _check_truncation(layouts, image_lengths: Tensor, max_sequence_length: int) -> None:
    for i, (first, n, starts, places, _) in enumerate(layouts):
        for j in range(n):
            end = int(starts[places[j]]) + int(image_lengths[first + j])
            if end > max_sequence_length:
                raise ValueError(
                    f"LLaVA: sample {i}'s image {j} ends at combined position {end}, beyond "
                    f"language_max_sequence_length {max_sequence_length}: the sequence is too "
                    "short for the image tokens"
                )


def _expand_labels(
    layouts, image_lengths, input_ids, labels, loss_mask, image_token_index, combined_len,
    supervise_first_token_after_image,
):  # fmt: skip
    """Labels and loss mask [b, s] -> [b, S] under the rules of the module docstring."""
    b, s = input_ids.shape
    device = input_ids.device
    if labels is None:
        labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.long, device=device)
    if loss_mask is None:
        loss_mask = torch.ones(b, s, dtype=torch.float, device=device)
    out_labels = torch.full((b, combined_len), IGNORE_INDEX, dtype=labels.dtype, device=device)
    out_mask = torch.zeros(b, combined_len, dtype=loss_mask.dtype, device=device)
    for i, (first, n, starts, places, _) in enumerate(layouts):
        lab = labels[i].clone()
        mask = loss_mask[i].clone()
        before_image = lab == image_token_index
        lab[before_image] = IGNORE_INDEX
        mask[before_image] = 0
        # Each placeholder's label and mask move to its image's last position.
        pos = starts.clone()
        pos[places] = starts[places] + image_lengths[first : first + n] - 1
        if not supervise_first_token_after_image:
            mask[places] = 0
        keep = pos < combined_len
        out_labels[i, pos[keep]] = lab[keep]
        out_mask[i, pos[keep]] = mask[keep]
    return out_labels, out_mask
