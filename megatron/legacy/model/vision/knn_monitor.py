"""k-NN evaluation of a DINO run (Megatron's `knn_monitor.py`): how well the teacher's features
separate the classes, with no classifier trained.

At the first validation batch after each training step (`ensure_feature_bank`, called by
pretrain_vision_dino.py's forward step; Megatron calls it from `evaluate()`) the training images
(`--data-path`'s first folder, the validation transform: resize and centre crop) go through the
teacher backbone in batches of 16;
their L2-normalised class-token features, gathered from every data-parallel rank, form the
feature bank [D, N] with its labels. A validation image is then classified by its k most
similar bank entries (cosine similarity), each voting for its label with weight exp(sim / T),
T = 0.07; `knn_acc_K` is the share of images whose top vote is their label, for K = 10, 20, 100,
200 (K larger than the bank uses the whole bank).
"""

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as mpu
from megatron.core.utils import get_current_device, unwrap_model

KNN_KS = (10, 20, 100, 200)
KNN_TEMPERATURE = 0.07
BANK_BATCH_SIZE = 16

_BANK: dict = {}


def knn_predict(
    feature: torch.Tensor,
    feature_bank: torch.Tensor,
    feature_labels: torch.Tensor,
    classes: int,
    knn_k: int,
    knn_t: float,
) -> torch.Tensor:
    """Class ranking of each query by a weighted vote of its k nearest bank entries.

    Args:
        feature: [B, D] L2-normalised queries.
        feature_bank: [D, N] L2-normalised bank features.
        feature_labels: [N] int64 labels of the bank.
        classes: number of classes.
        knn_k: neighbours that vote (at most N).
        knn_t: temperature of the vote weights exp(similarity / knn_t).

    Returns:
        [B, classes] class indices, best first.
    """
    k = min(knn_k, feature_bank.size(1))
    similarity = feature @ feature_bank  # [B, N]
    weight, index = similarity.topk(k, dim=-1)  # [B, k]
    neighbour_labels = feature_labels[index]  # [B, k]
    votes = torch.zeros(feature.size(0), classes, dtype=weight.dtype, device=weight.device)
    votes.scatter_add_(1, neighbour_labels, (weight / knn_t).exp())  # [B, classes]
    return votes.argsort(dim=-1, descending=True)


def _bank_dataset(args):
    from megatron.legacy.data.image_folder import ImageFolder
    from megatron.legacy.data.image_transforms import classification_transform
    from megatron.legacy.data.vit_dataset import TransformedImageDataset

    folder = ImageFolder(
        args.data_path[0],
        args.num_channels,
        args.classes_fraction,
        args.data_per_class_fraction,
    )
    transform = classification_transform((args.img_h, args.img_w), False, args.num_channels)
    return TransformedImageDataset(folder, transform, args.seed)


def _gather_dp(tensor: torch.Tensor) -> torch.Tensor:
    """Concatenate every data-parallel rank's rows (ranks may hold different counts)."""
    group = mpu.get_data_parallel_group()
    size = torch.distributed.get_world_size(group)
    if size == 1:
        return tensor
    count = torch.tensor([tensor.size(0)], device=tensor.device)
    counts = [torch.zeros_like(count) for _ in range(size)]
    torch.distributed.all_gather(counts, count, group=group)
    most = int(max(c.item() for c in counts))
    padded = tensor.new_zeros((most,) + tuple(tensor.shape[1:]))
    padded[: tensor.size(0)] = tensor
    parts = [torch.empty_like(padded) for _ in range(size)]
    torch.distributed.all_gather(parts, padded, group=group)
    return torch.cat([p[: int(c.item())] for p, c in zip(parts, counts)])


@torch.no_grad()
def compute_feature_bank(model: List[torch.nn.Module]) -> None:
    """Build the bank from the training images with the teacher (call in evaluation mode)."""
    from megatron.training.global_vars import get_args

    args = get_args()
    teacher = unwrap_model(model[0]).teacher.backbone
    dataset = _bank_dataset(args)
    rank = mpu.get_data_parallel_rank()
    size = mpu.get_data_parallel_world_size()
    indices = list(range(rank, len(dataset), size))  # this rank's share of the images
    device = get_current_device()
    features, labels = [], []
    for start in range(0, len(indices), BANK_BATCH_SIZE):
        items = [dataset[i] for i in indices[start : start + BANK_BATCH_SIZE]]
        images = torch.stack([image for image, _ in items]).to(device)
        features.append(F.normalize(teacher(images)[:, 0].float(), dim=1))  # [b, D]
        labels.append(torch.tensor([label for _, label in items], device=device))
    width = teacher.config.hidden_size
    local = torch.cat(features) if features else torch.zeros(0, width, device=device)
    local_labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.long, device=device)
    _BANK.clear()
    _BANK['features'] = _gather_dp(local).t().contiguous()  # [D, N]
    _BANK['labels'] = _gather_dp(local_labels)
    _BANK['classes'] = len(dataset.classes)


def ensure_feature_bank(model, iteration: int) -> None:
    """Build the bank unless it was built from the weights of this training iteration (every
    evaluation of a run happens between optimizer steps, so the iteration names the weights)."""
    if _BANK.get('iteration') != iteration:
        compute_feature_bank(model if isinstance(model, list) else [model])
        _BANK['iteration'] = iteration


def get_feature_bank() -> Tuple[torch.Tensor, torch.Tensor, int]:
    """(bank [D, N], labels [N], number of classes) of the last `compute_feature_bank`."""
    if 'features' not in _BANK:
        raise RuntimeError('the k-NN feature bank is built at the start of an evaluation')
    return _BANK['features'], _BANK['labels'], _BANK['classes']


def knn_accuracies(
    teacher_feature: torch.Tensor, labels: torch.Tensor, ks=KNN_KS, temperature=KNN_TEMPERATURE
) -> List[torch.Tensor]:
    """knn_acc_K of a batch of teacher class-token features [B, D] with labels [B]."""
    bank, bank_labels, classes = get_feature_bank()
    feature = F.normalize(teacher_feature.float(), dim=1)
    accuracies = []
    for k in ks:
        predicted = knn_predict(feature, bank, bank_labels, classes, k, temperature)
        accuracies.append((predicted[:, 0] == labels).float().mean())
    return accuracies


def reset_feature_bank(bank: Optional[dict] = None) -> None:
    """Forget the bank (tests), or set it to `bank` ({'features', 'labels', 'classes'})."""
    _BANK.clear()
    if bank:
        _BANK.update(bank)
