"""Inpainting masks over the patch grid (Megatron's `--mask-type random|row`, `--mask-factor`).

A mask is a float [1, H, W] image, 1 on the pixels of masked patches. `mask_factor * N` steps
(N patches) choose them:
- `random`: a random walk over the patch grid from a random start, one step up, down, left or
  right each time (clamped at the border), masking every patch it visits (revisits count, so
  at most that many patches are masked);
- `row`: patches in reverse raster order, from the bottom-right corner.
"""

import numpy as np

_STEPS = ((0, 1), (0, -1), (1, 0), (-1, 0))


def num_masked_steps(image_size: int, patch_dim: int, mask_factor: float) -> int:
    grid = image_size // patch_dim
    return int(mask_factor * grid * grid)


def inpainting_mask(
    image_size: int, patch_dim: int, mask_factor: float, mask_type: str, rng: np.random.Generator
) -> np.ndarray:
    """A [1, image_size, image_size] float32 mask (1 = masked) drawn from `rng`."""
    if mask_type not in ('random', 'row'):
        raise ValueError(f"--mask-type must be random or row, got {mask_type!r}")
    grid = image_size // patch_dim
    steps = num_masked_steps(image_size, patch_dim, mask_factor)
    patches = np.zeros((grid, grid), dtype=np.float32)
    if mask_type == 'random':
        row, col = int(rng.integers(0, grid)), int(rng.integers(0, grid))
        for _ in range(steps):
            d_row, d_col = _STEPS[int(rng.integers(0, len(_STEPS)))]
            row = min(max(row + d_row, 0), grid - 1)
            col = min(max(col + d_col, 0), grid - 1)
            patches[row, col] = 1.0
    else:
        order = [(r, c) for r in reversed(range(grid)) for c in reversed(range(grid))]
        for r, c in order[:steps]:
            patches[r, c] = 1.0
    # Each patch flag covers its patch_dim x patch_dim pixels.
    pixels = np.kron(patches, np.ones((patch_dim, patch_dim), dtype=np.float32))
    return pixels[None]  # [1, H, W]
