"""Packed conversations (`--sft`) under context parallelism, end to end through pretrain_gpt.py:
CP2 and CP2 x TP2 (sequence parallel) reproduce the CP1 losses and gradient norms.

The chat set is written here: short arithmetic conversations, one or two per row, read with
`--sft-one-row-per-sample` so that every layout packs the same conversations into the same
samples (with CP > 1 each conversation is padded to a multiple of 2 x cp, which changes a
best-fit plan), and no row is truncated. Answers are a few tokens among prompts, so the loss mask
matters; one or two conversations per sample (each padded differently), two samples per
micro-batch. Comm types: CP2 runs p2p on layer 1 and a2a on layer 2; CP2 x TP2 runs all_gather.

Tolerance: relative 1e-5 per iteration (fp32), gradient norms (logged with 3 decimals) 1.5e-3.
"""

import json
import re

import pytest

from tests.functional_tests.gpt_utils import run_pretrain
from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

SEQ = 64
ITERS = 3
SYSTEMS = ["Be brief.", "Answer with a number.", "You add numbers."]


def _conversation(i):
    a, b = (7 * i) % 23, (11 * i) % 17
    return [
        {"role": "system", "content": SYSTEMS[i % 3]},
        {"role": "user", "content": f"{a}+{b}?"},
        {"role": "assistant", "content": f"{a + b}."},
    ]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """(chat.jsonl, tokenizer directory)."""
    from examples.sft.make_tiny_llama import build_tokenizer

    folder = tmp_path_factory.mktemp("sft_cp")
    path = folder / "chat.jsonl"
    with open(path, "w", encoding="utf-8") as f:
        for row in range(48):
            messages = []
            for k in range(1 + row % 2):
                messages += _conversation(2 * row + k)
            f.write(json.dumps({"messages": messages}) + "\n")
    build_tokenizer(str(path), 300).save_pretrained(str(folder / "tok"))
    return str(path), str(folder / "tok")


def _args(chat, cache, cp, tp, comm):
    path, tokenizer = chat
    return (
        [
            "--sft",
            "--sft-one-row-per-sample",
            "--sft-long-conversations",
            "error",
            "--tokenizer-type",
            "SFTTokenizer",
            "--tokenizer-model",
            tokenizer,
            "--sft-tokenizer-prompt-format",
            "default",
            "--data-path",
            path,
            "--split",
            "90,10,0",
            "--data-cache-path",
            cache,
            "--num-layers",
            "2",
            "--hidden-size",
            "32",
            "--num-attention-heads",
            "4",
            "--group-query-attention",
            "--num-query-groups",
            "2",
            "--position-embedding-type",
            "rope",
            "--normalization",
            "RMSNorm",
            "--untie-embeddings-and-output-weights",
            "--seq-length",
            str(SEQ),
            "--max-position-embeddings",
            str(SEQ),
            "--make-vocab-size-divisible-by",
            "256",  # 300 tokens -> 512 rows at TP1 and TP2 alike
            "--attention-dropout",
            "0.0",
            "--hidden-dropout",
            "0.0",
            "--micro-batch-size",
            "2",
            "--global-batch-size",
            "4",
            "--lr",
            "5e-3",
            "--train-iters",
            str(ITERS),
            "--eval-iters",
            "1",
            "--eval-interval",
            "1000",
            "--log-interval",
            "1",
            "--num-workers",
            "0",
            "--seed",
            "1234",
            "--tensor-model-parallel-size",
            str(tp),
            "--context-parallel-size",
            str(cp),
        ]
        + (["--cp-comm-type"] + comm.split() if comm else [])
        + (["--sequence-parallel"] if tp > 1 else [])
    )


def _run(chat, cache, cp=1, tp=1, comm=None):
    outs = run_distributed(
        run_pretrain,
        world_size=cp * tp,
        tp=tp,
        cp=cp,
        args=(_args(chat, cache, cp, tp, comm),),
        kwargs=dict(reference_weights=0.2, base_args=[], args_defaults={}, capture_stdout=True),
        timeout=600,
    )
    result = outs[-1]
    assert result["iteration"] == ITERS
    losses = [float(result["train_losses"][i]["lm loss"]) for i in range(1, ITERS + 1)]
    norms = [float(x) for x in re.findall(r"grad norm: ([0-9.]+) \|", result["stdout"])]
    return losses, norms, float(result["valid_losses"]["lm loss"])


def test_cp2_and_cp2_tp2_reproduce_cp1_packed_losses(chat, tmp_path):
    cache = str(tmp_path / "cache")
    cp1 = _run(chat, cache)
    for layout in (dict(cp=2, comm="p2p a2a"), dict(cp=2, tp=2, comm="all_gather")):
        losses, norms, valid = _run(chat, cache, **layout)
        assert losses == pytest.approx(cp1[0], rel=1e-5), (layout, losses, cp1[0])
        assert norms == pytest.approx(cp1[1], abs=1.5e-3), (layout, norms, cp1[1])
        assert valid == pytest.approx(cp1[2], rel=1e-5), (layout, valid, cp1[2])
