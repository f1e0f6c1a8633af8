"""Supervised fine-tuning end to end on the bundled chat set (data/sft/chat.jsonl).

- The loss covers the answers only: in every training sample, the labels under the loss mask
  decode to exactly the assistant turns (content and the template's end of turn) of the sample's
  conversations, read from the JSONL file independently of the dataset code.
- pretrain_gpt.py --sft on a tiny model lowers the answer-token loss, and tensor-parallel (TP2)
  and pipeline-parallel (PP2, whose middle-to-last stage needs the packed boundaries too) runs
  from the same weights report the same losses at every iteration.
- The bundled set is what examples/sft/make_chat_set.py writes.
"""

import json
import os

import pytest

from tests.functional_tests.gpt_utils import REPO, run_pretrain
from tests.unit_tests.dist_utils import run_distributed

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

CHAT = os.path.join(REPO, "data", "sft", "chat.jsonl")
SEQ = 256
ITERS = 12


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from examples.sft.make_tiny_llama import build_tokenizer

    path = str(tmp_path_factory.mktemp("sft_e2e") / "tok")
    build_tokenizer(CHAT, 512).save_pretrained(path)
    return path


def test_bundled_chat_set_is_reproducible(tmp_path):
    from examples.sft.make_chat_set import main

    out = str(tmp_path / "chat.jsonl")
    main(["--output", out])
    with open(out, "rb") as a, open(CHAT, "rb") as b:
        assert a.read() == b.read()


def test_loss_mask_covers_exactly_the_answers(tokenizer_dir, tmp_path):
    from megatron.core.datasets.blended_megatron_dataset_builder import (
        BlendedMegatronDatasetBuilder,
    )
    from megatron.training.datasets.sft_dataset import SFTDataset, SFTDatasetConfig
    from megatron.training.tokenizer.sft_tokenizer import SFTTokenizer

    tokenizer = SFTTokenizer(tokenizer_dir, "default")
    config = SFTDatasetConfig(
        random_seed=1,
        sequence_length=SEQ,
        blend=([CHAT], None),
        split="95,5,0",
        tokenizer=tokenizer,
        path_to_cache=str(tmp_path / "cache"),
    )
    train = BlendedMegatronDatasetBuilder(SFTDataset, [None] * 3, lambda: True, config).build()[0]
    with open(CHAT, encoding="utf-8") as f:
        rows = [json.loads(line)["messages"] for line in f]

    def conversations(messages):
        out = []
        for m in messages:
            if m["role"] == "system" or not out:
                out.append([])
            out[-1].append(m)
        return out

    seen = 0
    for i in range(len(train)):
        sample = train[i]
        items = train.pack_items[train.pack_offsets[i] : train.pack_offsets[i + 1]]
        expected = "".join(
            m["content"] + "<|im_end|>\n"
            for row, c in items.tolist()
            for m in conversations(rows[row])[c]
            if m["role"] == "assistant"
        )
        answers = sample["labels"][sample["loss_mask"] == 1].tolist()
        assert tokenizer.detokenize(answers) == expected, i
        seen += len(items)
    assert seen > 250  # the training split: most of the set's ~300 conversations


def _args(tokenizer_dir, cache, tp, pp):
    return [
        "--sft",
        "--tokenizer-type",
        "SFTTokenizer",
        "--tokenizer-model",
        tokenizer_dir,
        "--sft-tokenizer-prompt-format",
        "default",
        "--data-path",
        CHAT,
        "--split",
        "95,5,0",
        "--data-cache-path",
        cache,
        "--num-layers",
        "2",
        "--hidden-size",
        "64",
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
        "64",
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
        "--lr-warmup-iters",
        "2",
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
        "--distributed-backend",
        "gloo",
        "--seed",
        "1234",
        "--tensor-model-parallel-size",
        str(tp),
        "--pipeline-model-parallel-size",
        str(pp),
    ]


def _losses(tokenizer_dir, cache, tp, pp, extra=(), field="lm loss"):
    outs = run_distributed(
        run_pretrain,
        world_size=tp * pp,
        tp=tp,
        pp=pp,
        args=(_args(tokenizer_dir, cache, tp, pp) + list(extra),),
        kwargs=dict(reference_weights=True, base_args=[], args_defaults={}, capture_stdout=True),
        timeout=600,
    )
    result = outs[-1]
    train = {int(k): float(v["lm loss"]) for k, v in result["train_losses"].items()}
    if field != "lm loss":  # logged only: read from the iteration lines
        lines = [line for line in result["stdout"].splitlines() if "consumed samples:" in line]
        return [float(line.split(f" {field}: ")[1].split(" ")[0]) for line in lines]
    return [train[i] for i in range(1, ITERS + 1)], float(result["valid_losses"]["lm loss"])


def test_finetune_lowers_answer_loss_same_at_tp2_and_pp2(tokenizer_dir, tmp_path):
    cache = str(tmp_path / "cache")
    tp2, tp2_valid = _losses(tokenizer_dir, cache, 2, 1)
    pp2, pp2_valid = _losses(tokenizer_dir, cache, 1, 2)
    # Learning the answers' format: the training loss falls by a fifth in 12 steps, and the
    # held-out conversations' answer loss is lower than the untrained model's.
    assert tp2[-1] < 0.8 * tp2[0] and tp2_valid < 0.9 * tp2[0], (tp2, tp2_valid)
    for a, b in zip(tp2 + [tp2_valid], pp2 + [pp2_valid]):
        assert abs(a - b) <= 1e-5 * abs(a), (tp2, pp2)


def test_multi_token_prediction_on_packed_conversations_same_at_tp2_and_pp2(
    tokenizer_dir, tmp_path
):
    """--mtp-num-layers with --sft: the MTP layer rolls each packed conversation on its own (on
    the last stage under PP2, which reads the tokens too); its loss falls and TP2 and PP2 give
    the same `lm loss` and `mtp_1 loss`."""
    cache = str(tmp_path / "cache")
    mtp = ["--mtp-num-layers", "1"]
    runs = [_losses(tokenizer_dir, cache, tp, pp, mtp, "mtp_1 loss") for tp, pp in ((2, 1), (1, 2))]
    assert len(runs[0]) == ITERS and runs[0][-1] < runs[0][0], runs[0]
    for a, b in zip(*runs):
        assert abs(a - b) <= 2e-6 * abs(a), runs
