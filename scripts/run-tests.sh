#!/usr/bin/env bash
# The test part of `make test`: pytest (tests/) and the e2e scenarios (e2e/run.sh). Both print their slowest tests,
# and the last lines say what each part took against the budget the README states, so growth shows in every CI log.
# Needs PYTHON (the venv's); MAKE_START (seconds since the epoch) counts the install in the total.
#
# The e2e scenarios run beside pytest: first beside the tests not marked slow (light, single-process ones), then
# beside the first of the slow ones. Alone, e2e leaves about 30% of the 2 cores idle (its pods wait on Ray, the
# operator and each other), and so do the slow tests (their jobs wait on Ray and start-up): run one after the other,
# the idle halves were ~300 s of the budget; run side by side, each is slower (their waits have wide margins), the
# whole is shorter. e2e's output is kept in a file and printed once both have ended, so the two logs do not
# interleave. With PYTEST_ARGS (a selection of tests), pytest runs once and then e2e.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:?the venv python}"
start="${MAKE_START:-$(date +%s)}"
t0=$(date +%s)
rc=0
e2e_rc=0
if [ -n "${PYTEST_ARGS:-}" ]; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of pytest options
  "$PYTHON" -m pytest -ra --durations=30 ${PYTEST_ARGS} || rc=$?
  t1=$(date +%s)
  e2e="not run (pytest failed)"
  if [ "$rc" = 0 ]; then
    PYTHON="$PYTHON" e2e/run.sh || e2e_rc=$?
    e2e="$(( $(date +%s) - t1 ))s"
  fi
  parts="pytest $(( t1 - t0 ))s, e2e ${e2e}"
else
  e2e_log="$(mktemp -t e2e-log.XXXXXX)"
  PYTHON="$PYTHON" e2e/run.sh >"$e2e_log" 2>&1 &
  e2e_pid=$!  # run.sh execs unshare, whose --kill-child ends everything in the scenarios' namespaces
  # Interrupted (Ctrl-C, a CI cancel): unshare ignores SIGTERM while it waits for its child, so SIGKILL it, and
  # show where e2e was.
  trap 'exit 130' INT TERM
  trap 'kill -KILL "$e2e_pid" 2>/dev/null; echo "(interrupted; e2e log so far:)"; tail -n 40 "$e2e_log"; rm -f "$e2e_log"' EXIT
  "$PYTHON" -m pytest -ra --durations=15 -m "not slow" || rc=$?
  t1=$(date +%s)
  "$PYTHON" -m pytest -ra --durations=30 -m slow || rc=$?
  t2=$(date +%s)
  wait "$e2e_pid" || e2e_rc=$?
  trap 'rm -f "$e2e_log"' EXIT
  e2e_end="$(stat -c %Y "$e2e_log")"  # its last line was written as it ended
  echo "---------------- e2e scenarios (ran beside pytest) ----------------"
  cat "$e2e_log"
  parts="pytest not slow $(( t1 - t0 ))s then slow $(( t2 - t1 ))s, beside e2e $(( e2e_end - t0 ))s"
fi
[ "$e2e_rc" = 0 ] || rc=1
echo "make test: install $(( t0 - start ))s, ${parts}; total $(( $(date +%s) - start ))s" \
     "(budget on a fresh 2-core machine: 1800s in all; see README 'Tests')"
exit "$rc"
