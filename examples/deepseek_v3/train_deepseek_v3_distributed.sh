#!/bin/bash
# DeepSeek-V3 (671B total, 37B active per token) pretraining or fine-tuning at cluster size, with
# the model's published hyperparameters in Megatron's flags: 61 layers (the first 3 dense), MLA
# (q-LoRA 1536, KV latent 512, 128-dim no-rope + 64-dim rope heads, YaRN x40 from 4096), 256
# routed experts of 2048 with one shared expert, sigmoid scores with the expert bias, top-8 from
# the best 4 of 8 groups, the sequence-wise balance loss, and one multi-token-prediction layer.
#
# Layout: 1024 GPUs (128 nodes of 8): pipeline 16 x expert 64 (EP carved out of data parallel
# 64). 61 layers do not split over 16 stages evenly: stage 0 takes 4 (it also holds the
# embedding), the last stage 1 (it also holds the output layer and the MTP layer) and the 14
# others 4 each. Start it on every node with NUM_NODES, NODE_RANK and MASTER_ADDR exported.
# Fine-tuning: convert the Hugging Face weights first (python tools/checkpoint/convert.py
# --model-type GPT --loader hf --saver mcore --target-pipeline-parallel-size 16
# --target-expert-parallel-size 64 ...) and pass the result as PRETRAINED.
#
# Usage: bash examples/deepseek_v3/train_deepseek_v3_distributed.sh CHECKPOINT_PATH \
#            TOKENIZER_DIR DATA_PATH [PRETRAINED] [TENSORBOARD_LOGS_PATH]

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

ckpt_dir=${1:?checkpoint directory}
tokenizer_dir=${2:?Hugging Face tokenizer directory of DeepSeek-V3}
data_prefix=${3:?data prefix, e.g. my-corpus_text_document}
pretrained=${4:-}
tb_dir=${5:-$ckpt_dir/tensorboard}

launcher=(
    --nproc_per_node "${GPUS_PER_NODE:-8}" --nnodes "${NUM_NODES:-128}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
)

flags=(
    # the skeleton: 61 layers of 7168, RMSNorm, SwiGLU, no biases, untied output layer
    --num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128
    --seq-length 4096 --max-position-embeddings 163840 --norm-epsilon 1e-6
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --rotary-base 10000 --init-method-std 0.006
    --attention-dropout 0.0 --hidden-dropout 0.0
    # multi-latent attention with YaRN
    --multi-latent-attention --qk-layernorm --q-lora-rank 1536 --kv-lora-rank 512
    --qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128
    --rope-type yarn --rotary-scaling-factor 40 --yarn-original-max-position-embeddings 4096
    --yarn-beta-fast 32 --yarn-beta-slow 1 --mscale 1.0 --mscale-all-dim 1.0
    # MoE: 3 dense layers, then 256 routed experts + 1 shared, top-8 in 4 of 8 groups
    --num-experts 256 --moe-layer-freq "([0]*3+[1]*58)" --moe-ffn-hidden-size 2048
    --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8
    --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3 --moe-router-dtype fp32
    --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
    --moe-grouped-gemm --moe-token-dispatcher-type alltoall
    # multi-token prediction, depth 1
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
    # layout: PP 16 with an uneven first and last stage, EP 64
    --tensor-model-parallel-size 1 --pipeline-model-parallel-size 16
    --decoder-first-pipeline-num-layers 4 --decoder-last-pipeline-num-layers 1
    --expert-model-parallel-size 64
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    --recompute-granularity selective
    # tokens
    --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$tokenizer_dir"
    --data-path "$data_prefix" --split 99990,8,2
    # optimization: bf16 AdamW, the paper's peak learning rate, cosine decay
    --micro-batch-size 1 --global-batch-size 15360 --bf16
    --train-iters 500000 --lr 2.2e-4 --min-lr 2.2e-5 --lr-decay-style cosine
    --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0
    --adam-beta1 0.9 --adam-beta2 0.95
    # checkpoints, evaluation and logs
    --save "$ckpt_dir" --load "$ckpt_dir" --save-interval 1000 --ckpt-format torch_dist
    --eval-interval 1000 --eval-iters 10
    --log-interval 1 --tensorboard-dir "$tb_dir"
)
if [[ -n "$pretrained" ]]; then
    flags+=(--pretrained-checkpoint "$pretrained")
fi

exec torchrun "${launcher[@]}" pretrain_gpt.py "${flags[@]}"
