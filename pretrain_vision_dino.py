"""Pretrain a ViT by DINO self-distillation (Megatron's pretrain_vision_dino.py).

Thin entry script: the model provider (student + EMA teacher, megatron/legacy/model/vision/
dino.py), the batch getter (2 global and --dino-local-crops-number local views of each image),
the loss (`loss`, DINO's cross-view cross entropy at the epoch's teacher temperature; in
evaluation also Megatron's `knn_acc_10` ... `knn_acc_200`), the forward step and the dataset
provider; `pretrain()` does the rest and calls the model's
`cancel_gradients_last_layer` / `update_momentum` hooks around each optimizer step.
"""

from functools import partial

from megatron.core.enums import ModelType
from megatron.core.utils import get_current_device, unwrap_model
from megatron.legacy.model.vision.dino import DINOPretrainModel, teacher_temperatures
from megatron.legacy.model.vision.knn_monitor import KNN_KS, ensure_feature_bank, knn_accuracies
from megatron.training.arguments import core_transformer_config_from_args
from megatron.training.datasets.vision_batch import vision_datasets
from megatron.training.global_vars import get_args, get_timers
from megatron.training.run_control.errors import run_main
from megatron.training.training import pretrain
from megatron.training.utils import average_losses_across_data_parallel_group, print_rank_0


def model_provider(pre_process=True, post_process=True) -> DINOPretrainModel:
    """Student and teacher ViTs with DINO heads (the whole model on one pipeline stage)."""
    args = get_args()
    config = core_transformer_config_from_args(args)
    print_rank_0('building VIT model ...')
    return DINOPretrainModel(
        config,
        img_size=args.img_h,
        patch_dim=args.patch_dim,
        num_channels=args.num_channels,
        local_crops_number=args.dino_local_crops_number,
        local_img_size=args.dino_local_img_size,
        head_hidden=args.dino_head_hidden_size,
        bottleneck=args.dino_bottleneck_size,
        out_dim=args.dino_out_dim,
        norm_last_layer=args.dino_norm_last_layer,
        temperatures=teacher_temperatures(
            args.dino_warmup_teacher_temp,
            args.dino_teacher_temp,
            args.dino_warmup_teacher_temp_epochs,
        ),
        freeze_last_layer=args.dino_freeze_last_layer,
        iter_per_epoch=args.iter_per_epoch,
        train_iters=args.train_iters,
        pre_process=pre_process,
        post_process=post_process,
    )


def loss_func(model: DINOPretrainModel, epoch: int, labels, teacher_feature, output_tensor):
    """DINO loss of (student, teacher) logits; the center moves in training only. In
    evaluation also Megatron's k-NN accuracies (`knn_acc_10` ... `knn_acc_200`) of the teacher's
    features of the first global view against the bank of training images (knn_monitor.py)."""
    student_output, teacher_output = output_tensor
    loss = model.dino_loss(student_output, teacher_output, epoch, update_center=model.training)
    if teacher_feature is None:
        averaged = average_losses_across_data_parallel_group([loss])
        return loss, {'loss': averaged[0]}
    accuracies = knn_accuracies(teacher_feature, labels)
    averaged = average_losses_across_data_parallel_group([loss] + accuracies)
    names = ['loss'] + [f'knn_acc_{k}' for k in KNN_KS]
    return loss, dict(zip(names, averaged))


def forward_step(data_iterator, model):
    """Forward one micro-batch of multi-crop views: ((student, teacher) logits, loss function)."""
    args = get_args()
    timers = get_timers()
    timers('batch-generator', log_level=2).start()
    crops, labels = next(data_iterator)
    device = get_current_device()
    crops = [c.to(device, non_blocking=True) for c in crops]
    labels = labels.to(device)
    timers('batch-generator').stop()
    unwrapped = unwrap_model(model)
    epoch = unwrapped.epoch(args.curr_iteration)
    teacher_feature = None
    if not unwrapped.training:
        ensure_feature_bank(model, args.curr_iteration)
        teacher_feature = unwrapped.teacher_features(crops[0])  # [b, hidden], for the k-NN
    return model(crops), partial(loss_func, unwrapped, epoch, labels, teacher_feature)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """The training and validation image folders of --data-path, as multi-crop views."""
    return vision_datasets(get_args(), 'dino')


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
