#!/usr/bin/env bash
# The test command the README names. Runs the whole suite; extra arguments go to pytest.
# The log shows the ten slowest tests (pytest's --durations section, above its closing summary
# line) and, after that summary, one line with the suite's wall time.
# TEST_WORKERS=N spreads test files over N pytest-xdist workers (whole files per worker). The
# default, 0, runs everything in this process: on the 2-core CI machine two workers were slower
# (2663 s against 2329 s serial), because their 4-rank gloo pools oversubscribe the cores.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start=$(date +%s)
rc=0
workers="${TEST_WORKERS:-0}"
dist=()
if [ "$workers" != "0" ]; then
    dist=(-n "$workers" --dist loadfile)
fi
python -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=10 "${dist[@]}" "$@" || rc=$?
echo "suite wall time: $(($(date +%s) - start)) s"
exit "$rc"
