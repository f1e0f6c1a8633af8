#!/bin/bash
# Tiny DeepSeek-V3-style model on the bundled corpus, on 4 CPU processes (gloo): multi-latent
# attention (q-LoRA, YaRN), a first dense layer then MoE layers with sigmoid routing, expert bias,
# group-limited top-k and a shared expert, expert parallel 2 x data parallel 2, and one
# multi-token-prediction layer. The log line shows `lm loss` and `mtp_1 loss`, both falling.
#
# Usage (from the repository root):   bash examples/deepseek_v3/quickstart.sh
# Environment: WORK_DIR (default ./deepseek_v3_work), TRAIN_ITERS (default 60), NPROC (default 4).

set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-deepseek_v3_work}
TRAIN_ITERS=${TRAIN_ITERS:-60}
NPROC=${NPROC:-4}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

VOCAB_FILE=data/gpt2/gpt2-vocab.json
MERGE_FILE=data/gpt2/gpt2-merges.txt
mkdir -p "$WORK_DIR/data"
if [ ! -f "$WORK_DIR/data/mobydick_text_document.idx" ]; then
    "$PYTHON" tools/preprocess_data.py --input data/corpus/mobydick.jsonl \
        --output-prefix "$WORK_DIR/data/mobydick" --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --append-eod --workers 1
fi

MODEL_ARGS=(
    --num-layers 3 --hidden-size 64 --num-attention-heads 4 --ffn-hidden-size 128
    --seq-length 64 --max-position-embeddings 256
    --normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-weights
    --position-embedding-type rope --attention-dropout 0.0 --hidden-dropout 0.0
    # multi-latent attention with YaRN (DeepSeek-V3 needs --mscale 1.0 --mscale-all-dim 1.0)
    --multi-latent-attention --qk-layernorm --q-lora-rank 32 --kv-lora-rank 16
    --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
    --rope-type yarn --rotary-scaling-factor 4 --yarn-original-max-position-embeddings 64
    --mscale 1.0 --mscale-all-dim 1.0
    # MoE: layer 0 dense, layers 1-2 with 8 experts in 4 groups, top-4 from the best 2 groups
    --num-experts 8 --moe-layer-freq "[0,1,1]" --moe-ffn-hidden-size 32
    --moe-shared-expert-intermediate-size 32 --moe-router-topk 4
    --moe-router-score-function sigmoid --moe-router-enable-expert-bias
    --moe-router-num-groups 4 --moe-router-group-topk 2 --moe-router-topk-scaling-factor 2.5
    --moe-router-load-balancing-type none --moe-router-dtype fp32
    --moe-token-dispatcher-type alltoall
    # multi-token prediction, depth 1
    --mtp-num-layers 1 --mtp-loss-scaling-factor 0.1
)
TRAINING_ARGS=(
    --micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS"
    --lr 3.0e-3 --min-lr 3.0e-4 --lr-decay-style cosine --lr-warmup-iters 5
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234
)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --expert-model-parallel-size 2)
DATA_ARGS=(
    --data-path "$WORK_DIR/data/mobydick_text_document"
    --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"
    --split 98,2,0 --num-workers 0 --data-cache-path "$WORK_DIR/cache"
)
LOG_ARGS=(--log-interval 10 --eval-interval 1000 --eval-iters 0)

"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" \
    pretrain_gpt.py "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${DATA_ARGS[@]}" "${LOG_ARGS[@]}"
