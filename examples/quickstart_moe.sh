#!/bin/bash
# Quickstart (mixture of experts): preprocess the bundled corpus, train a small Mixtral-style MoE
# GPT (8 experts, top-2, SwiGLU experts, RMSNorm, RoPE) with expert parallel 2 on 4 processes
# (data parallel 4: each expert-parallel pair holds 4 of the 8 experts), and write TensorBoard
# logs. The log line shows lm loss, z_loss and load_balancing_loss (1.0 = perfectly balanced
# experts); TensorBoard also gets each expert's share of every layer's tokens.
# Runs on a CPU-only machine (gloo) in a few minutes; with 4+ GPUs the same command uses NCCL.
#
# Usage (from the repository root):   bash examples/quickstart_moe.sh
# Environment: WORK_DIR (default ./quickstart_moe_work), TRAIN_ITERS (default 100), NPROC (default 4),
#              DISPATCHER (allgather or alltoall, default alltoall).

set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-quickstart_moe_work}
TRAIN_ITERS=${TRAIN_ITERS:-100}
NPROC=${NPROC:-4}
DISPATCHER=${DISPATCHER:-alltoall}
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

# A fresh run each time (the trainer refuses a --save directory holding a checkpoint it did not --load).
rm -rf "$WORK_DIR/checkpoints"

# 2. Train: 4 processes, expert parallel 2 inside data parallel 4.
MODEL_ARGS=(
    --num-layers 4
    --hidden-size 128
    --ffn-hidden-size 256
    --num-attention-heads 4
    --group-query-attention
    --num-query-groups 2
    --seq-length 64
    --max-position-embeddings 64
    --position-embedding-type rope
    --rotary-base 1000000
    --normalization RMSNorm
    --swiglu
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
MOE_ARGS=(
    --num-experts 8
    --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss
    --moe-aux-loss-coeff 1e-2
    --moe-z-loss-coeff 1e-3
    --moe-token-dispatcher-type "$DISPATCHER"
    --expert-model-parallel-size 2
)
TRAINING_ARGS=(
    --micro-batch-size 2
    --global-batch-size 16
    --train-iters "$TRAIN_ITERS"
    --lr 2.0e-3
    --min-lr 2.0e-4
    --lr-decay-style cosine
    --lr-warmup-iters 10
    --weight-decay 0.01
    --clip-grad 1.0
    --use-distributed-optimizer
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
    --moe-per-layer-logging
    --save "$WORK_DIR/checkpoints"
    --save-interval "$TRAIN_ITERS"
)

echo "==> training a ${MOE_ARGS[1]}-expert MoE GPT for $TRAIN_ITERS iterations with torchrun on $NPROC processes (EP 2, $DISPATCHER dispatcher)"
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_gpt.py \
    "${MODEL_ARGS[@]}" \
    "${MOE_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"

echo "==> done. TensorBoard logs: $WORK_DIR/tensorboard  (view with: tensorboard --logdir $WORK_DIR/tensorboard)"
echo "==> checkpoint (mp_rank_00_000 and mp_rank_00_001: one per expert-parallel rank): $WORK_DIR/checkpoints"
echo "==> export it to Hugging Face (MixtralForCausalLM): $PYTHON tools/checkpoint/convert.py --model-type GPT --loader mcore --saver hf --load-dir $WORK_DIR/checkpoints --save-dir $WORK_DIR/hf"
