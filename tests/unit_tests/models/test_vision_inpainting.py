"""Inpainting pieces: the masks, PSNR / SSIM against numpy references, and the pixel layout of
the reconstruction head."""

import numpy as np
import pytest
import torch

from megatron.legacy.data.image_masks import inpainting_mask
from megatron.legacy.model.vision.image_metrics import psnr, ssim
from megatron.legacy.model.vision.inpainting import tokens_to_image


def test_row_mask_fills_from_the_bottom_right():
    mask = inpainting_mask(8, 2, 0.1875, 'row', np.random.default_rng(0))[0]
    assert mask.shape == (8, 8) and mask.sum() == 3 * 4  # 3 of 16 patches, 4 pixels each
    np.testing.assert_array_equal(mask[6:, 2:], 1)  # the last patch row, columns 1..3
    assert mask[:6].sum() == 0 and mask[6:, :2].sum() == 0


def test_random_mask_is_a_seeded_walk():
    a = inpainting_mask(16, 2, 0.5, 'random', np.random.default_rng(3))[0]
    b = inpainting_mask(16, 2, 0.5, 'random', np.random.default_rng(3))[0]
    np.testing.assert_array_equal(a, b)
    patches = a[::2, ::2]
    assert 1 <= patches.sum() <= 32  # 32 steps, revisits allowed
    np.testing.assert_array_equal(np.kron(patches, np.ones((2, 2))), a)  # whole patches
    # The visited patches are 4-connected (a walk).
    cells = {tuple(c) for c in np.argwhere(patches)}
    seen, todo = set(), [next(iter(cells))]
    while todo:
        r, c = todo.pop()
        if (r, c) in seen:
            continue
        seen.add((r, c))
        todo += [n for n in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)) if n in cells]
    assert seen == cells
    with pytest.raises(ValueError, match='--mask-type'):
        inpainting_mask(8, 2, 1.0, 'diagonal', np.random.default_rng(0))


def _ssim_numpy(x, y, size=11, sigma=1.5):
    """SSIM with an explicit sliding window over every valid position (channel by channel)."""
    size = min(size, x.shape[-1], x.shape[-2])
    g = np.exp(-((np.arange(size) - (size - 1) / 2) ** 2) / (2 * sigma**2))
    w = np.outer(g, g) / np.outer(g, g).sum()
    values = []
    for b in range(x.shape[0]):
        for c in range(x.shape[1]):
            for i in range(x.shape[2] - size + 1):
                for j in range(x.shape[3] - size + 1):
                    px, py = (
                        x[b, c, i : i + size, j : j + size],
                        y[b, c, i : i + size, j : j + size],
                    )
                    mx, my = (w * px).sum(), (w * py).sum()
                    vx, vy = (w * px * px).sum() - mx**2, (w * py * py).sum() - my**2
                    cov = (w * px * py).sum() - mx * my
                    c1, c2 = 0.01**2, 0.03**2
                    values.append(
                        ((2 * mx * my + c1) * (2 * cov + c2))
                        / ((mx**2 + my**2 + c1) * (vx + vy + c2))
                    )
    return float(np.mean(values))


def test_psnr_and_ssim_equal_numpy_references():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(2, 3, 14, 13, generator=g)
    y = (x + 0.1 * torch.randn(2, 3, 14, 13, generator=g)).clamp(0, 1)
    mse = float(((x - y) ** 2).mean())
    assert psnr(x, y).item() == pytest.approx(10 * np.log10(1 / mse), rel=1e-5)
    assert ssim(x, y).item() == pytest.approx(_ssim_numpy(x.numpy(), y.numpy()), rel=1e-4)
    assert ssim(x, x).item() == pytest.approx(1.0, abs=1e-6)
    small = torch.rand(1, 1, 8, 8, generator=g)  # smaller than the window
    assert ssim(small, small * 0.5).item() == pytest.approx(
        _ssim_numpy(small.numpy(), small.numpy() * 0.5), rel=1e-4
    )


def test_tokens_to_image_inverts_the_patch_embedding_order():
    p, c, gh, gw = 2, 3, 3, 4
    image = torch.arange(2 * c * gh * p * gw * p, dtype=torch.float32).view(2, c, gh * p, gw * p)
    # The conv patch embedding reads patches row-major; each patch's pixels as (row, col, ch).
    arr = image.numpy().transpose(0, 2, 3, 1)  # [b, H, W, c]
    patches = arr.reshape(2, gh, p, gw, p, c).transpose(0, 1, 3, 2, 4, 5)
    tokens = torch.from_numpy(np.ascontiguousarray(patches.reshape(2, gh * gw, p * p * c)))
    assert torch.equal(tokens_to_image(tokens, (gh, gw), p, c), image)
