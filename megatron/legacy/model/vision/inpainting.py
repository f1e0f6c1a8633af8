"""Masked-image inpainting (Megatron's `VitInpaintingModel`) on the megatron.core ViT.

The backbone is `CLIPViTModel` without class tokens and with a final LayerNorm; a linear layer,
zero-initialised as Megatron's, maps every patch token to its P x P x C pixels, which are laid
back into the image. Tensor parallelism splits the transformer layers; the pixel head is
replicated.
"""

import torch
from torch import Tensor

from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device


def tokens_to_image(tokens: Tensor, grid, patch_dim: int, channels: int) -> Tensor:
    """Per-patch pixels [b, gh * gw, p * p * c] (patches row-major, each patch's pixels as
    (row, column, channel)) -> images [b, c, gh * p, gw * p]."""
    b = tokens.shape[0]
    gh, gw = grid
    p, c = patch_dim, channels
    x = tokens.view(b, gh, gw, p, p, c)  # [b, gh, gw, p, p, c]
    x = x.permute(0, 5, 1, 3, 2, 4)  # [b, c, gh, p, gw, p]
    return x.reshape(b, c, gh * p, gw * p)  # [b, c, H, W]


class VitInpaintingModel(MegatronModule):
    """Masked images [b, c, H, W] -> reconstructed images [b, c, H, W].

    Args:
        config (TransformerConfig): the ViT config.
        pre_process, post_process (bool): pipeline stage flags (the model runs on one stage).
        img_h, img_w, patch_dim, num_channels (int): the image geometry.
    """

    def __init__(
        self,
        config: TransformerConfig,
        pre_process: bool = True,
        post_process: bool = True,
        img_h: int = 224,
        img_w: int = 224,
        patch_dim: int = 16,
        num_channels: int = 3,
    ):
        super().__init__(config=config)
        assert pre_process and post_process, "the vision models run on one pipeline stage"
        self.pre_process, self.post_process = pre_process, post_process
        self.patch_dim, self.num_channels = patch_dim, num_channels
        self.grid = (img_h // patch_dim, img_w // patch_dim)
        self.backbone = CLIPViTModel(
            config,
            get_vit_layer_with_local_spec(),
            add_class_token=False,
            patch_dim=patch_dim,
            img_h=img_h,
            img_w=img_w,
            num_channels=num_channels,
            add_ln_post=True,
        )
        self.linear_decoder = torch.nn.Linear(
            config.hidden_size,
            patch_dim * patch_dim * num_channels,
            device=get_current_device(),
            dtype=config.params_dtype,
        )
        torch.nn.init.zeros_(self.linear_decoder.weight)
        torch.nn.init.zeros_(self.linear_decoder.bias)

    def set_input_tensor(self, input_tensor: Tensor) -> None:
        self.backbone.set_input_tensor(input_tensor)

    def forward(self, images: Tensor) -> Tensor:
        pixels = self.linear_decoder(self.backbone(images))  # [b, gh * gw, p * p * c]
        return tokens_to_image(pixels, self.grid, self.patch_dim, self.num_channels)
