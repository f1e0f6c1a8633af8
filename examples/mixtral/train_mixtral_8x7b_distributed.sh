#!/bin/bash
# Mixtral 8x7B pretraining or fine-tuning with the settings of Megatron's published example:
# 8 GPUs a node, PP 4, EP 8 (every expert-parallel rank owns one of each layer's 8 experts),
# sequence parallelism, alltoall dispatch and grouped-GEMM experts. EP is carved out of data
# parallelism, so DP must be a multiple of 8: 32 GPUs (4 nodes) is the smallest layout.
# Start it on every node with NUM_NODES, NODE_RANK and MASTER_ADDR exported for that node.
# Fine-tuning: convert the Hugging Face weights first (examples/mixtral/README.md) and pass the
# result as PRETRAINED; training starts from it, and from CHECKPOINT_PATH once that holds one.
#
# Usage: bash examples/mixtral/train_mixtral_8x7b_distributed.sh CHECKPOINT_PATH TOKENIZER_MODEL \
#            DATA_PATH [PRETRAINED] [TENSORBOARD_LOGS_PATH]

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

ckpt_dir=${1:?checkpoint directory}
tokenizer_model=${2:?tokenizer.model of Mixtral}
data_prefix=${3:?data prefix, e.g. my-mixtral_text_document}
pretrained=${4:-}
tb_dir=${5:-$ckpt_dir/tensorboard}

launcher=(
    --nproc_per_node "${GPUS_PER_NODE:-8}" --nnodes "${NUM_NODES:-1}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
)

flags=(
    --use-mcore-models
    # the dense skeleton: 32 layers of 4096, GQA with 8 KV groups, RoPE base 1e6, no biases
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336
    --num-attention-heads 32 --group-query-attention --num-query-groups 8
    --seq-length 4096 --max-position-embeddings 32768
    --position-embedding-type rope --rotary-base 1000000 --no-position-embedding
    --normalization RMSNorm --swiglu --disable-bias-linear
    --untie-embeddings-and-output-weights --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --no-masked-softmax-fusion
    # the sparse part: 8 experts, top-2 routing with the auxiliary balancing loss
    --num-experts 8 --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    # layout and communication overlap
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8 --sequence-parallel
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    # tokens
    --tokenizer-type Llama2Tokenizer --tokenizer-model "$tokenizer_model"
    --data-path "$data_prefix" --split 99990,8,2
    # optimization: bf16, cosine decay after 500 warm-up steps
    --micro-batch-size 1 --global-batch-size 256 --bf16
    --train-iters 500000 --lr 1e-4 --min-lr 1.0e-5 --lr-decay-style cosine
    --lr-decay-iters 320000 --lr-warmup-iters 500 --weight-decay 0.1 --clip-grad 1.0
    # checkpoints, evaluation and logs
    --save "$ckpt_dir" --load "$ckpt_dir" --save-interval 10000
    --eval-interval 1000 --eval-iters 10
    --log-interval 1 --tensorboard-dir "$tb_dir"
)
if [[ -n "$pretrained" ]]; then
    flags+=(--pretrained-checkpoint "$pretrained")
fi

exec torchrun "${launcher[@]}" pretrain_gpt.py "${flags[@]}"
