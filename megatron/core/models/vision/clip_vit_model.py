"""CLIPViTModel: the Vision Transformer of CLIP and SigLIP on the megatron-core transformer.

Notation: b batch, c channels, P patch size, N = (img_h / P) * (img_w / P) patches, L class
tokens, s = N + L, h hidden size, p tensor-parallel size.

Layout (Megatron's `megatron/core/models/vision/clip_vit_model.py`, keys included):
- `conv1`: Conv2d(c, h, P, stride P), bias only for SigLIP; patches in row-major order.
- `class_token` [1, L, h] prepended to the patches (CLIP only; SigLIP has none).
- `position_embeddings`: Embedding(s, h), learned absolute positions.
- `ln_pre` (CLIP) before the transformer, `ln_post` (SigLIP) after it.
- `model_subtype='vit'` (ours, not Megatron's) is Hugging Face `ViTModel`'s layout: class
  token(s), `conv1` with bias, no `ln_pre`, `ln_post` as its final LayerNorm.
- `decoder`: a `TransformerBlock` without a final norm, whose self attention sees every token
  (`AttnMaskType.no_mask`, see vit_layer_specs.py). Megatron r0.8's TE spec was causal by
  mistake; this one is not, and the tests fail on a causal mask.
"""

from typing import Optional

import torch
from torch import Tensor

from megatron.core import tensor_parallel
from megatron.core.models.common.vision_module.vision_module import VisionModule
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.torch_norm import WrappedTorchLayerNorm
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

#: The encoder variants `model_subtype` names (later Megatron's `vision_model_type`).
#: 'vit' is Hugging Face `ViTModel`'s layout (not a Megatron subtype): class token(s), a patch
#: convolution with bias, no norm before the layers, a final LayerNorm.
SUBTYPES = ('clip', 'siglip', 'vit')


def get_num_image_embeddings(
    img_h: int,
    img_w: int,
    patch_dim: int,
    vision_model_type: str = 'clip',
    disable_vision_class_token: bool = False,
    class_token_len: int = 1,
) -> int:
    """Tokens one image contributes: its patches plus the class tokens the encoder keeps (SigLIP
    never has any)."""
    num_patches = (img_h // patch_dim) * (img_w // patch_dim)
    if vision_model_type == 'siglip' or disable_vision_class_token:
        return num_patches
    return num_patches + class_token_len


class CLIPViTModel(VisionModule):
    """Images [b, c, img_h, img_w] -> token features [b, s, h] (class tokens first).

    The patch embedding, class tokens, positions and the outer norms are replicated on every
    tensor-parallel rank; the transformer layers are split as in GPT (attention heads and MLP
    columns). Under sequence parallelism the sequence is scattered over the TP group after
    `ln_pre` (backward: all-gather) and gathered back after the last layer (forward all-gather;
    backward: each rank keeps its own slice, since the caller's use of the output is replicated),
    so `ln_pre` sees the whole sequence and keeps full (unreduced) gradients.

    Args:
        transformer_config (TransformerConfig): the encoder's config (hidden size, heads, ...).
        transformer_layer_spec (ModuleSpec): the layer spec (`get_vit_layer_with_local_spec()`).
        ln_pre_impl: norm before the transformer (CLIP); defaults to LayerNorm.
        ln_post_impl: norm after the transformer (SigLIP); defaults to LayerNorm.
        add_class_token (bool): prepend learned class tokens (CLIP only).
        class_token_len (int): how many class tokens.
        patch_dim (int): patch size P (the convolution's kernel and stride).
        img_h (int): image height, a multiple of P.
        img_w (int): image width, a multiple of P.
        model_subtype (str): 'clip', 'siglip' or 'vit' (Hugging Face ViTModel's layout).
        num_channels (int): input channels (3 for RGB; 1 for grayscale data).
        add_ln_post (bool, optional): a norm after the last layer; default: SigLIP only (the
            classification models of the vision scripts add it to CLIP as their final norm).
        interpolate_positions (bool): accept other image sizes (multiples of P): the patch
            positions are resized bilinearly to the input's grid (DINO's local crops).
        pg_collection (ProcessGroupCollection, optional): the groups of the transformer block.
    """

    def __init__(
        self,
        transformer_config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        ln_pre_impl=None,
        ln_post_impl=None,
        add_class_token: bool = True,
        class_token_len: int = 1,
        patch_dim: int = 14,
        img_h: int = 336,
        img_w: int = 336,
        model_subtype: str = 'clip',
        num_channels: int = 3,
        add_ln_post: Optional[bool] = None,
        interpolate_positions: bool = False,
        pg_collection: Optional[ProcessGroupCollection] = None,
    ) -> None:
        super().__init__(config=transformer_config)
        _check_geometry(model_subtype, add_class_token, patch_dim, img_h, img_w)
        self.model_subtype = model_subtype
        self.patch_dim = patch_dim
        self.img_h, self.img_w = img_h, img_w
        self.num_channels = num_channels
        self.interpolate_positions = interpolate_positions
        self.visual_hidden_size = transformer_config.hidden_size
        self.add_class_token = add_class_token and model_subtype in ('clip', 'vit')
        self.class_token_len = class_token_len if self.add_class_token else 0
        self.num_patches = (img_h // patch_dim) * (img_w // patch_dim)
        self.seq_length = self.num_patches + self.class_token_len

        device = get_current_device()
        dtype = transformer_config.params_dtype
        self.conv1 = torch.nn.Conv2d(
            num_channels,
            self.visual_hidden_size,
            kernel_size=patch_dim,
            stride=patch_dim,
            bias=model_subtype in ('siglip', 'vit'),
            device=device,
            dtype=dtype,
        )
        self.register_buffer(
            'position_ids',
            torch.arange(self.seq_length, device=device).unsqueeze(0),  # [1, s]
            persistent=False,
        )
        self.position_embeddings = torch.nn.Embedding(
            self.seq_length, self.visual_hidden_size, device=device, dtype=dtype
        )
        if self.add_class_token:
            self.class_token = torch.nn.Parameter(
                torch.randn(1, self.class_token_len, self.visual_hidden_size, dtype=dtype).to(
                    device
                )
            )

        self.ln_pre = None
        self.ln_post = None
        if model_subtype == 'clip':
            self.ln_pre = self._build_norm(ln_pre_impl, sequence_parallel=False)
        if add_ln_post if add_ln_post is not None else model_subtype in ('siglip', 'vit'):
            self.ln_post = self._build_norm(ln_post_impl, sequence_parallel=True)

        self.decoder = TransformerBlock(
            config=transformer_config,
            spec=transformer_layer_spec,
            post_layer_norm=False,
            pre_process=True,
            post_process=False,
            pg_collection=pg_collection,
        )
        self.tp_group = self.decoder.pg_collection.tp
        self.check_sequence_parallel(self.seq_length)

    def check_sequence_parallel(self, num_tokens: int) -> None:
        """Sequence parallelism splits the tokens evenly over the TP group."""
        if not self.config.sequence_parallel:
            return
        tp = torch.distributed.get_world_size(self.tp_group)
        if num_tokens % tp:
            raise ValueError(
                f"--sequence-parallel: the {num_tokens} image tokens ({self.num_patches} patches "
                f"+ {self.class_token_len} class tokens) are not divisible by "
                f"--tensor-model-parallel-size {tp}"
            )

    def _build_norm(self, impl, sequence_parallel: bool):
        norm = build_module(
            impl if impl is not None else WrappedTorchLayerNorm,
            config=self.config,
            hidden_size=self.visual_hidden_size,
            eps=self.config.layernorm_epsilon,
        )
        # ln_pre runs before the sequence is scattered: its gradients are already complete on
        # every rank and must not be summed over the TP group again.
        sp = sequence_parallel and self.config.sequence_parallel
        for param in norm.parameters():
            param.sequence_parallel = sp
        return norm

    def set_input_tensor(self, input_tensor: Tensor) -> None:
        """The encoder runs on one pipeline stage only; the block still takes the call."""
        self.decoder.set_input_tensor(input_tensor)

    def _check_input(self, x: Tensor) -> None:
        c, h, w = x.shape[1:]
        resizable = (
            self.interpolate_positions and h % self.patch_dim == 0 and w % self.patch_dim == 0
        )
        if c != self.num_channels or not (resizable or (h, w) == (self.img_h, self.img_w)):
            raise ValueError(
                f"CLIPViTModel takes images [b, {self.num_channels}, {self.img_h}, {self.img_w}], "
                f"got {list(x.shape)}"
            )

    def _positions(self, grid_h: int, grid_w: int) -> Tensor:
        """Position embeddings [1, s', h] for a grid_h x grid_w patch grid."""
        pos = self.position_embeddings(self.position_ids)  # [1, s, h]
        base = (self.img_h // self.patch_dim, self.img_w // self.patch_dim)
        if (grid_h, grid_w) == base:
            return pos
        cls, patches = pos[:, : self.class_token_len], pos[:, self.class_token_len :]
        patches = patches.reshape(1, base[0], base[1], -1).permute(0, 3, 1, 2)  # [1, h, gh, gw]
        patches = torch.nn.functional.interpolate(
            patches.float(), size=(grid_h, grid_w), mode='bilinear', align_corners=False
        ).to(pos.dtype)
        patches = patches.permute(0, 2, 3, 1).reshape(1, grid_h * grid_w, -1)  # [1, N', h]
        return torch.cat([cls, patches], dim=1)

    def forward(self, x: Tensor, attention_mask: Optional[Tensor] = None) -> Tensor:
        """x [b, c, img_h, img_w] -> [b, s, h]; attention_mask None (every token sees every
        other) or a bool [b, 1, s, s] mask with True = masked out."""
        self._check_input(x)
        x = self.conv1(x.to(self.conv1.weight.dtype))  # [b, h, img_h/P, img_w/P]
        grid_h, grid_w = x.shape[2], x.shape[3]
        x = x.reshape(x.shape[0], x.shape[1], -1).permute(0, 2, 1)  # [b, N, h]
        if self.add_class_token:
            cls = self.class_token.expand(x.shape[0], -1, -1)  # [b, L, h]
            x = torch.cat([cls, x], dim=1)  # [b, s, h]
        x = x + self._positions(grid_h, grid_w)  # [b, s, h]
        if self.ln_pre is not None:
            x = self.ln_pre(x)
        x = x.permute(1, 0, 2).contiguous()  # [b, s, h] -> [s, b, h]
        if self.config.sequence_parallel:
            x = tensor_parallel.scatter_to_sequence_parallel_region(x, group=self.tp_group)

        x = self.decoder(x, attention_mask)  # [s(/p), b, h]

        if self.ln_post is not None:
            x = self.ln_post(x)
        if self.config.sequence_parallel:
            x = tensor_parallel.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=False, group=self.tp_group
            )
        return x.permute(1, 0, 2).contiguous()  # [s, b, h] -> [b, s, h]


def _check_geometry(model_subtype, add_class_token, patch_dim, img_h, img_w) -> None:
    if model_subtype not in SUBTYPES:
        raise ValueError(
            f"CLIPViTModel model subtype {model_subtype} is not supported (choose from "
            f"{', '.join(SUBTYPES)})"
        )
    if patch_dim <= 0 or img_h % patch_dim or img_w % patch_dim:
        raise ValueError(
            f"image size {img_h}x{img_w} is not divisible by the patch size {patch_dim}"
        )
    if model_subtype == 'siglip' and add_class_token:
        raise ValueError("SigLIP does not support class tokens (pass add_class_token=False)")
