"""Shared pieces of the vision end-to-end tests: the bundled digits as an image folder, the tiny
ViT's flags, and the worker that runs pretrain_vision_classify.py's pretrain() on one rank."""

import fcntl
import os
import subprocess
import sys

from tests.functional_tests.gpt_utils import REPO, run_pretrain

#: A tiny ViT on the 8x8 digits: patches of 2 (16 patches + 8 class tokens = 24 tokens).
TINY_VIT_ARGS = [
    '--num-layers', '2', '--hidden-size', '32', '--num-attention-heads', '4',
    '--img-h', '8', '--img-w', '8', '--patch-dim', '2', '--num-channels', '1',
    '--num-classes', '10', '--attention-dropout', '0.0', '--hidden-dropout', '0.0',
    '--lr', '2e-3', '--min-lr', '1e-4', '--lr-decay-style', 'cosine', '--log-interval', '1',
    '--num-workers', '0', '--distributed-backend', 'gloo', '--no-data-sharding',
    '--data-per-class-fraction', '0.2',
]  # fmt: skip

VISION_DEFAULTS = {'dataloader_type': 'cyclic', 'vision_pretraining': True}


def prepare_digits(work_dir: str) -> str:
    """tools/prepare_image_folder.py --digits into work_dir once (file-locked); returns it."""
    os.makedirs(work_dir, exist_ok=True)
    with open(os.path.join(work_dir, '.lock'), 'w') as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(os.path.join(work_dir, 'digits', 'train')):
            subprocess.run(
                [
                    sys.executable,
                    os.path.join(REPO, 'tools', 'prepare_image_folder.py'),
                    '--digits',
                    '--output',
                    os.path.join(work_dir, 'digits'),
                ],
                check=True,
                capture_output=True,
                text=True,
            )
        fcntl.flock(lock, fcntl.LOCK_UN)
    return os.path.join(work_dir, 'digits')


def run_vision_classify(extra_args, capture_stdout=False, script='pretrain_vision_classify'):
    """A vision script's pretrain() on this rank, from layout-independent weights (see
    gpt_utils.set_reference_weights; QKV std 0.2 so that attention is not uniform)."""
    return run_pretrain(
        extra_args,
        reference_weights=0.2,
        capture_stdout=capture_stdout,
        script=script,
        base_args=TINY_VIT_ARGS,
        args_defaults=VISION_DEFAULTS,
    )
