#!/bin/bash
# DINO self-distillation of a ViT-B/16 on ImageNet-1k at cluster size: 8 nodes x 8 GPUs, data
# parallel, bf16. The recipe is DINO's published ViT-B/16 one (global batch 1024, 2 global 224 px
# crops and 10 local 96 px crops, teacher temperature 0.04 -> 0.07 over the first 50 epochs,
# 65536 prototypes, the last layer frozen for the first epoch, weight decay 0.04 -> 0.4); the
# k-NN accuracies of the teacher (knn_acc_10 ... knn_acc_200) are logged at every evaluation.
#
# Usage, on every node:
#   NNODES=8 NODE_RANK=<0..7> MASTER_ADDR=<node 0> IMAGENET=/data/imagenet \
#       bash examples/vision/pretrain_vision_dino_distributed.sh
# IMAGENET holds train/<class>/*.JPEG and val/<class>/*.JPEG (the ImageFolder layout).

set -euo pipefail
cd "$(dirname "$0")/../.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-8}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
IMAGENET=${IMAGENET:?set IMAGENET to the folder holding train/ and val/}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/dino_vit_b16}

# 1,281,167 training images / 1024 per step = 1251 steps per epoch; 100 epochs.
ITER_PER_EPOCH=1251
TRAIN_ITERS=$((100 * ITER_PER_EPOCH))

LAUNCH=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
VIT_B16=(
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072
    --img-h 224 --img-w 224 --patch-dim 16 --num-channels 3
    --seq-length 197 --max-position-embeddings 197
    --attention-dropout 0.0 --hidden-dropout 0.0
)
DINO=(
    --vision-pretraining-type dino --dino-local-crops-number 10 --dino-local-img-size 96
    --dino-head-hidden-size 2048 --dino-bottleneck-size 256 --dino-out-dim 65536
    --dino-freeze-last-layer 1 --dino-warmup-teacher-temp 0.04 --dino-teacher-temp 0.07
    --dino-warmup-teacher-temp-epochs 50 --iter-per-epoch "$ITER_PER_EPOCH"
)
OPTIMIZATION=(
    --micro-batch-size 16 --global-batch-size 1024 --train-iters "$TRAIN_ITERS"
    --lr 0.00075 --min-lr 1.0e-6 --lr-decay-style cosine
    --lr-warmup-iters $((10 * ITER_PER_EPOCH)) --clip-grad 3.0
    --start-weight-decay 0.04 --end-weight-decay 0.4 --weight-decay-incr-style cosine
    --adam-beta1 0.9 --adam-beta2 0.999 --bf16 --use-distributed-optimizer
)
DATA_AND_OUTPUT=(
    --data-path "$IMAGENET/train" "$IMAGENET/val" --num-workers 8
    --log-interval 100 --eval-interval "$ITER_PER_EPOCH" --eval-iters 50
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval "$ITER_PER_EPOCH"
)

torchrun "${LAUNCH[@]}" pretrain_vision_dino.py \
    "${VIT_B16[@]}" "${DINO[@]}" "${OPTIMIZATION[@]}" "${DATA_AND_OUTPUT[@]}"
