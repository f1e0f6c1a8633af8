#!/bin/bash
# Long-context GPT with context parallelism: each of the CP processes holds SEQ_LENGTH / CP tokens
# of every sequence (chunks r and 2CP-1-r, so causal attention work is balanced), and attention
# runs exactly over the whole sequence. Preprocesses the bundled corpus, trains a small GPT at
# sequence length 4096 with --context-parallel-size 2 on 2 processes, and evaluates it. Runs on a
# CPU-only machine (gloo) in a few minutes; with GPUs the same command uses NCCL.
#
# Usage (from the repository root):   bash examples/pretrain_gpt_long_context.sh
# Environment: WORK_DIR (default ./long_context_work), SEQ_LENGTH (4096), CP (2), TP (1),
#   CP_COMM_TYPE (p2p; or all_gather, a2a), TRAIN_ITERS (10).

set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python}
WORK_DIR=${WORK_DIR:-long_context_work}
SEQ_LENGTH=${SEQ_LENGTH:-4096}
CP=${CP:-2}
TP=${TP:-1}
CP_COMM_TYPE=${CP_COMM_TYPE:-p2p}
TRAIN_ITERS=${TRAIN_ITERS:-10}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1

VOCAB_FILE=data/gpt2/gpt2-vocab.json
MERGE_FILE=data/gpt2/gpt2-merges.txt
DATA="$WORK_DIR/data/mobydick_text_document"
mkdir -p "$WORK_DIR/data"
if [ ! -f "$DATA.idx" ]; then
    echo "==> preprocessing data/corpus/mobydick.jsonl into $DATA.{bin,idx}"
    "$PYTHON" tools/preprocess_data.py --input data/corpus/mobydick.jsonl \
        --output-prefix "$WORK_DIR/data/mobydick" --tokenizer-type GPT2BPETokenizer \
        --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" --append-eod --workers 2
fi
rm -rf "$WORK_DIR/checkpoints"

NPROC=$((CP * TP))
echo "==> GPT at sequence length $SEQ_LENGTH, --context-parallel-size $CP ($CP_COMM_TYPE) x TP $TP on $NPROC processes"
"$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "$MASTER_PORT" pretrain_gpt.py \
    --context-parallel-size "$CP" \
    --cp-comm-type "$CP_COMM_TYPE" \
    --tensor-model-parallel-size "$TP" \
    --num-layers 4 \
    --hidden-size 128 \
    --num-attention-heads 4 \
    --group-query-attention \
    --num-query-groups 2 \
    --position-embedding-type rope \
    --seq-length "$SEQ_LENGTH" \
    --max-position-embeddings "$SEQ_LENGTH" \
    --attention-dropout 0.0 \
    --hidden-dropout 0.0 \
    --micro-batch-size 1 \
    --global-batch-size 2 \
    --train-iters "$TRAIN_ITERS" \
    --lr 2.0e-3 \
    --min-lr 2.0e-4 \
    --lr-decay-style cosine \
    --lr-warmup-iters 2 \
    --clip-grad 1.0 \
    --data-path "$DATA" \
    --vocab-file "$VOCAB_FILE" \
    --merge-file "$MERGE_FILE" \
    --split 90,8,2 \
    --num-workers 0 \
    --data-cache-path "$WORK_DIR/cache" \
    --log-interval 1 \
    --eval-interval "$TRAIN_ITERS" \
    --eval-iters 1 \
    --save "$WORK_DIR/checkpoints" \
    --save-interval "$TRAIN_ITERS"

echo "==> done. The checkpoint in $WORK_DIR/checkpoints loads at any --context-parallel-size (1 for text generation)."
