#!/bin/bash
# Start the text generation server (PUT /api, POST /v1/completions, POST /v1/chat/completions,
# GET /health) on a Megatron GPT checkpoint; concurrent requests are batched by the inference engine.
#
# Usage (from the repository root):
#   bash examples/inference/run_text_generation_server.sh CHECKPOINT_DIR
#       single process (TP=1, PP=1)
#   TP=2 PP=2 bash examples/inference/run_text_generation_server.sh quickstart_work/checkpoints
#       tensor (and pipeline) parallel: TP*PP processes; rank 0 serves, the others follow it
#
# The model flags must describe the checkpoint. The defaults are the quickstart model
# (examples/quickstart.sh); override them with MODEL_ARGS, e.g. for a GPT-2 small checkpoint:
#   MODEL_ARGS="--num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024
#               --max-position-embeddings 1024" bash examples/inference/run_text_generation_server.sh CKPT
# Environment: TP, PP (default 1), PORT (5000), HOST (127.0.0.1; 0.0.0.0 serves other machines),
# MODEL_ARGS, EXTRA_ARGS (appended, e.g. "--bf16 --max-batch-size 32
# --inference-dynamic-batching-buffer-size-gb 4").

set -euo pipefail
cd "$(dirname "$0")/../.."

if [ $# -lt 1 ]; then
    sed -n '2,18p' "$0"
    exit 1
fi
CHECKPOINT=$1
PYTHON=${PYTHON:-python}
TP=${TP:-1}
PP=${PP:-1}
PORT=${PORT:-5000}
HOST=${HOST:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-$((20000 + RANDOM % 20000))}
MODEL_ARGS=${MODEL_ARGS:-"--num-layers 4 --hidden-size 128 --num-attention-heads 4 \
    --seq-length 64 --max-position-embeddings 64"}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1

# shellcheck disable=SC2086
exec "$PYTHON" -m torch.distributed.run --nproc-per-node $((TP * PP)) --master-port "$MASTER_PORT" \
    tools/run_text_generation_server.py \
    --load "$CHECKPOINT" \
    --tensor-model-parallel-size "$TP" \
    --pipeline-model-parallel-size "$PP" \
    $MODEL_ARGS \
    --micro-batch-size 1 \
    --tokenizer-type GPT2BPETokenizer \
    --vocab-file data/gpt2/gpt2-vocab.json \
    --merge-file data/gpt2/gpt2-merges.txt \
    --seed 42 \
    --host "$HOST" \
    --port "$PORT" \
    ${EXTRA_ARGS:-}
