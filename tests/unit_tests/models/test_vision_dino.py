"""DINO's pieces against small hand-computed references: the loss with its centering, the
teacher temperature and momentum schedules, the EMA update, the last-layer freeze, the
weight-normalised layer, multi-crop batching and position interpolation."""

import math

import numpy as np
import pytest
import torch

from megatron.legacy.model.vision.dino import (
    DINOLoss,
    WeightNormLinear,
    teacher_momentum,
    teacher_temperatures,
)
from tests.unit_tests.dist_utils import run_distributed


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def test_loss_and_center_equal_a_direct_computation():
    rng = np.random.default_rng(0)
    b, dim, ncrops = 3, 5, 4
    student = rng.normal(size=(ncrops * b, dim)).astype(np.float32)
    teacher = rng.normal(size=(2 * b, dim)).astype(np.float32)
    temps = teacher_temperatures(0.04, 0.07, 3)
    loss_fn = DINOLoss(dim, ncrops, temps)
    loss_fn.center.fill_(0.25)
    loss = loss_fn(torch.from_numpy(student), torch.from_numpy(teacher), epoch=1).item()

    temp = 0.055  # epoch 1 of the linear warm-up 0.04 -> 0.07 over 3 epochs
    q = np.exp(_log_softmax((teacher - 0.25) / temp))
    s = _log_softmax(student / 0.1)
    terms = [
        (-q[iq * b : (iq + 1) * b] * s[v * b : (v + 1) * b]).sum(-1).mean()
        for iq in range(2)
        for v in range(ncrops)
        if v != iq
    ]
    assert loss == pytest.approx(np.mean(terms), rel=1e-5)
    expected_center = 0.9 * 0.25 + 0.1 * teacher.mean(axis=0)
    np.testing.assert_allclose(loss_fn.center.numpy()[0], expected_center, rtol=1e-6)
    before = loss_fn.center.clone()
    loss_fn(torch.from_numpy(student), torch.from_numpy(teacher), epoch=1, update_center=False)
    assert torch.equal(loss_fn.center, before)


def test_schedules():
    temps = teacher_temperatures(0.04, 0.07, 30)
    assert (
        len(temps) == 300 and temps[0] == pytest.approx(0.04) and temps[29] == pytest.approx(0.07)
    )
    assert temps[100] == pytest.approx(0.07)
    assert teacher_momentum(0, 100) == pytest.approx(0.996)
    assert teacher_momentum(50, 100) == pytest.approx(0.998)
    assert teacher_momentum(100, 100) == pytest.approx(1.0)
    assert teacher_momentum(150, 100) == pytest.approx(1.0)  # never past the end


def test_weight_norm_layer():
    layer = WeightNormLinear(4, 3)
    with torch.no_grad():
        layer.weight_g.copy_(torch.tensor([[2.0], [0.5], [1.0]]))
    x = torch.randn(2, 4)
    v = layer.weight_v.detach()
    w = layer.weight_g.detach() * v / v.norm(dim=1, keepdim=True)
    torch.testing.assert_close(layer(x), x @ w.t())
    assert sorted(dict(layer.named_parameters())) == ['weight_g', 'weight_v']


def _dino_model(freeze_last_layer=1.0):
    from megatron.legacy.model.vision.dino import DINOPretrainModel
    from tests.unit_tests.models.vision_test_utils import vit_config

    config = vit_config('clip', activation_func=torch.nn.functional.gelu)
    return DINOPretrainModel(
        config, img_size=8, patch_dim=2, num_channels=3, local_crops_number=2,
        local_img_size=4, head_hidden=16, bottleneck=8, out_dim=12, norm_last_layer=True,
        temperatures=teacher_temperatures(0.04, 0.07, 2), freeze_last_layer=freeze_last_layer,
        iter_per_epoch=10, train_iters=40,
    )  # fmt: skip


def _ema_and_freeze():
    model = _dino_model()
    student, teacher = (
        dict(model.student.named_parameters()),
        dict(model.teacher.named_parameters()),
    )
    same_start = all(torch.equal(student[n], teacher[n]) for n in student)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for p in model.student.parameters():
            p.add_(1.0)
    old = {n: p.clone() for n, p in teacher.items()}
    model.update_momentum(20)
    m = teacher_momentum(20, 40)
    ema_ok = all(torch.allclose(teacher[n], m * old[n] + (1 - m) * student[n]) for n in old)
    last = model.student.head.last_layer.weight_v
    last.grad = torch.ones_like(last)
    model.cancel_gradients_last_layer(5)  # epoch 0 < 1: cancelled
    cancelled = bool((last.grad == 0).all())
    last.grad = torch.ones_like(last)
    model.cancel_gradients_last_layer(15)  # epoch 1: kept
    kept = bool((last.grad == 1).all())
    return same_start, trainable, ema_ok, cancelled, kept


def test_teacher_ema_and_last_layer_freeze():
    same_start, trainable, ema_ok, cancelled, kept = run_distributed(_ema_and_freeze, world_size=1)[
        0
    ]
    assert same_start and ema_ok and cancelled and kept
    assert trainable and all(n.startswith('student.') for n in trainable)
    assert 'student.head.last_layer.weight_g' not in trainable  # norm_last_layer


def _multicrop():
    model = _dino_model()
    g = torch.Generator().manual_seed(0)
    crops = [torch.randn(2, 3, 8, 8, generator=g) for _ in range(2)]
    crops += [torch.randn(2, 3, 4, 4, generator=g) for _ in range(2)]
    with torch.no_grad():
        together = model.student(crops)
        alone = torch.cat([model.student([c]) for c in crops])
        student, teacher = model(crops)
    backbone = model.student.backbone
    pos = backbone.position_embeddings.weight
    grid = pos[1:].reshape(1, 4, 4, -1).permute(0, 3, 1, 2)
    small = torch.nn.functional.interpolate(grid, size=(2, 2), mode='bilinear', align_corners=False)
    expected = torch.cat([pos[:1], small.permute(0, 2, 3, 1).reshape(4, -1)])
    return together, alone, student.shape, teacher.shape, backbone._positions(2, 2)[0], expected


def test_multicrop_batching_and_position_interpolation():
    together, alone, s_shape, t_shape, pos, expected = run_distributed(_multicrop, world_size=1)[0]
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)
    assert s_shape == (8, 12) and t_shape == (4, 12)  # 4 crops x 2 images; 2 global for the teacher
    torch.testing.assert_close(pos, expected)
    assert math.isfinite(float(together.abs().sum()))


def _knn_by_hand(query, bank, labels, classes, k, t):
    """Top label of each query: its k most similar bank rows vote exp(sim / t) each."""
    tops = []
    for q in query:
        sims = [float(np.dot(q, b)) for b in bank]
        nearest = sorted(range(len(bank)), key=lambda i: -sims[i])[:k]
        votes = [0.0] * classes
        for i in nearest:
            votes[labels[i]] += math.exp(sims[i] / t)
        tops.append(int(np.argmax(votes)))
    return tops


def test_knn_predict_and_accuracies_equal_a_direct_vote():
    from megatron.legacy.model.vision import knn_monitor as knn

    # Hand case: (1, 0) has (1, 0) [class 0] and (0.8, 0.6) [class 1] nearest; with T = 0.07 the
    # closer one's exp(1 / T) outweighs exp(0.8 / T) + exp(0 / T).
    bank = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-1.0, 0.0]])
    labels = torch.tensor([0, 1, 1, 0])
    query = torch.tensor([[1.0, 0.0], [0.6, 0.8]])
    for k, expected in ((1, [0, 1]), (2, [0, 1]), (3, [0, 1]), (4, [0, 1])):
        ranked = knn.knn_predict(query, bank.t(), labels, 2, k, 0.07)
        assert ranked[:, 0].tolist() == expected, k
    # Random case against the direct vote, k beyond the bank included.
    g = torch.Generator().manual_seed(0)
    bank = torch.nn.functional.normalize(torch.randn(50, 8, generator=g), dim=1)
    labels = torch.randint(0, 5, (50,), generator=g)
    query = torch.nn.functional.normalize(torch.randn(7, 8, generator=g), dim=1)
    for k in (1, 10, 200):
        ranked = knn.knn_predict(query, bank.t(), labels, 5, k, 0.07)
        assert ranked[:, 0].tolist() == _knn_by_hand(
            query.numpy(), bank.numpy(), labels.tolist(), 5, k, 0.07
        )
    # knn_acc_K over the bank set by compute_feature_bank (here set directly).
    knn.reset_feature_bank({'features': bank.t(), 'labels': labels, 'classes': 5})
    try:
        truth = torch.tensor(
            _knn_by_hand(query.numpy(), bank.numpy(), labels.tolist(), 5, 10, 0.07)
        )
        truth[:3] = (truth[:3] + 1) % 5  # three wrong labels
        accuracies = knn.knn_accuracies(query * 3.0, truth, ks=(10,))  # features are normalised
        assert accuracies[0].item() == pytest.approx(4 / 7)
    finally:
        knn.reset_feature_bank()
