#!/usr/bin/env bash
# The test command the README names. Runs the whole suite; extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec python -m pytest tests -q -p no:cacheprovider --timeout=900 "$@"
