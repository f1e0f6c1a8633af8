#!/usr/bin/env bash
# Supervised fine-tuning of a Hugging Face Llama on chat JSONL, end to end, on CPUs or GPUs:
#
#   1. a Hugging Face Llama directory (HF_DIR; by default a tiny random one with a ChatML
#      tokenizer is written by examples/sft/make_tiny_llama.py, no downloads),
#   2. imported with tools/checkpoint/convert.py at tensor-parallel size 2,
#   3. fine-tuned with pretrain_gpt.py --sft on data/sft/chat.jsonl (loss on answers only,
#      conversations packed with per-conversation attention),
#   4. served with tools/run_text_generation_server.py (the SFT tokenizer: its prompt format is
#      the chat template) and asked a question through POST /v1/chat/completions.
#
# Usage: bash examples/sft/finetune_llama.sh [WORK_DIR]     (default /tmp/megatron-sft)
# Environment: HF_DIR (a Llama-architecture directory with its tokenizer and chat template),
# TRAIN_ITERS (150), PORT (5000), PYTHON (python).
set -euo pipefail
cd "$(dirname "$0")/../.."

WORK=${1:-/tmp/megatron-sft}
PYTHON=${PYTHON:-python}
TRAIN_ITERS=${TRAIN_ITERS:-150}
PORT=${PORT:-5000}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
rm -rf "$WORK/imported" "$WORK/sft" "$WORK/cache"
mkdir -p "$WORK"

HF_DIR=${HF_DIR:-$WORK/hf}
if [ ! -f "$HF_DIR/config.json" ]; then
    "$PYTHON" examples/sft/make_tiny_llama.py --output "$HF_DIR"
fi

# 2. Import at TP 2 (the architecture and padded vocabulary travel in the checkpoint's args).
"$PYTHON" tools/checkpoint/convert.py --model-type GPT --loader hf --saver mcore \
    --load-dir "$HF_DIR" --save-dir "$WORK/imported" --target-tensor-parallel-size 2

# 3. Fine-tune: --finetune starts at iteration 0 from the imported weights.
"$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-port $((20000 + RANDOM % 20000)) \
    pretrain_gpt.py \
    --sft --tokenizer-type SFTTokenizer --tokenizer-model "$HF_DIR" \
    --sft-tokenizer-prompt-format default \
    --data-path data/sft/chat.jsonl --split 95,5,0 --data-cache-path "$WORK/cache" \
    --tensor-model-parallel-size 2 \
    --load "$WORK/imported" --use-checkpoint-args --finetune \
    --save "$WORK/sft" --save-interval 100000 \
    --seq-length 256 --micro-batch-size 4 --global-batch-size 8 \
    --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 10 --weight-decay 0.01 \
    --train-iters "$TRAIN_ITERS" --log-interval 25 --eval-interval 1000 --eval-iters 2 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --num-workers 0 --distributed-backend gloo

# 4. Serve the fine-tuned model (TP 2) with the tokenizer and prompt format it was trained with,
#    and ask it a question from the training set.
"$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-port $((20000 + RANDOM % 20000)) \
    tools/run_text_generation_server.py \
    --load "$WORK/sft" --use-checkpoint-args \
    --tokenizer-type SFTTokenizer --tokenizer-model "$HF_DIR" \
    --sft-tokenizer-prompt-format default \
    --distributed-backend gloo --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do
    if curl -s -o /dev/null "http://127.0.0.1:$PORT/v1/models"; then break; fi
    if ! kill -0 $SERVER 2>/dev/null; then cat "$WORK/server.log"; exit 1; fi
    sleep 2
done

# The server renders the conversation with the prompt format, up to the assistant's turn, and
# the answer ends at the end of the assistant's turn (<|im_end|>, the tokenizer's eos).
curl -s -X POST "http://127.0.0.1:$PORT/v1/chat/completions" -H 'Content-Type: application/json' \
    -d '{"messages": [{"role": "user", "content": "What is the title of chapter 1 of Moby-Dick?"}],
         "max_tokens": 40, "temperature": 0}'
echo
