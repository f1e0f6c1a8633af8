"""ViT classification training step: ours against Hugging Face `ViTForImageClassification`, and
the image reader's rate beside it.

Rows (images/s of one training step: forward, cross-entropy, backward, AdamW; fp32; no dropout):
- `ours`: `VitClassificationModel` exactly as `pretrain_vision_classify.py` builds it (the core
  `CLIPViTModel` with Megatron's 8 class tokens, `ln_post`, the tanh MLP head), with the Adam
  that `get_megatron_optimizer` gives (torch's fused AdamW; no clipping);
- `ours, HF layout`: the same model with HF's geometry (one class token, a linear head), so the
  ratio compares like with like;
- `HF`: `ViTForImageClassification` of the same size (its default SDPA attention) with
  `torch.optim.AdamW()`, what a Trainer user gets.
The three alternate step by step in this process (median over the timed steps), so load from
other processes hits them alike. `reader` is images/s of the training dataset of
`pretrain_vision_classify.py` alone (Pillow decode + Megatron's random-resized-crop / flip /
colour-jitter / normalise, one process), over the bundled handwritten digits written at the
preset's image size as RGB: if it is well above the step's rate, `--num-workers` DataLoader
workers keep the step fed.

Presets: `small` (64x64 RGB, patch 8, 6 layers, hidden 192, 3 heads, batch 16) and `vit-ti`
(ViT-Ti/16 at 224x224: 12 layers, hidden 192, 3 heads, batch 8, 1000 classes).

Usage: python benchmarks/bench_vision.py [--preset small|vit-ti] [--steps 8] [--threads 2]
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

PRESETS = {
    'small': dict(img=64, patch=8, layers=6, hidden=192, heads=3, ffn=768, classes=10, batch=16),
    'vit-ti': dict(
        img=224, patch=16, layers=12, hidden=192, heads=3, ffn=768, classes=1000, batch=8
    ),
}


def _parse():
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument('--preset', choices=sorted(PRESETS), default='small')
    parser.add_argument('--steps', type=int, default=8, help='timed steps per model')
    parser.add_argument('--threads', type=int, default=2)
    parser.add_argument('--reader-images', type=int, default=256)
    return parser.parse_args()


def _init_single_process():
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    torch.distributed.init_process_group(
        'gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1
    )
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)


def _ours(cfg, hf_layout):
    """(model, optimizer) of pretrain_vision_classify.py's classifier at this size."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.legacy.model.vision.classification import VitClassificationModel

    config = TransformerConfig(
        num_layers=cfg['layers'],
        hidden_size=cfg['hidden'],
        num_attention_heads=cfg['heads'],
        ffn_hidden_size=cfg['ffn'],
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=0.02,
    )
    extra = dict(finetune=True, class_token_len=1) if hf_layout else {}
    model = VitClassificationModel(
        config,
        num_classes=cfg['classes'],
        img_h=cfg['img'],
        img_w=cfg['img'],
        patch_dim=cfg['patch'],
        num_channels=3,
        **extra,
    )
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer='adam', lr=1e-4, weight_decay=0.01, clip_grad=0.0), [model]
    )
    return model, optimizer


def _hf(cfg):
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        image_size=cfg['img'],
        patch_size=cfg['patch'],
        num_channels=3,
        hidden_size=cfg['hidden'],
        num_hidden_layers=cfg['layers'],
        num_attention_heads=cfg['heads'],
        intermediate_size=cfg['ffn'],
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        num_labels=cfg['classes'],
    )
    model = ViTForImageClassification(config)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)


def _step_fn(name, model, optimizer, images, labels):
    def step():
        optimizer.zero_grad()
        if name == 'HF':
            loss = model(pixel_values=images, labels=labels).loss
        else:
            loss = torch.nn.functional.cross_entropy(model(images).float(), labels)
        loss.backward()
        optimizer.step()

    return step


def _time_steps(steps, n):
    """images/s of each step function, alternating them, after one warm-up step each."""
    for step in steps.values():
        step()
    times = {name: [] for name in steps}
    for _ in range(n):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def _to_rgb(folder):
    """The digits are grayscale: rewrite them as RGB, the three channels the models read."""
    from PIL import Image

    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            Image.open(path).convert('RGB').save(path)


def _reader_rate(cfg, count):
    """images/s of the classify training dataset over the digits at the preset's size."""
    from megatron.legacy.data.vit_dataset import build_train_valid_datasets

    with tempfile.TemporaryDirectory() as work:
        folder = os.path.join(work, 'digits')
        subprocess.run(
            [sys.executable, os.path.join(REPO, 'tools', 'prepare_image_folder.py'), '--digits',
             '--output', folder, '--size', str(cfg['img'])],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        _to_rgb(folder)
        train, _ = build_train_valid_datasets(
            [os.path.join(folder, 'train'), os.path.join(folder, 'val')],
            image_size=(cfg['img'], cfg['img']),
            num_channels=3,
            patch_dim=cfg['patch'],
        )
        count = min(count, len(train))
        start = time.perf_counter()
        for i in range(count):
            train[i]
        return count / (time.perf_counter() - start)


def main():
    args = _parse()
    cfg = PRESETS[args.preset]
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    _init_single_process()
    images = torch.randn(cfg['batch'], 3, cfg['img'], cfg['img'])
    labels = torch.randint(0, cfg['classes'], (cfg['batch'],))
    models = {
        'ours': _ours(cfg, hf_layout=False),
        'ours, HF layout': _ours(cfg, hf_layout=True),
        'HF': _hf(cfg),
    }
    steps = {name: _step_fn(name, m, o, images, labels) for name, (m, o) in models.items()}
    seconds = _time_steps(steps, args.steps)
    params = {name: sum(p.numel() for p in m.parameters()) for name, (m, _) in models.items()}
    print(
        f"preset {args.preset}: {cfg['img']}x{cfg['img']} images, patch {cfg['patch']}, "
        f"{cfg['layers']} layers, hidden {cfg['hidden']}, batch {cfg['batch']}, "
        f"{args.threads} threads, {args.steps} timed steps each (medians); "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    print(f"{'model':<16} {'params':>10} {'images/s':>10} {'ours / HF':>10}")
    hf_rate = cfg['batch'] / seconds['HF']
    for name, t in seconds.items():
        rate = cfg['batch'] / t
        print(f"{name:<16} {params[name]:>10,} {rate:>10.1f} {rate / hf_rate:>9.2f}x")
    reader = _reader_rate(cfg, args.reader_images)
    print(
        f"{'reader':<16} {'':>10} {reader:>10.1f}   (one process; "
        f"{reader / (cfg['batch'] / seconds['ours']):.1f}x the step's rate)"
    )


if __name__ == '__main__':
    main()
