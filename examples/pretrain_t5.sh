#!/bin/bash
# Runs a "220M"-shaped T5 (12 + 12 layers, hidden 768) on one process.
#
# Usage: bash examples/pretrain_t5.sh CHECKPOINT_PATH VOCAB_FILE DATA_PATH
#   VOCAB_FILE: a BERT WordPiece vocabulary (lower case; e.g. data/bert/bert-vocab.txt)
#   DATA_PATH:  prefix of a dataset preprocessed with it (tools/preprocess_data.py
#               --tokenizer-type BertWordPieceLowerCase), e.g. my-t5_text_document

set -euo pipefail

CHECKPOINT_PATH=${1:?checkpoint directory}
VOCAB_FILE=${2:?bert-vocab.txt}
DATA_PATH=${3:?data prefix, e.g. my-t5_text_document}

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
    --micro-batch-size 16
    --global-batch-size 16
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

torchrun --nproc_per_node 1 pretrain_t5.py \
    "${T5_ARGS[@]}" \
    "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}" \
    --save "$CHECKPOINT_PATH" \
    --load "$CHECKPOINT_PATH"
