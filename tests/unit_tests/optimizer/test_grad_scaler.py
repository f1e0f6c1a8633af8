"""Loss scalers: Megatron's dynamic scaling with hysteresis, growth window and minimum."""

import pytest
import torch

from megatron.core.optimizer.grad_scaler import ConstantGradScaler, DynamicGradScaler


def _dynamic(**kwargs):
    args = dict(
        initial_scale=2.0**16,
        min_scale=1.0,
        growth_factor=2.0,
        backoff_factor=0.5,
        growth_interval=4,
        hysteresis=2,
    )
    args.update(kwargs)
    return DynamicGradScaler(**args)


def test_hysteresis_then_halving_on_every_overflow():
    scaler = _dynamic()
    scaler.update(True)  # first overflow: tolerated (hysteresis 2 -> 1)
    assert scaler.scale.item() == 2.0**16
    scaler.update(True)  # second: halved
    assert scaler.scale.item() == 2.0**15
    scaler.update(True)  # tracker stays <= 0: halves again until a clean window
    assert scaler.scale.item() == 2.0**14
    assert scaler.inv_scale.item() == 2.0**-14


def test_growth_after_window_resets_hysteresis():
    scaler = _dynamic()
    scaler.update(True)
    scaler.update(True)  # 2**15
    for i in range(3):
        scaler.update(False)
        assert scaler.scale.item() == 2.0**15
    scaler.update(False)  # 4th clean step = growth_interval
    assert scaler.scale.item() == 2.0**16
    # Hysteresis tracker was reset: one overflow is tolerated again.
    scaler.update(True)
    assert scaler.scale.item() == 2.0**16
    # An overflow resets the growth tracker.
    for _ in range(3):
        scaler.update(False)
    scaler.update(True)
    assert scaler.scale.item() == 2.0**15
    for _ in range(3):
        scaler.update(False)
    assert scaler.scale.item() == 2.0**15


def test_min_scale_and_state_dict():
    scaler = _dynamic(initial_scale=4.0, min_scale=2.0, hysteresis=1)
    for _ in range(3):
        scaler.update(True)
    assert scaler.scale.item() == 2.0
    scaler.update(False)
    sd = scaler.state_dict()
    assert set(sd) == {'scale', 'growth_tracker', 'hysteresis_tracker'}
    other = _dynamic()
    other.load_state_dict(sd)
    assert other.scale.item() == 2.0 and other.state_dict()['growth_tracker'] == 1


def test_megatron_defaults_through_get_megatron_optimizer_config():
    from megatron.core.optimizer import OptimizerConfig

    config = OptimizerConfig(fp16=True, lr=1e-3)
    assert (
        config.initial_loss_scale,
        config.min_loss_scale,
        config.loss_scale_window,
        config.hysteresis,
    ) == (
        2**32,
        1.0,
        1000,
        2,
    )
    with pytest.raises(ValueError, match='--fp16, --bf16'):
        OptimizerConfig(fp16=True, bf16=True)


def test_constant_scaler():
    scaler = ConstantGradScaler(1024.0)
    scaler.update(True)
    scaler.update(False)
    assert scaler.scale.item() == 1024.0
    assert scaler.state_dict() == {}
    with pytest.raises(ValueError):
        ConstantGradScaler(0.0)
    assert isinstance(scaler.scale, torch.Tensor)
