#!/usr/bin/env bash
# The test command the README names. Runs the whole suite; extra arguments go to pytest.
# The log shows the ten slowest tests (pytest's --durations section, above its closing summary
# line) and, after that summary, one line with the suite's wall time.
# Test files are spread over TEST_WORKERS pytest-xdist workers (default 2, one per core of the CI
# machine; whole files per worker, so a module's fixtures are built once): much of the suite is
# one process waiting on a subprocess or on one gloo rank, which leaves the other core idle.
# TEST_WORKERS=0 runs everything in this process.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start=$(date +%s)
rc=0
workers="${TEST_WORKERS:-2}"
dist=()
if [ "$workers" != "0" ]; then
    dist=(-n "$workers" --dist loadfile)
fi
python -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=10 "${dist[@]}" "$@" || rc=$?
echo "suite wall time: $(($(date +%s) - start)) s"
exit "$rc"
