#!/bin/bash
# T5 quickstart: preprocess the bundled fortunes corpus with the bundled BERT WordPiece vocabulary,
# train a small T5 (2 encoder + 2 decoder layers) with tensor parallel 2 and pipeline parallel 2
# split at rank 1 (stage 0 holds the encoder, stage 1 the decoder) on 4 processes, evaluate, save
# a checkpoint and resume from it. Runs on a CPU-only machine (gloo) in a few minutes.
#
# Usage (from the repository root):   bash examples/quickstart_t5.sh
# Environment: WORK_DIR (default ./quickstart_t5_work), TRAIN_ITERS (default 60), NPROC (default 4).

set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-quickstart_t5_work}
TRAIN_ITERS=${TRAIN_ITERS:-60}
NPROC=${NPROC:-4}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1

VOCAB_FILE=data/bert/bert-vocab.txt
mkdir -p "$WORK_DIR/data"

# 1. Preprocess: JSON lines -> .bin/.idx (BERT WordPiece, lower case; one quotation per document).
if [ ! -f "$WORK_DIR/data/fortunes_text_document.idx" ]; then
    echo "==> preprocessing data/corpus/fortunes.jsonl into $WORK_DIR/data/fortunes_text_document.{bin,idx}"
    "$PYTHON" tools/preprocess_data.py \
        --input data/corpus/fortunes.jsonl \
        --output-prefix "$WORK_DIR/data/fortunes" \
        --tokenizer-type BertWordPieceLowerCase \
        --vocab-file "$VOCAB_FILE" \
        --workers 2
fi

# 2. Train: 4 processes = tensor parallel 2 x pipeline parallel 2 (split rank 1), data parallel 1.
T5_MODEL_ARGS=(
    --encoder-num-layers 2
    --decoder-num-layers 2
    --hidden-size 128
    --num-attention-heads 4
    --kv-channels 32
    --ffn-hidden-size 512
    --encoder-seq-length 128
    --decoder-seq-length 48
    --max-position-embeddings 128
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --vocab-extra-ids 100
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 16
    --train-iters "$TRAIN_ITERS"
    --lr 2.0e-3
    --min-lr 2.0e-4
    --lr-decay-style cosine
    --lr-warmup-iters 10
    --weight-decay 0.01
    --clip-grad 1.0
)
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --pipeline-model-parallel-split-rank 1
)
DATA_ARGS=(
    --data-path "$WORK_DIR/data/fortunes_text_document"
    --vocab-file "$VOCAB_FILE"
    --split 90,8,2
    --num-workers 0
    --data-cache-path "$WORK_DIR/cache"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 30
    --eval-iters 4
    --save "$WORK_DIR/checkpoints"
    --load "$WORK_DIR/checkpoints"
    --save-interval 30
    --tensorboard-dir "$WORK_DIR/tensorboard"
)

run() {
    "$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" \
        pretrain_t5.py \
        "${T5_MODEL_ARGS[@]}" \
        "${TRAINING_ARGS[@]}" \
        "${MODEL_PARALLEL_ARGS[@]}" \
        "${DATA_ARGS[@]}" \
        "${EVAL_AND_LOGGING_ARGS[@]}" \
        "$@"
}

HALF=$((TRAIN_ITERS / 2))
echo "==> training T5 (TP=2, PP=2 split at rank 1) for $HALF of $TRAIN_ITERS iterations, then stopping"
run --exit-interval "$HALF"
echo "==> resuming from $WORK_DIR/checkpoints and training to iteration $TRAIN_ITERS"
run

echo "==> done. TensorBoard logs: $WORK_DIR/tensorboard"
