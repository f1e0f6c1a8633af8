"""pretrain_mamba.py --sft on the bundled chat set (data/sft/chat.jsonl, packed conversations) with
a tiny hybrid (pattern M*-M, RoPE): the answer-token loss falls, and a pipeline-parallel run
(PP2: the last stage's Mamba and attention layers take the segment boundaries from the packed
batch, not from tokens) reports the serial losses at every iteration from the same weights.
The Mamba states are made to decay slowly, so a state leaking across a conversation boundary
would change the answer tokens' loss."""

import math
import os

import pytest

from tests.functional_tests.gpt_utils import REPO
from tests.functional_tests.mamba_utils import run_mamba_pretrain
from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CHAT = os.path.join(REPO, "data", "sft", "chat.jsonl")
SEQ = 512
ITERS = 6


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from examples.sft.make_tiny_llama import build_tokenizer

    path = str(tmp_path_factory.mktemp("mamba_sft") / "tok")
    build_tokenizer(CHAT, 512).save_pretrained(path)
    return path


def _args(tokenizer_dir, cache, pp):
    return [
        "--sft", "--tokenizer-type", "SFTTokenizer", "--tokenizer-model", tokenizer_dir,
        "--sft-tokenizer-prompt-format", "default", "--data-path", CHAT, "--split", "95,5,0",
        "--data-cache-path", cache,
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--hybrid-override-pattern", "M*-M", "--mamba-head-dim", "16", "--mamba-num-groups", "2",
        "--mamba-state-dim", "16", "--normalization", "RMSNorm", "--position-embedding-type",
        "rope", "--disable-bias-linear", "--squared-relu", "--no-bias-gelu-fusion",
        "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
        "--make-vocab-size-divisible-by", "64", "--attention-dropout", "0.0",
        "--hidden-dropout", "0.0", "--micro-batch-size", "2", "--global-batch-size", "4",
        "--lr", "5e-3", "--lr-warmup-iters", "1", "--train-iters", str(ITERS),
        "--eval-iters", "1", "--eval-interval", "1000", "--log-interval", "1",
        "--num-workers", "0", "--seed", "1234", "--pipeline-model-parallel-size", str(pp),
    ]  # fmt: skip


def slow_decay(model):
    """Mamba states that barely decay (dt ~ 0.05, A = -0.02): a state leaking across a
    conversation boundary would still reach the answer tokens, so the losses would show it."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mixer.A_log"):
                p.fill_(math.log(0.02))
            elif name.endswith("mixer.dt_bias"):
                p.fill_(-3.0)


def _losses(tokenizer_dir, cache, pp):
    outs = run_distributed(
        run_mamba_pretrain,
        world_size=pp,
        pp=pp,
        args=([],),
        kwargs=dict(base_args=_args(tokenizer_dir, cache, pp), adjust_model=slow_decay),
        timeout=600,
    )
    losses = outs[-1]["train_losses"]
    return [float(losses[i]["lm loss"]) for i in range(1, ITERS + 1)]


def test_sft_loss_falls_and_pp2_matches_serial(tokenizer_dir, tmp_path):
    cache = str(tmp_path / "cache")
    serial = _losses(tokenizer_dir, cache, 1)
    pp2 = _losses(tokenizer_dir, cache, 2)
    assert min(serial[-2:]) < 0.9 * serial[0], serial
    for a, b in zip(serial, pp2):
        assert abs(a - b) <= 1e-5 * abs(a), (serial, pp2)
