#!/usr/bin/env bash
# The test part of `make test`: pytest (tests/), then the e2e scenarios (e2e/run.sh). Both print their slowest
# tests, and the last lines say what each part took against the budget the README states, so growth shows in
# every CI log. Needs PYTHON (the venv's); MAKE_START (seconds since the epoch) counts the install in the total.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:?the venv python}"
start="${MAKE_START:-$(date +%s)}"
t0=$(date +%s)
rc=0
# shellcheck disable=SC2086  # PYTEST_ARGS is a list of pytest options
"$PYTHON" -m pytest -ra --durations=30 ${PYTEST_ARGS:-} || rc=$?
t1=$(date +%s)
e2e="not run (pytest failed)"
if [ "$rc" = 0 ]; then
  PYTHON="$PYTHON" e2e/run.sh || rc=$?
  e2e="$(( $(date +%s) - t1 ))s"
fi
t2=$(date +%s)
echo "make test: install $(( t0 - start ))s, pytest $(( t1 - t0 ))s, e2e ${e2e}; total $(( t2 - start ))s" \
     "(budget on a fresh 2-core machine: 1800s in all; see README 'Tests')"
exit "$rc"
