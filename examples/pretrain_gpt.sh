#!/bin/bash
# Runs the "345M" parameter GPT model on one process (one GPU, or the CPU with gloo).
#
# Usage: bash examples/pretrain_gpt.sh CHECKPOINT_PATH VOCAB_FILE MERGE_FILE DATA_PATH
#   DATA_PATH is the prefix written by tools/preprocess_data.py, e.g. my-gpt2_text_document

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

CHECKPOINT_PATH=${1:?checkpoint directory}
VOCAB_FILE=${2:?gpt2-vocab.json}
MERGE_FILE=${3:?gpt2-merges.txt}
DATA_PATH=${4:?data prefix, e.g. my-gpt2_text_document}

DISTRIBUTED_ARGS=(--nproc_per_node 1 --nnodes 1 --node_rank 0 --master_addr localhost --master_port 6000)

GPT_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 1024
    --max-position-embeddings 1024
    --micro-batch-size 4
    --global-batch-size 8
    --lr 0.00015
    --train-iters 500000
    --lr-decay-iters 320000
    --lr-decay-style cosine
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --fp16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --merge-file "$MERGE_FILE"
    --split 949,50,1
)

OUTPUT_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_gpt.py \
    "${GPT_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH"
