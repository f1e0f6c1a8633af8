#!/bin/bash
# Cluster-style pretraining of NVIDIA's 8B hybrid Mamba-2 model (56 layers: 24 Mamba, 4 attention,
# 28 MLP, the allocation of --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5) with the flags
# Megatron-LM publishes for it: tensor parallel 8 with sequence parallelism, the distributed
# optimizer, bf16, a SentencePiece tokenizer, 4k sequences.
#
# Usage: bash examples/mamba/train.sh CHECKPOINT_DIR TENSORBOARD_DIR DATA_PREFIX TOKENIZER_MODEL
# Launch one copy per node with NNODES / NODE_RANK / MASTER_ADDR set (torchrun rendezvous).
# MODEL_SCALE=800M gives the 48-layer, hidden-1024 model instead.

set -euo pipefail
cd "$(dirname "$0")/../.."

CHECKPOINT_DIR=$1
TENSORBOARD_DIR=$2
DATA_PREFIX=$3
TOKENIZER_MODEL=$4
MODEL_SCALE=${MODEL_SCALE:-8B}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
export CUDA_DEVICE_MAX_CONNECTIONS=1

case "$MODEL_SCALE" in
    800M) TP=1; LAYERS=48; HIDDEN=1024; HEADS=16; GBS=32 ;;
    8B) TP=8; LAYERS=56; HIDDEN=4096; HEADS=32; GBS=1024 ;;
    *) echo "MODEL_SCALE must be 800M or 8B, got $MODEL_SCALE" >&2; exit 1 ;;
esac

MODEL_ARGS=(
    --spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec
    --num-layers "$LAYERS"
    --hidden-size "$HIDDEN"
    --num-attention-heads "$HEADS"
    --group-query-attention
    --num-query-groups 8
    --hybrid-attention-ratio 0.08
    --hybrid-mlp-ratio 0.5
    --squared-relu
    --normalization RMSNorm
    --position-embedding-type none
    --disable-bias-linear
    --untie-embeddings-and-output-weights
    --init-method-std 0.02
    --seq-length 4096
    --max-position-embeddings 4096
    --attention-dropout 0.0
    --hidden-dropout 0.0
)
TRAINING_ARGS=(
    --micro-batch-size 1
    --global-batch-size "$GBS"
    --train-samples 268554688
    --lr-warmup-samples 162761
    --lr-decay-samples 255126953
    --lr 2.5e-4
    --min-lr 2.5e-5
    --lr-decay-style cosine
    --weight-decay 0.1
    --clip-grad 1.0
    --adam-beta1 0.9
    --adam-beta2 0.95
    --bf16
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)
PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --sequence-parallel
)
DATA_ARGS=(
    --data-path "$DATA_PREFIX"
    --tokenizer-type GPTSentencePieceTokenizer
    --tokenizer-model "$TOKENIZER_MODEL"
    --split 99,1,0
    --no-create-attention-mask-in-dataloader
)
OUTPUT_ARGS=(
    --log-interval 10
    --eval-interval 2000
    --eval-iters 32
    --save-interval 2000
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --ckpt-format torch_dist
    --tensorboard-dir "$TENSORBOARD_DIR"
    --log-throughput
)

torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" pretrain_mamba.py \
    "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${DATA_ARGS[@]}" \
    "${OUTPUT_ARGS[@]}"
