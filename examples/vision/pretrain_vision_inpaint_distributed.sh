#!/bin/bash
# Masked-image inpainting with a ViT-B/16 on ImageNet-1k at cluster size: 4 nodes x 8 GPUs,
# tensor parallel 2 with sequence parallelism x data parallel 16, bf16. Half of the patches of
# every image are masked along a random walk (Megatron's "random" mask type); the loss is the
# mean squared error over the masked pixels, and PSNR / SSIM of the reconstructions are logged.
#
# Usage, on every node:
#   NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=<node 0> IMAGENET=/data/imagenet \
#       bash examples/vision/pretrain_vision_inpaint_distributed.sh
# IMAGENET holds train/<class>/*.JPEG and val/<class>/*.JPEG (the ImageFolder layout).

set -euo pipefail
cd "$(dirname "$0")/../.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-4}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
IMAGENET=${IMAGENET:?set IMAGENET to the folder holding train/ and val/}
CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/inpaint_vit_b16}

LAUNCH=(--nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
VIT_B16=(
    --num-layers 12 --hidden-size 768 --num-attention-heads 12 --ffn-hidden-size 3072
    --img-h 224 --img-w 224 --patch-dim 16 --num-channels 3
    --seq-length 196 --max-position-embeddings 196
    --attention-dropout 0.0 --hidden-dropout 0.1
)
INPAINT=(--vision-pretraining-type inpaint --mask-type random --mask-factor 0.5)
PARALLEL=(--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer)
OPTIMIZATION=(
    --micro-batch-size 32 --global-batch-size 2048 --train-iters 62500
    --lr 0.0015 --min-lr 1.0e-5 --lr-decay-style cosine --lr-warmup-iters 3000
    --weight-decay 0.05 --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --bf16
)
DATA_AND_OUTPUT=(
    --data-path "$IMAGENET/train" "$IMAGENET/val" --num-workers 8
    --log-interval 100 --eval-interval 2500 --eval-iters 20
    --save "$CHECKPOINT_DIR" --load "$CHECKPOINT_DIR" --save-interval 2500
)

torchrun "${LAUNCH[@]}" pretrain_vision_inpaint.py \
    "${VIT_B16[@]}" "${INPAINT[@]}" "${PARALLEL[@]}" "${OPTIMIZATION[@]}" "${DATA_AND_OUTPUT[@]}"
