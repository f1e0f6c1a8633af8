#!/bin/bash
# Runs the "340M" parameter BERT model (24 layers, hidden 1024, 16 heads, seq 512) with tensor
# parallel 8 and pipeline parallel 16, as Megatron's script does: that is 128 GPUs per model
# replica, so run it on a cluster (this script on every node with NUM_NODES, NODE_RANK and
# MASTER_ADDR set, e.g. from SLURM), or lower the two sizes for a single node.
# DATA_PATH must be sentence-split data (tools/preprocess_data.py --split-sentences, a
# *_text_sentence prefix) for the sentence-order (binary) head.
#
# Usage: bash examples/bert/train_bert_340m_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#            VOCAB_FILE DATA_PATH

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_LOGS_PATH=${2:?tensorboard directory}
VOCAB_FILE=${3:?bert-vocab.txt}
DATA_PATH=${4:?data prefix, e.g. my-bert_00_text_sentence}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE"
    --nnodes "$NUM_NODES"
    --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR"
    --master_port "$MASTER_PORT"
)

BERT_MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1024
    --num-attention-heads 16
    --seq-length 512
    --max-position-embeddings 512
)

TRAINING_ARGS=(
    --micro-batch-size 4
    --global-batch-size 32
    --train-iters 1000000
    --weight-decay 1e-2
    --clip-grad 1.0
    --fp16
    --lr 0.0001
    --lr-decay-iters 990000
    --lr-decay-style linear
    --min-lr 1.0e-5
    --lr-warmup-fraction .01
)

MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 8
    --pipeline-model-parallel-size 16
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 100
    --save-interval 10000
    --eval-interval 1000
    --save "$CHECKPOINT_PATH"
    --load "$CHECKPOINT_PATH"
    --eval-iters 10
    --tensorboard-dir "$TENSORBOARD_LOGS_PATH"
)

torchrun "${DISTRIBUTED_ARGS[@]}" pretrain_bert.py \
    "${BERT_MODEL_ARGS[@]}" \
    "${TRAINING_ARGS[@]}" \
    "${MODEL_PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${EVAL_AND_LOGGING_ARGS[@]}"
