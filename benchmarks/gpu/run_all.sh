#!/usr/bin/env bash
# The GPU check in one command: at most 8 minutes on one H100 with a CUDA PyTorch already
# installed and no network. From the repository root:
#
#     bash benchmarks/gpu/run_all.sh            # on a GPU machine
#     bash benchmarks/gpu/run_all.sh --dry-run  # anywhere: tiny sizes on the CPU, a few seconds
#
# 1. makes the package importable without downloading anything (pip install --no-deps
#    --no-build-isolation -e . when setuptools and pybind11 are there, else PYTHONPATH);
# 2. runs the CUDA-marked tests (pytest -m gpu);
# 3. runs benchmarks/gpu/bench_gpu.py: bf16 training step of a ~1.3B GPT (tokens/s, MFU against
#    the measured bf16 matmul peak, ratio to plain PyTorch + SDPA), fp16 with loss scaling against
#    the bf16 loss curve, measured vs theoretical memory, generation vs transformers' generate;
# 4. runs the MoE and context-parallel benchmarks (benchmarks/bench_moe.py,
#    benchmarks/bench_context_parallel.py);
# 5. prints the summary (every RESULT line) and exits non-zero if a step failed.
#
# Environment: OUT_DIR (default /tmp/megatron_gpu_bench; logs and the loss curves go there),
# PYTHON (default python), GPU_TESTS_TIMEOUT / BENCH_TIMEOUT / HOOK_TIMEOUT (seconds per step).
set -uo pipefail
cd "$(dirname "$0")/../.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
fi
PYTHON=${PYTHON:-python}
OUT_DIR=${OUT_DIR:-/tmp/megatron_gpu_bench}
GPU_TESTS_TIMEOUT=${GPU_TESTS_TIMEOUT:-110}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-240}
# The dry run's tiny benchmarks spawn processes on possibly busy CPUs: a longer default there.
if [ "$DRY_RUN" -eq 1 ]; then
    HOOK_TIMEOUT=${HOOK_TIMEOUT:-200}
else
    HOOK_TIMEOUT=${HOOK_TIMEOUT:-50}
fi
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: > "$SUMMARY"
FAILED=0
START=$(date +%s)

note() {
    echo "RESULT $1" | tee -a "$SUMMARY"
}

# Run one step with a time limit; its RESULT lines go to the summary, its output to a log.
step() {
    local name=$1 limit=$2
    shift 2
    echo "==> $name: $*"
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
    local rc=${PIPESTATUS[0]}
    if grep -q '^RESULT ' "$OUT_DIR/$name.log"; then
        grep '^RESULT ' "$OUT_DIR/$name.log" >> "$SUMMARY"
    else
        tail -n 3 "$OUT_DIR/$name.log" | sed "s/^/RESULT $name: /" >> "$SUMMARY"
    fi
    if [ "$rc" -eq 124 ]; then
        note "$name: TIMED OUT after ${limit}s"
        FAILED=1
    elif [ "$rc" -ne 0 ]; then
        note "$name: FAILED (exit $rc, log $OUT_DIR/$name.log)"
        FAILED=1
    fi
}

# 1. Importable package, no network.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=1
if [ "$DRY_RUN" -eq 0 ]; then
    if "$PYTHON" -c 'import setuptools, pybind11' 2>/dev/null; then
        "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . > "$OUT_DIR/install.log" 2>&1 \
            || echo "pip install failed (see $OUT_DIR/install.log); using PYTHONPATH=$PWD"
    else
        echo "setuptools/pybind11 missing: no install, PYTHONPATH=$PWD (the C++ dataset helper is not built; the benchmarks do not read datasets)"
    fi
fi

# 2. The CUDA-marked tests.
if [ "$DRY_RUN" -eq 1 ]; then
    note "gpu tests: skipped (dry run): $PYTHON -m pytest -q -m gpu tests"
else
    step gpu_tests "$GPU_TESTS_TIMEOUT" "$PYTHON" -m pytest -q -m gpu tests -p no:cacheprovider
fi

# 3. Training, memory and generation figures.
BENCH_ARGS=(--out-dir "$OUT_DIR")
if [ "$DRY_RUN" -eq 1 ]; then
    BENCH_ARGS+=(--dry-run)
fi
step bench_gpu "$BENCH_TIMEOUT" "$PYTHON" benchmarks/gpu/bench_gpu.py "${BENCH_ARGS[@]}"

# 4. The MoE and context-parallel benchmarks (each only when its script exists). The dry run
#    runs the same code paths on the CPU with tiny sizes: bench_moe's single-device parts (ours
#    vs HF Mixtral, grouped vs sequential; its expert-parallel part needs two devices and is
#    skipped on cuda), and bench_context_parallel's one-GPU per-block kernels (--kernels) and its
#    CP2 / CP1 comparison (what it runs with two GPUs).
# --- MoE (benchmarks/bench_moe.py) ---
if [ -f benchmarks/bench_moe.py ]; then
    if [ "$DRY_RUN" -eq 1 ]; then
        step bench_moe "$HOOK_TIMEOUT" "$PYTHON" benchmarks/bench_moe.py --device cpu --dtype fp32 \
            --parts hf grouped --layers 1 --hidden 32 --ffn 64 --heads 2 --groups 1 --experts 4 \
            --seq 16 --mbs 1 --vocab 128 --steps 1 --threads 1
    else
        step bench_moe "$HOOK_TIMEOUT" "$PYTHON" benchmarks/bench_moe.py --device cuda --dtype bf16
    fi
else
    note "moe: benchmarks/bench_moe.py not present; skipped"
fi
# --- context parallelism (benchmarks/bench_context_parallel.py) ---
if [ -f benchmarks/bench_context_parallel.py ]; then
    if [ "$DRY_RUN" -eq 1 ]; then
        CP_TINY=(--device cpu --seq-lengths 64 --num-layers 1 --hidden-size 32
            --num-attention-heads 4 --vocab 128 --steps 1)
        step bench_cp_kernels "$HOOK_TIMEOUT" "$PYTHON" benchmarks/bench_context_parallel.py \
            "${CP_TINY[@]}" --kernels
        step bench_context_parallel "$HOOK_TIMEOUT" "$PYTHON" benchmarks/bench_context_parallel.py \
            "${CP_TINY[@]}" --comm-types p2p
    else
        step bench_context_parallel "$HOOK_TIMEOUT" "$PYTHON" benchmarks/bench_context_parallel.py --device cuda
    fi
else
    note "context parallel: benchmarks/bench_context_parallel.py not present; skipped"
fi

# 5. Summary.
echo
echo "================ summary ($(( $(date +%s) - START )) s; logs in $OUT_DIR) ================"
sed 's/^RESULT //' "$SUMMARY"
exit "$FAILED"
