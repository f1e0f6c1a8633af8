"""Pretrain a ViT to fill in masked image patches (Megatron's pretrain_vision_inpaint.py).

Thin entry script: the model provider, the batch getter, the loss (the summed squared error over
the masked pixels divided by their count, logged as `loss`, with `psnr` and `ssim` of the
masked region), the forward step and the dataset provider; `pretrain()` does the rest.
`--mask-type random|row` and `--mask-factor` choose the masks (megatron/legacy/data/image_masks.py).
"""

from functools import partial

import torch
import torch.nn.functional as F

from megatron.core.enums import ModelType
from megatron.legacy.model.vision.image_metrics import psnr, ssim
from megatron.legacy.model.vision.inpainting import VitInpaintingModel
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.vision_batch import image_batch, vision_datasets
from megatron.training.global_vars import get_args, get_timers
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import average_losses_across_data_parallel_group, print_rank_0


def model_provider(pre_process=True, post_process=True) -> VitInpaintingModel:
    """The ViT inpainting model (the whole model on one pipeline stage)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    print_rank_0('building VIT model ...')
    return VitInpaintingModel(
        config=config,
        pre_process=pre_process,
        post_process=post_process,
        img_h=args.img_h,
        img_w=args.img_w,
        patch_dim=args.patch_dim,
        num_channels=args.num_channels,
    )


def loss_func(images: torch.Tensor, masks: torch.Tensor, output_tensor: torch.Tensor):
    """Squared error over the masked pixels / their count; PSNR and SSIM of the outputs and the
    images with the visible pixels zeroed (Megatron's metric inputs), averaged over DP."""
    outputs = output_tensor.contiguous().float()
    visible = (1 - masks).bool().expand_as(outputs)
    masked_outputs = outputs.masked_fill(visible, 0)
    masked_images = images.float().masked_fill(visible, 0)
    count = masks.expand_as(outputs).sum().clamp(min=1)
    loss = F.mse_loss(masked_outputs, masked_images, reduction='sum') / count
    quality = [psnr(masked_outputs, masked_images), ssim(masked_outputs, masked_images)]
    averaged = average_losses_across_data_parallel_group([loss] + [q.detach() for q in quality])
    return loss, {'loss': averaged[0], 'psnr': averaged[1], 'ssim': averaged[2]}


def forward_step(data_iterator, model: VitInpaintingModel):
    """Forward one micro-batch of masked images: (reconstruction, loss function)."""
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    images, masks = image_batch(data_iterator, second_dtype=torch.float32)
    timers('batch-generator').stop()
    masked_images = images.masked_fill(masks.bool().expand_as(images), 0)
    return model(masked_images), partial(loss_func, images, masks)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """The training and validation image folders of --data-path, with masks."""
    return vision_datasets(get_args(), 'inpaint')


# Every rank reads its own batches, as in pretrain_vision_classify.py.
train_valid_test_datasets_provider.is_distributed = True


if __name__ == '__main__':
    run_main(
        pretrain,
        train_valid_test_datasets_provider,
        model_provider,
        ModelType.encoder_or_decoder,
        forward_step,
        args_defaults={'dataloader_type': 'cyclic', 'vision_pretraining': True},
    )
