"""Mock multimodal data: GPT mock text samples with a blank image (Megatron r0.8's names).

`MockMultimodalDataset` is `MockGPTDataset` (same documents, same length and sample order) with
one `image` tensor per sample, float32 zeros of shape [3, image_h, image_w]; the config's
`preprocess_func` then turns the sample into whatever a model's forward step expects.
"""

from dataclasses import dataclass
from typing import Callable, Dict

import torch

from megatron.core.datasets.gpt_dataset import GPTDatasetConfig, MockGPTDataset


def _identity(sample: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
    return sample


@dataclass
class MultimodalDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig plus the image size and a per-sample preprocessing hook."""

    image_h: int = None
    """Image height in pixels (required)."""

    image_w: int = None
    """Image width in pixels (required)."""

    preprocess_func: Callable[[Dict[str, torch.Tensor]], Dict[str, torch.Tensor]] = _identity
    """Maps a sample dict to the model's format; default: unchanged."""

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ('image_h', 'image_w'):
            value = getattr(self, name)
            if value is None or value <= 0:
                raise ValueError(
                    f'MultimodalDatasetConfig.{name} must be a positive int, got {value}'
                )


class MockMultimodalDataset(MockGPTDataset):
    """MockGPTDataset samples with a blank RGB image added under `image`."""

    def __getitem__(self, idx: int) -> Dict[str, torch.Tensor]:
        sample = super().__getitem__(idx)
        # [c, h, w]: three channels, one image per sample.
        sample['image'] = torch.zeros(
            (3, self.config.image_h, self.config.image_w), dtype=torch.float32
        )
        return self.config.preprocess_func(sample)
