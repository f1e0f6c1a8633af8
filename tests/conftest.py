"""Root conftest: GPU-marker skipping and clean shutdown of the distributed test worker pools."""

import sys

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard requirement
        return False
    return torch.cuda.is_available()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line("markers", "slow: long-running end-to-end test")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in gpu_items:
        item.add_marker(skip_gpu)


def pytest_sessionfinish(session, exitstatus):
    # Only shut pools down if some test actually used the harness (avoid importing torch otherwise).
    dist_utils = sys.modules.get("tests.unit_tests.dist_utils")
    if dist_utils is not None:
        dist_utils.shutdown_all_pools()
