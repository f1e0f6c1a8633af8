"""ViT image classification (Megatron's `VitClassificationModel`) on the megatron.core ViT.

The backbone is `CLIPViTModel` with Megatron's legacy ViT geometry (8 class tokens) and a final
LayerNorm; the head reads the first class token. Megatron r0.8's legacy backbone embedded patches
with a Linear over flattened patches and had no norm before the layers; this one uses the core
encoder's convolution (the same map, see docs/vision.md) and its `ln_pre`.

Tensor parallelism splits the transformer layers as in GPT; the patch embedding, class tokens,
positions, norms and the head are replicated, and their gradients agree on every rank.
"""

import torch
from torch import Tensor

from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

#: Class tokens of Megatron's legacy ViT backbone (`CLASS_TOKEN_LENGTH`).
CLASS_TOKEN_LENGTH = 8

#: --vit-layout: 'megatron' (Megatron's classifier: 8 class tokens, ln_pre, the MLP head) or
#: 'hf' (Hugging Face ViTForImageClassification's: 1 class token, a patch convolution with bias,
#: no ln_pre, a final LayerNorm and one linear classifier), which convert.py exports.
LAYOUTS = ('megatron', 'hf')


class VitMlpHead(MegatronModule):
    """Hidden [b, h] -> logits [b, classes]: dense_in (h -> h), tanh, dense_out (h -> classes),
    whose bias starts at -10 as Megatron's does.

    Args:
        config (TransformerConfig): reads params_dtype.
        hidden_size (int): the backbone's hidden size.
        num_classes (int): number of classes.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, num_classes: int):
        super().__init__(config=config)
        kw = dict(device=get_current_device(), dtype=config.params_dtype)
        self.dense_in = torch.nn.Linear(hidden_size, hidden_size, **kw)
        self.dense_out = torch.nn.Linear(hidden_size, num_classes, **kw)
        torch.nn.init.constant_(self.dense_out.bias, -10)

    def forward(self, hidden: Tensor) -> Tensor:
        return self.dense_out(torch.tanh(self.dense_in(hidden)))


class VitClassificationModel(MegatronModule):
    """Images [b, c, img_h, img_w] -> class logits [b, num_classes].

    Args:
        config (TransformerConfig): the ViT config.
        num_classes (int): number of classes.
        finetune (bool): a zero-initialised linear head instead of the MLP head.
        pre_process, post_process (bool): pipeline stage flags (the model runs on one stage).
        img_h, img_w, patch_dim, num_channels (int): the image geometry.
        class_token_len (int): class tokens of the backbone (the megatron layout).
        layout (str): 'megatron' or 'hf' (see LAYOUTS).
    """

    def __init__(
        self,
        config: TransformerConfig,
        num_classes: int,
        finetune: bool = False,
        pre_process: bool = True,
        post_process: bool = True,
        img_h: int = 224,
        img_w: int = 224,
        patch_dim: int = 16,
        num_channels: int = 3,
        class_token_len: int = CLASS_TOKEN_LENGTH,
        layout: str = 'megatron',
    ):
        super().__init__(config=config)
        assert pre_process and post_process, "the vision models run on one pipeline stage"
        if layout not in LAYOUTS:
            raise ValueError(f"--vit-layout {layout}: choose from {', '.join(LAYOUTS)}")
        self.pre_process, self.post_process = pre_process, post_process
        self.layout = layout
        hf = layout == 'hf'
        self.backbone = CLIPViTModel(
            config,
            get_vit_layer_with_local_spec(),
            class_token_len=1 if hf else class_token_len,
            patch_dim=patch_dim,
            img_h=img_h,
            img_w=img_w,
            num_channels=num_channels,
            model_subtype='vit' if hf else 'clip',
            add_ln_post=True,
        )
        hidden = config.hidden_size
        if hf:
            # ViTForImageClassification's `classifier`: one linear layer on the class token.
            kw = dict(device=get_current_device(), dtype=config.params_dtype)
            self.head = torch.nn.Linear(hidden, num_classes, **kw)
            config.init_method(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)
        elif finetune:
            kw = dict(device=get_current_device(), dtype=config.params_dtype)
            self.head = torch.nn.Linear(hidden, num_classes, **kw)
            torch.nn.init.zeros_(self.head.weight)
            torch.nn.init.zeros_(self.head.bias)
        else:
            self.head = VitMlpHead(config, hidden, num_classes)

    def set_input_tensor(self, input_tensor: Tensor) -> None:
        self.backbone.set_input_tensor(input_tensor)

    def forward(self, images: Tensor) -> Tensor:
        tokens = self.backbone(images)  # [b, s, h]
        return self.head(tokens[:, 0])  # [b, classes]
