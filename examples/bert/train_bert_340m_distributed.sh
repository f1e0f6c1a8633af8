#!/bin/bash
# BERT-Large ("340M": 24 layers x 1024 hidden, 16 heads, 512 tokens) with the hyperparameters
# of Megatron's published example: TP 8 x PP 16 = 128 GPUs for one model replica. On a cluster,
# start this on every node with NUM_NODES, NODE_RANK and MASTER_ADDR exported (SLURM can set
# them); on one node, shrink the two parallel sizes first.
# The sentence-order head needs sentence-split data: a *_text_sentence prefix written by
# tools/preprocess_data.py --split-sentences.
#
# Usage: bash examples/bert/train_bert_340m_distributed.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#            VOCAB_FILE DATA_PATH

set -euo pipefail
export CUDA_DEVICE_MAX_CONNECTIONS=1

ckpt_dir=${1:?checkpoint directory}
tb_dir=${2:?tensorboard directory}
vocab=${3:?bert-vocab.txt}
data_prefix=${4:?data prefix, e.g. my-bert_00_text_sentence}

launcher=(
    --nproc_per_node "${GPUS_PER_NODE:-8}" --nnodes "${NUM_NODES:-1}"
    --node_rank "${NODE_RANK:-0}"
    --master_addr "${MASTER_ADDR:-localhost}" --master_port "${MASTER_PORT:-6000}"
)

flags=(
    # shape of the network
    --num-layers 24 --hidden-size 1024 --num-attention-heads 16
    --seq-length 512 --max-position-embeddings 512
    # how it is split over the GPUs
    --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
    # batch, schedule and optimizer (fp16 with dynamic loss scaling)
    --micro-batch-size 4 --global-batch-size 32 --train-iters 1000000 --fp16
    --lr 0.0001 --min-lr 1.0e-5 --lr-decay-style linear --lr-decay-iters 990000
    --lr-warmup-fraction .01 --weight-decay 1e-2 --clip-grad 1.0
    # corpus
    --data-path "$data_prefix" --vocab-file "$vocab" --split 949,50,1
    # checkpoints, evaluation and logs
    --save "$ckpt_dir" --load "$ckpt_dir" --save-interval 10000
    --eval-interval 1000 --eval-iters 10
    --log-interval 100 --tensorboard-dir "$tb_dir"
)

exec torchrun "${launcher[@]}" pretrain_bert.py "${flags[@]}"
