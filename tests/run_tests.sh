#!/usr/bin/env bash
# The test command the README names. Runs the whole suite; extra arguments go to pytest.
# The log shows the ten slowest tests (pytest's --durations section, above its closing summary
# line) and, after that summary, one line with the suite's wall time.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
start=$(date +%s)
rc=0
python -m pytest tests -q -p no:cacheprovider --timeout=900 --durations=10 "$@" || rc=$?
echo "suite wall time: $(($(date +%s) - start)) s"
exit "$rc"
