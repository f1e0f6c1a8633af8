"""Pretrain a ViT image classifier (Megatron's pretrain_vision_classify.py).

Thin entry script: the model provider, the batch getter, the loss (logged as `loss` and
`accuracy`, in training and in evaluation), the forward step and the dataset provider;
`pretrain()` does the rest. `--data-path TRAIN_DIR VALID_DIR` names two image folders (one
sub-folder per class); `bash examples/vision/quickstart_vision.sh` trains on the bundled digits.
"""

from functools import partial

import torch
import torch.nn.functional as F

from megatron.core.enums import ModelType
from megatron.legacy.model.vision.classification import VitClassificationModel
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.vision_batch import image_batch, vision_datasets
from megatron.training.global_vars import get_args, get_timers
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import average_losses_across_data_parallel_group, print_rank_0


def model_provider(pre_process=True, post_process=True) -> VitClassificationModel:
    """The ViT classifier (the whole model on one pipeline stage)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    print_rank_0('building VIT model ...')
    return VitClassificationModel(
        config=config,
        num_classes=args.num_classes,
        pre_process=pre_process,
        post_process=post_process,
        img_h=args.img_h,
        img_w=args.img_w,
        patch_dim=args.patch_dim,
        num_channels=args.num_channels,
        layout=args.vit_layout,
    )


def loss_func(labels: torch.Tensor, output_tensor: torch.Tensor):
    """Cross entropy of the logits, and the share of correct answers, averaged over DP."""
    logits = output_tensor.contiguous().float()
    loss = F.cross_entropy(logits, labels)
    accuracy = (logits.argmax(dim=-1) == labels).float().mean()
    averaged = average_losses_across_data_parallel_group([loss, accuracy])
    return loss, {'loss': averaged[0], 'accuracy': averaged[1]}


def forward_step(data_iterator, model: VitClassificationModel):
    """Forward one micro-batch: (logits, loss function)."""
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    images, labels = image_batch(data_iterator)
    timers('batch-generator').stop()
    return model(images), partial(loss_func, labels)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """The training and validation image folders of --data-path (no test split)."""
    return vision_datasets(get_args(), 'classify')


# Every rank reads its own batches (the images are not broadcast over the TP group): the seeded
# transforms give all ranks of a data-parallel replica the same samples.
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
