#!/bin/bash
# Runs the "340M" parameter BERT model data parallel over 8 processes (GPUS_PER_NODE). Falls
# back to gloo without GPUs.
# DATA_PATH is the prefix written by tools/preprocess_data.py --split-sentences, e.g.
# my-bert_text_sentence (the sentence-order head needs sentence-split data; pass
# --bert-no-binary-head to train on document-level data).
#
# Usage: bash examples/pretrain_bert_distributed.sh CHECKPOINT_PATH VOCAB_FILE DATA_PATH

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

CHECKPOINT_PATH=${1:?checkpoint directory}
VOCAB_FILE=${2:?bert-vocab.txt}
DATA_PATH=${3:?data prefix, e.g. my-bert_text_sentence}

BERT_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
    --micro-batch-size 4
    --global-batch-size 32
    --lr 0.0001
    --train-iters 1000000
    --lr-decay-iters 990000
    --lr-decay-style linear
    --min-lr 1.0e-5
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --fp16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --split 949,50,1
)

OUTPUT_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --eval-iters 10
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_bert.py \
    "${BERT_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --distributed-backend nccl \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH"
