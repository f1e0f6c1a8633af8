#!/bin/bash
# Train a small Llama-style GPT fully sharded with PyTorch FSDP2 (--use-torch-fsdp2) on 4
# processes: each rank keeps a quarter of the parameters, gradients and Adam state, gathers one
# transformer layer at a time, and reduce-scatters gradients in fp32 once per step. TP=2 runs
# TP2 x FSDP2 on the same 4 processes. Runs on a CPU-only machine (gloo) in a few minutes; with
# GPUs the same command uses NCCL. A torch_dist checkpoint is saved in $WORK_DIR/ckpt at the
# end; running again with a larger TRAIN_ITERS resumes from it, also at another TP / NPROC
# (docs/fsdp.md, "Checkpoints").
#
# Usage (from the repository root):   bash examples/fsdp/train_gpt_fsdp2.sh
# Environment: WORK_DIR (default ./fsdp_work), TRAIN_ITERS (default 50), NPROC (default 4),
#              TP (tensor parallel size, default 1), BF16 (1: --bf16, default 0 = fp32),
#              HSDP (replicas for --num-distributed-optimizer-instances, default 1: plain FSDP;
#              2 on 4 processes = 2 replicas x 2 shards), EP (expert-parallel size: with EP > 1
#              every MLP is an MoE of 4 experts, sharded over the expert-data-parallel ranks).

set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-fsdp_work}
TRAIN_ITERS=${TRAIN_ITERS:-50}
NPROC=${NPROC:-4}
TP=${TP:-1}
BF16=${BF16:-0}
HSDP=${HSDP:-1}
EP=${EP:-1}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

VOCAB_FILE=data/gpt2/gpt2-vocab.json
MERGE_FILE=data/gpt2/gpt2-merges.txt
mkdir -p "$WORK_DIR/data"

if [ ! -f "$WORK_DIR/data/mobydick_text_document.idx" ]; then
    echo "==> preprocessing data/corpus/mobydick.jsonl into $WORK_DIR/data/mobydick_text_document.{bin,idx}"
    "$PYTHON" tools/preprocess_data.py \
        --input data/corpus/mobydick.jsonl \
        --output-prefix "$WORK_DIR/data/mobydick" \
        --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$VOCAB_FILE" \
        --merge-file "$MERGE_FILE" \
        --append-eod \
        --workers 2
fi

PRECISION=()
if [ "$BF16" = 1 ]; then PRECISION=(--bf16); fi
SHARDING=(--num-distributed-optimizer-instances "$HSDP")
if [ "$EP" -gt 1 ]; then
    SHARDING+=(--num-experts 4 --moe-router-topk 2 --expert-model-parallel-size "$EP")
fi

echo "==> training with --use-torch-fsdp2 on $NPROC processes (TP $TP, data parallel $((NPROC / TP)), HSDP replicas $HSDP, EP $EP)"
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_gpt.py \
    --num-layers 4 --hidden-size 128 --ffn-hidden-size 256 --num-attention-heads 4 \
    --seq-length 64 --max-position-embeddings 64 \
    --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --tensor-model-parallel-size "$TP" \
    --use-torch-fsdp2 \
    "${SHARDING[@]}" \
    "${PRECISION[@]}" \
    --micro-batch-size 2 --global-batch-size 16 --train-iters "$TRAIN_ITERS" \
    --lr 2.0e-3 --min-lr 2.0e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
    --weight-decay 0.01 --clip-grad 1.0 \
    --data-path "$WORK_DIR/data/mobydick_text_document" \
    --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --split 90,8,2 --num-workers 0 --data-cache-path "$WORK_DIR/cache" \
    --log-interval 10 --eval-interval "$TRAIN_ITERS" --eval-iters 2 \
    --ckpt-format torch_dist --save "$WORK_DIR/ckpt" --load "$WORK_DIR/ckpt" \
    --save-interval "$TRAIN_ITERS"
