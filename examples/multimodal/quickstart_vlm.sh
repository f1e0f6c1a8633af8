#!/bin/bash
# Vision-language quickstart: train a tiny LLaVA (CLIP ViT + MLP projector + GPT) with
# pretrain_vlm.py on the bundled handwritten digits, captioned: the image, then
# "which digit is this ?" -> "it is a handwritten seven ." (loss on the answer only). The words
# are the caption vocabulary of megatron/training/datasets/vlm_dataset.py, read through
# NullTokenizer, so nothing is downloaded. Prints the training loss falling and the held-out
# validation loss.
#
# Reading the validation loss: the answer is 7 tokens (6 words and the end of document), of which
# only the digit is uncertain; a model that had learnt the wording but guessed the digit would
# score ln(10)/7 = 0.33, so a loss well below 0.33 means the digit is read from the image.
#
# Usage (from the repository root):   bash examples/multimodal/quickstart_vlm.sh
# Environment: WORK_DIR (default ./quickstart_work/vlm), TRAIN_ITERS (default 300),
#              NPROC (default 1), TP (default 1; NPROC=2 TP=2 gives tensor parallel 2).

set -euo pipefail
cd "$(dirname "$0")/../.."

WORK_DIR=${WORK_DIR:-quickstart_work/vlm}
TRAIN_ITERS=${TRAIN_ITERS:-300}
NPROC=${NPROC:-1}
TP=${TP:-1}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$WORK_DIR"

# The 8x8 digits scaled to 16x16, patches of 4 pixels: 16 image tokens per sample (class token
# dropped), then 16 text positions (12 used by the question and answer).
MODEL_ARGS=(
    --num-layers 2 --hidden-size 64 --num-attention-heads 4
    --img-h 16 --img-w 16 --patch-dim 4 --disable-vision-class-token --vision-model-type clip
    --seq-length 16 --max-position-embeddings 16 --position-embedding-type rope
    --tokenizer-type NullTokenizer --vocab-size 20
    --attention-dropout 0.0 --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 32 --global-batch-size 32 --train-iters "$TRAIN_ITERS"
    --lr 3e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.01
    --tensor-model-parallel-size "$TP" --distributed-backend gloo
)
OUTPUT_ARGS=(
    --log-interval 25 --eval-interval "$TRAIN_ITERS" --eval-iters 10 --num-workers 0
)

torchrun --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_vlm.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${OUTPUT_ARGS[@]}" | tee "$WORK_DIR/train.log"

echo "--- training lm loss every 25 iterations:"
grep -o 'lm loss: [0-9.E+-]*' "$WORK_DIR/train.log" | tr '\n' ' '
echo
grep 'validation loss at iteration' "$WORK_DIR/train.log" | tail -1
