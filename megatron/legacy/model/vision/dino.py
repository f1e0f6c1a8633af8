"""DINO self-distillation (Megatron's `megatron/legacy/model/vision/dino.py`) on the core ViT.

A student and a teacher of the same architecture (`MultiCropWrapper(backbone, DINOHead)`) see
different views of each image: the student every crop, the teacher the two global ones. The loss
is the cross entropy between the teacher's centred, sharpened softmax and the student's softmax
over every (teacher view, student view) pair of different views. Only the student is trained;
the teacher follows it by an exponential moving average after each optimizer step
(`update_momentum`), and the last head layer's gradients are cancelled during the first
`--dino-freeze-last-layer` epochs (`cancel_gradients_last_layer`), both called by the training
loop as Megatron's does.

The teacher's parameters do not require gradients, so neither DDP nor the optimizer holds them;
they, the center and the student are all in the checkpoint (exact resume).
"""

import math
from typing import List, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from megatron.core import parallel_state
from megatron.core.models.vision.clip_vit_model import CLIPViTModel
from megatron.core.models.vision.vit_layer_specs import get_vit_layer_with_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.utils import get_current_device

#: Output dimension of the DINO head (Megatron's and DINO's 65536).
DINO_OUT_DIM = 65536
#: Schedule length of the teacher temperature, in epochs (Megatron's fixed 300).
DINO_EPOCHS = 300


class WeightNormLinear(torch.nn.Module):
    """y = x W^T with W = g * v / ||v|| per output row, no bias (keys `weight_g`, `weight_v`, as
    `torch.nn.utils.weight_norm` names them)."""

    def __init__(self, in_features: int, out_features: int, **kw):
        super().__init__()
        self.weight_v = torch.nn.Parameter(torch.empty(out_features, in_features, **kw))
        torch.nn.init.trunc_normal_(self.weight_v, std=0.02)
        self.weight_g = torch.nn.Parameter(torch.ones(out_features, 1, **kw))

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight_g * self.weight_v / self.weight_v.norm(dim=1, keepdim=True)
        return F.linear(x, weight)


class DINOHead(torch.nn.Module):
    """Features [n, in_dim] -> logits [n, out_dim]: Linear-GELU-Linear-GELU-Linear to the
    bottleneck, L2 normalisation, then the weight-normalised `last_layer`.

    Args:
        in_dim, out_dim, hidden_dim, bottleneck_dim (int): sizes.
        norm_last_layer (bool): keep the weight-norm scale `weight_g` fixed at 1.
        params_dtype (torch.dtype): parameter dtype.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        hidden_dim: int = 2048,
        bottleneck_dim: int = 256,
        norm_last_layer: bool = True,
        params_dtype=torch.float32,
    ):
        super().__init__()
        kw = dict(device=get_current_device(), dtype=params_dtype)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(in_dim, hidden_dim, **kw),
            torch.nn.GELU(),
            torch.nn.Linear(hidden_dim, hidden_dim, **kw),
            torch.nn.GELU(),
            torch.nn.Linear(hidden_dim, bottleneck_dim, **kw),
        )
        for layer in self.mlp:
            if isinstance(layer, torch.nn.Linear):
                torch.nn.init.trunc_normal_(layer.weight, std=0.02)
                torch.nn.init.zeros_(layer.bias)
        self.last_layer = WeightNormLinear(bottleneck_dim, out_dim, **kw)
        if norm_last_layer:
            self.last_layer.weight_g.requires_grad = False

    def forward(self, x: Tensor) -> Tensor:
        x = F.normalize(self.mlp(x), dim=-1, p=2)
        return self.last_layer(x)


class MultiCropWrapper(torch.nn.Module):
    """Runs the backbone once per group of same-size crops, concatenates their class-token
    features in crop order, then the head: list of [b, c, h_i, w_i] -> [n_crops * b, out_dim]."""

    def __init__(self, backbone: CLIPViTModel, head: DINOHead):
        super().__init__()
        self.backbone, self.head = backbone, head

    def forward(self, crops: Sequence[Tensor]) -> Tensor:
        features, start = [], 0
        while start < len(crops):
            end = start
            while end < len(crops) and crops[end].shape[-2:] == crops[start].shape[-2:]:
                end += 1
            batch = torch.cat(list(crops[start:end]))  # [(end - start) * b, c, h, w]
            features.append(self.backbone(batch)[:, 0])  # [(end - start) * b, hidden]
            start = end
        return self.head(torch.cat(features))


def teacher_temperatures(warmup_temp: float, temp: float, warmup_epochs: int) -> np.ndarray:
    """Per-epoch teacher temperature: linear from warmup_temp to temp over warmup_epochs, then
    temp, for DINO_EPOCHS epochs."""
    return np.concatenate(
        (np.linspace(warmup_temp, temp, warmup_epochs), np.ones(DINO_EPOCHS - warmup_epochs) * temp)
    )


def teacher_momentum(iteration: int, total_iterations: int, base: float = 0.996) -> float:
    """Cosine schedule of the teacher's EMA momentum from `base` to 1 over the run (Megatron's
    per-epoch table indexes past its end when train_iters is not a multiple of iter_per_epoch;
    the closed form covers every iteration)."""
    progress = min(iteration, total_iterations) / max(1, total_iterations)
    return 1.0 - (1.0 - base) * (math.cos(math.pi * progress) + 1.0) / 2.0


class DINOLoss(torch.nn.Module):
    """DINO's cross-view cross entropy with a centred, sharpened teacher.

    Args:
        out_dim (int): head output size.
        ncrops (int): student views (2 global + the local ones).
        temperatures (np.ndarray): teacher temperature per epoch.
        student_temp (float): student temperature.
        center_momentum (float): EMA momentum of the center.
    """

    def __init__(self, out_dim, ncrops, temperatures, student_temp=0.1, center_momentum=0.9):
        super().__init__()
        self.ncrops, self.student_temp = ncrops, student_temp
        self.center_momentum = center_momentum
        self.temperatures = temperatures
        self.register_buffer('center', torch.zeros(1, out_dim, device=get_current_device()))

    def forward(
        self, student_output: Tensor, teacher_output: Tensor, epoch: int, update_center=True
    ) -> Tensor:
        temp = float(self.temperatures[min(epoch, len(self.temperatures) - 1)])
        student = (student_output.float() / self.student_temp).chunk(self.ncrops)
        teacher = F.softmax((teacher_output.float() - self.center) / temp, dim=-1).chunk(2)
        total, terms = 0.0, 0
        for iq, q in enumerate(teacher):
            for v, s in enumerate(student):
                if v == iq:
                    continue  # the same view
                total = total + torch.sum(-q * F.log_softmax(s, dim=-1), dim=-1).mean()
                terms += 1
        if update_center:
            self.update_center(teacher_output)
        return total / terms

    @torch.no_grad()
    def update_center(self, teacher_output: Tensor) -> None:
        """center <- m center + (1 - m) mean of the teacher outputs over the data-parallel
        batch (all-reduced over the DP group: TP ranks hold the same outputs)."""
        batch_center = teacher_output.float().sum(dim=0, keepdim=True)
        count = torch.tensor([float(teacher_output.shape[0])], device=batch_center.device)
        if torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized():
            group = parallel_state.get_data_parallel_group()
            torch.distributed.all_reduce(batch_center, group=group)
            torch.distributed.all_reduce(count, group=group)
        batch_center = batch_center / count
        self.center.mul_(self.center_momentum).add_(batch_center * (1 - self.center_momentum))


class DINOPretrainModel(MegatronModule):
    """Student and EMA teacher; forward(crops) returns (student logits, teacher logits).

    Args:
        config (TransformerConfig): the ViT config.
        img_size, patch_dim, num_channels (int): the global crops' geometry.
        local_crops_number (int): local crops per image.
        local_img_size (int): side of the local crops.
        head_hidden, bottleneck, out_dim (int): DINO head sizes.
        norm_last_layer (bool): fixed weight-norm scale of the last head layer.
        temperatures (np.ndarray): teacher temperature per epoch.
        freeze_last_layer (float): epochs with the last head layer's gradients cancelled.
        iter_per_epoch (int): iterations per epoch.
        train_iters (int): length of the run (the momentum schedule).
        momentum_teacher (float): initial EMA momentum.
    """

    def __init__(
        self,
        config: TransformerConfig,
        img_size: int,
        patch_dim: int,
        num_channels: int,
        local_crops_number: int,
        local_img_size: int,
        head_hidden: int,
        bottleneck: int,
        out_dim: int,
        norm_last_layer: bool,
        temperatures: np.ndarray,
        freeze_last_layer: float,
        iter_per_epoch: int,
        train_iters: int,
        momentum_teacher: float = 0.996,
        pre_process: bool = True,
        post_process: bool = True,
    ):
        super().__init__(config=config)
        assert pre_process and post_process, "the vision models run on one pipeline stage"
        self.pre_process, self.post_process = pre_process, post_process
        self.freeze_last_layer, self.iter_per_epoch = freeze_last_layer, iter_per_epoch
        self.train_iters, self.momentum_teacher = train_iters, momentum_teacher
        if local_crops_number and (local_img_size <= 0 or local_img_size % patch_dim):
            raise ValueError(
                f"--dino-local-img-size {local_img_size} is not divisible by --patch-dim "
                f"{patch_dim}"
            )
        self.student = self._build(config, img_size, patch_dim, num_channels, head_hidden,
                                   bottleneck, out_dim, norm_last_layer)  # fmt: skip
        self.teacher = self._build(config, img_size, patch_dim, num_channels, head_hidden,
                                   bottleneck, out_dim, norm_last_layer)  # fmt: skip
        self.teacher.load_state_dict(self.student.state_dict())
        if local_crops_number:
            local_tokens = (local_img_size // patch_dim) ** 2 + 1
            self.student.backbone.check_sequence_parallel(local_tokens)
        for param in self.teacher.parameters():
            param.requires_grad = False
        self.dino_loss = DINOLoss(out_dim, 2 + local_crops_number, temperatures)

    @staticmethod
    def _build(config, img_size, patch_dim, num_channels, head_hidden, bottleneck, out_dim, norm):
        backbone = CLIPViTModel(
            config,
            get_vit_layer_with_local_spec(),
            class_token_len=1,
            patch_dim=patch_dim,
            img_h=img_size,
            img_w=img_size,
            num_channels=num_channels,
            add_ln_post=True,
            interpolate_positions=True,
        )
        head = DINOHead(config.hidden_size, out_dim, head_hidden, bottleneck, norm,
                        config.params_dtype)  # fmt: skip
        return MultiCropWrapper(backbone, head)

    def set_input_tensor(self, input_tensor) -> None:
        self.student.backbone.set_input_tensor(input_tensor)

    def forward(self, crops: List[Tensor]):
        student_output = self.student(crops)
        with torch.no_grad():
            teacher_output = self.teacher(crops[:2])
        return student_output, teacher_output

    @torch.no_grad()
    def teacher_features(self, images: Tensor) -> Tensor:
        """The teacher backbone's class-token features [b, hidden] of images [b, c, h, w]
        (what the k-NN evaluation compares)."""
        return self.teacher.backbone(images)[:, 0]

    def epoch(self, iteration: int) -> int:
        return iteration // self.iter_per_epoch

    def cancel_gradients_last_layer(self, iteration: int) -> None:
        """Zero the last head layer's gradients during the first `freeze_last_layer` epochs
        (the DDP gradient buffer is what the optimizer reads)."""
        if self.epoch(iteration) >= self.freeze_last_layer:
            return
        for param in self.student.head.last_layer.parameters():
            for grad in (getattr(param, 'main_grad', None), param.grad):
                if grad is not None:
                    grad.zero_()

    @torch.no_grad()
    def update_momentum(self, iteration: int) -> None:
        """teacher <- m teacher + (1 - m) student, m on the cosine schedule."""
        m = teacher_momentum(iteration, self.train_iters, self.momentum_teacher)
        for p_s, p_t in zip(self.student.parameters(), self.teacher.parameters()):
            p_t.mul_(m).add_(p_s.detach().to(p_t.dtype), alpha=1 - m)
