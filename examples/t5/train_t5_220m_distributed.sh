#!/bin/bash
# Runs the "220M" parameter T5 model (12 + 12 layers, hidden 768) on one node of 8 processes
# (data parallel 8), as Megatron's examples/t5/train_t5_220m_distributed.sh. Without GPUs it falls
# back to gloo; without Transformer Engine the TE spec falls back to the local spec (same math).
#
# Usage: bash examples/t5/train_t5_220m_distributed.sh CHECKPOINT_PATH TENSORBOARD_DIR VOCAB_FILE DATA_PATH
#   VOCAB_FILE: a BERT WordPiece vocabulary (bert-large-cased-vocab.txt in Megatron's example)
#   DATA_PATH:  prefix of a dataset preprocessed with that vocabulary, e.g. my-t5_text_document

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=${NUM_NODES:-1}
NODE_RANK=${NODE_RANK:-0}

CHECKPOINT_PATH=${1:?checkpoint directory}
TENSORBOARD_DIR=${2:?tensorboard directory}
VOCAB_FILE=${3:?bert-large-cased-vocab.txt}
DATA_PATH=${4:?data prefix, e.g. my-t5_text_document}

DISTRIBUTED_ARGS=(
    --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NUM_NODES" --node_rank "$NODE_RANK"
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT"
)

T5_ARGS=(
    --encoder-num-layers 12
    --decoder-num-layers 12
    --hidden-size 768
    --num-attention-heads 12
    --kv-channels 64
    --ffn-hidden-size 3072
    --encoder-seq-length 512
    --decoder-seq-length 128
    --max-position-embeddings 512
    --micro-batch-size 64
    --global-batch-size 512
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
    --init-method-std 0.015
    --transformer-impl transformer_engine
    --tensor-model-parallel-size 1
    --pipeline-model-parallel-size 1
)

DATA_ARGS=(
    --data-path "$DATA_PATH"
    --vocab-file "$VOCAB_FILE"
    --tokenizer-type BertWordPieceCase
    --split 99982,9,9
)

OUTPUT_ARGS=(
    --log-interval 100
    --tensorboard-dir "$TENSORBOARD_DIR"
    --save-interval 500
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
