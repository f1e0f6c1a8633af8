#!/bin/bash
# Quickstart: preprocess the bundled corpus (two datasets, blended 1:2), train a small GPT with
# tensor parallel 2 and pipeline parallel 2 on 4 processes, evaluate it, and write TensorBoard logs.
# Runs on a CPU-only machine (gloo) in a few minutes; with 4+ GPUs the same command uses NCCL.
#
# Usage (from the repository root):   bash examples/quickstart.sh
# Environment: WORK_DIR (default ./quickstart_work), TRAIN_ITERS (default 100), NPROC (default 4).

set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-quickstart_work}
TRAIN_ITERS=${TRAIN_ITERS:-100}
NPROC=${NPROC:-4}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1

VOCAB_FILE=data/gpt2/gpt2-vocab.json
MERGE_FILE=data/gpt2/gpt2-merges.txt
mkdir -p "$WORK_DIR/data"

# 1. Preprocess: JSON lines -> Megatron's .bin/.idx indexed datasets (GPT-2 BPE, one EOD per document).
for NAME in mobydick fortunes; do
    if [ ! -f "$WORK_DIR/data/${NAME}_text_document.idx" ]; then
        echo "==> preprocessing data/corpus/$NAME.jsonl into $WORK_DIR/data/${NAME}_text_document.{bin,idx}"
        "$PYTHON" tools/preprocess_data.py \
            --input "data/corpus/$NAME.jsonl" \
            --output-prefix "$WORK_DIR/data/$NAME" \
            --tokenizer-type GPT2BPETokenizer \
            --vocab-file "$VOCAB_FILE" \
            --merge-file "$MERGE_FILE" \
            --append-eod \
            --workers 2
    fi
done

# A fresh run each time: this script's own checkpoints from an earlier run are removed (the trainer
# refuses a --save directory holding a checkpoint it did not --load, so as not to overwrite it).
rm -rf "$WORK_DIR/checkpoints"

# 2. Train: 4 processes = tensor parallel 2 x pipeline parallel 2 (data parallel 1).
GPT_MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --num-attention-heads 4
    --seq-length 64
    --max-position-embeddings 64
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 8
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
)
DATA_ARGS=(
    --data-path 1 "$WORK_DIR/data/mobydick_text_document" 2 "$WORK_DIR/data/fortunes_text_document"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 90,8,2
    --num-workers 0
    --data-cache-path "$WORK_DIR/cache"
)
EVAL_AND_LOGGING_ARGS=(
    --log-interval 10
    --eval-interval 50
    --eval-iters 4
    --tensorboard-dir "$WORK_DIR/tensorboard"
    --log-validation-ppl-to-tensorboard
    --save "$WORK_DIR/checkpoints"
    --save-interval "$TRAIN_ITERS"
)

echo "==> training a ${GPT_MODEL_ARGS[1]}-layer GPT for $TRAIN_ITERS iterations with torchrun on $NPROC processes"
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_gpt.py \
    "${GPT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"

echo "==> done. TensorBoard logs: $WORK_DIR/tensorboard  (view with: tensorboard --logdir $WORK_DIR/tensorboard)"
echo "==> checkpoint: $WORK_DIR/checkpoints  (serve it: TP=2 PP=2 bash examples/inference/run_text_generation_server.sh $WORK_DIR/checkpoints)"
