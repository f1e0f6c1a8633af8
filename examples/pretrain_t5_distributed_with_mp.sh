#!/bin/bash
# Runs a "220M"-shaped T5 with tensor parallelism 2 and pipeline parallelism 4 split at rank 2
# (stages 0-1 hold the 12 encoder layers, stages 2-3 the 12 decoder layers) over 8 processes
# (data parallel size 1). Falls back to gloo without GPUs.
#
# Usage: bash examples/pretrain_t5_distributed_with_mp.sh CHECKPOINT_PATH VOCAB_FILE DATA_PATH

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=${1:?checkpoint directory}
VOCAB_FILE=${2:?bert-vocab.txt}
DATA_PATH=${3:?data prefix, e.g. my-t5_text_document}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

T5_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 4
    --pipeline-model-parallel-split-rank 2
    --encoder-num-layers 12
    --decoder-num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --kv-channels 64
    --ffn-hidden-size 3072
    --encoder-seq-length 512
    --decoder-seq-length 128
    --max-position-embeddings 512
    --micro-batch-size 16
    --global-batch-size 128
    --lr 0.0001
    --train-iters 1000000
    --lr-decay-iters 1000000
    --lr-decay-style linear
    --min-lr 0.00001
    --weight-decay 1e-2
    --lr-warmup-fraction .01
    --clip-grad 1.0
    --bf16
    --vocab-extra-ids 100
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

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_t5.py \
    "${T5_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --distributed-backend nccl \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH"
