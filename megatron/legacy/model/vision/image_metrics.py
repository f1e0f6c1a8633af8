"""Image quality metrics of the inpainting script: PSNR and SSIM on images in [0, 1].

PSNR = 10 log10(1 / MSE) (peak 1). SSIM is the mean structural similarity of Wang et al. (2004)
with an 11 x 11 Gaussian window (sigma 1.5), C1 = 0.01^2, C2 = 0.03^2, per channel, over the
valid (unpadded) window positions; on images smaller than the window it shrinks to the image
(same sigma).
"""

import torch
import torch.nn.functional as F


def psnr(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Peak signal-to-noise ratio in dB of [b, c, h, w] tensors in [0, 1]."""
    mse = torch.mean((prediction.float() - target.float()) ** 2)
    return 10.0 * torch.log10(1.0 / mse.clamp(min=1e-10))


def _gaussian_window(size: int, sigma: float, channels: int, device) -> torch.Tensor:
    x = torch.arange(size, dtype=torch.float32, device=device) - (size - 1) / 2.0
    g = torch.exp(-(x**2) / (2 * sigma**2))
    g = g / g.sum()
    window = torch.outer(g, g)  # [size, size]
    return window.expand(channels, 1, size, size).contiguous()  # one filter per channel


def ssim(prediction: torch.Tensor, target: torch.Tensor, window_size: int = 11) -> torch.Tensor:
    """Mean SSIM of [b, c, h, w] tensors in [0, 1]."""
    x, y = prediction.float(), target.float()
    channels = x.shape[1]
    size = min(window_size, x.shape[-1], x.shape[-2])
    w = _gaussian_window(size, 1.5, channels, x.device)

    def blur(t):
        return F.conv2d(t, w, groups=channels)

    mu_x, mu_y = blur(x), blur(y)
    var_x = blur(x * x) - mu_x**2
    var_y = blur(y * y) - mu_y**2
    cov = blur(x * y) - mu_x * mu_y
    c1, c2 = 0.01**2, 0.03**2
    value = ((2 * mu_x * mu_y + c1) * (2 * cov + c2)) / (
        (mu_x**2 + mu_y**2 + c1) * (var_x + var_y + c2)
    )
    return value.mean()
