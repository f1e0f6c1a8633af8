#!/bin/bash
# Quickstart: train a tiny hybrid Mamba / attention / MLP model (pattern M-M*M-M-) on the bundled
# Moby-Dick corpus with tensor parallel 2 on 2 CPU processes (gloo); the lm loss falls within a
# few dozen iterations. With 2+ GPUs the same command uses NCCL.
#
# Usage (from the repository root):   bash examples/mamba/quickstart_mamba.sh
# Environment: WORK_DIR (default ./quickstart_mamba_work), TRAIN_ITERS (default 60).

set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-quickstart_mamba_work}
TRAIN_ITERS=${TRAIN_ITERS:-60}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1

VOCAB_FILE=data/gpt2/gpt2-vocab.json
MERGE_FILE=data/gpt2/gpt2-merges.txt
mkdir -p "$WORK_DIR/data"

if [ ! -f "$WORK_DIR/data/mobydick_text_document.idx" ]; then
    echo "==> preprocessing data/corpus/mobydick.jsonl"
    "$PYTHON" tools/preprocess_data.py \
        --input data/corpus/mobydick.jsonl \
        --output-prefix "$WORK_DIR/data/mobydick" \
        --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$VOCAB_FILE" \
        --merge-file "$MERGE_FILE" \
        --append-eod \
        --workers 2
fi
rm -rf "$WORK_DIR/checkpoints"

# 8 layers: 4 Mamba-2 mixers (8 heads of 16, 2 groups, state 16), 1 attention, 3 MLPs.
MODEL_ARGS=(
    --num-layers 8
    --hidden-size 64
    --num-attention-heads 4
    --hybrid-override-pattern "M-M*M-M-"
    --mamba-head-dim 16
    --mamba-num-groups 2
    --mamba-state-dim 16
    --normalization RMSNorm
    --position-embedding-type none
    --squared-relu
    --disable-bias-linear
    --no-bias-gelu-fusion
    --seq-length 64
    --max-position-embeddings 64
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 8
    --train-iters "$TRAIN_ITERS"
    --lr 3.0e-3
    --min-lr 3.0e-4
    --lr-decay-style cosine
    --lr-warmup-iters 5
    --weight-decay 0.01
    --clip-grad 1.0
)
DATA_ARGS=(
    --data-path "$WORK_DIR/data/mobydick_text_document"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 98,2,0
    --num-workers 0
    --data-cache-path "$WORK_DIR/cache"
)
OUTPUT_ARGS=(
    --log-interval 10
    --eval-interval 1000
    --eval-iters 2
    --save "$WORK_DIR/checkpoints"
    --save-interval "$TRAIN_ITERS"
    --ckpt-format torch_dist
)

echo "==> training a hybrid Mamba model for $TRAIN_ITERS iterations on 2 processes (TP=2)"
"$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-port "$MASTER_PORT" pretrain_mamba.py \
    "${MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    --tensor-model-parallel-size 2 \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}"

echo "==> done. torch_dist checkpoint: $WORK_DIR/checkpoints (loads at any TP size)"
