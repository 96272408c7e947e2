#!/usr/bin/env bash
# The test part of `make test`: pytest (tests/) and the e2e scenarios (e2e/run.sh). Both print their slowest tests,
# and the last lines say what each part took against the budget the README states, so growth shows in every CI log.
# Needs PYTHON (the venv's); MAKE_START (seconds since the epoch) counts the install in the total.
#
# Two streams side by side: the slow tests (real jobs on Ray, in the foreground), and beside them the e2e scenarios,
# then the tests not marked slow (light, single-process ones). Each alone leaves ~30% of the 2 cores idle (pods and
# jobs wait on Ray, the operator, start-up and each other): run one after the other, that idle time was on the
# critical path (measured: 28.6% idle over 1394 s of slow tests alone); side by side the machine is ~90% busy, each
# part slower, the whole shorter; the waits in both have wide margins. So that neither stream ends long before the
# other (how long each takes differs from machine to machine), the last slow test files (SHARED_SLOW, in parts) go to
# whichever stream is free first. The second stream's output is kept in a file and printed once both have ended, so
# the logs do not interleave. With PYTEST_ARGS (a selection of tests), pytest runs once and then e2e.
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
  # Parts of the slow tests that either stream may run, the longest first (seconds in the foreground, fresh clone of
  # f6a2d54 on AVX-512: 104; 59 + 54; 26 + 16 + 42 + 13 + 13). The rest of the slow tests only the foreground runs.
  SHARED_SLOW=(
    "tests/test_weight_sync.py"
    "tests/test_megatron_example.py tests/test_observability.py"
    "tests/test_one_step_off.py tests/test_parallel_stages.py tests/test_recovery.py tests/test_throughput.py
     tests/test_worker_group.py"
  )
  claims="$(mktemp -d -t slow-parts.XXXXXX)"
  e2e_log="$(mktemp -t e2e-log.XXXXXX)"
  light_log="$(mktemp -t light-log.XXXXXX)"
  take_shared_parts() {  # each part no stream has taken yet (mkdir is the claim), then its exit code in the part's dir
    for i in "${!SHARED_SLOW[@]}"; do
      mkdir "$claims/$i" 2>/dev/null || continue
      echo "$1" >"$claims/$i/by"
      # shellcheck disable=SC2086  # a part is a list of files
      "$PYTHON" -m pytest -ra --durations=10 -m slow ${SHARED_SLOW[$i]}
      echo $? >"$claims/$i/rc"
    done
  }
  PYTHON="$PYTHON" e2e/run.sh >"$e2e_log" 2>&1 &
  e2e_pid=$!  # run.sh execs unshare, whose --kill-child ends everything in the scenarios' namespaces
  (  # once e2e has ended: the light tests (their exit code and end time in a line of their own), then shared parts
    while kill -0 "$e2e_pid" 2>/dev/null; do sleep 2; done
    t=$(date +%s)
    "$PYTHON" -m pytest -ra --durations=15 -m "not slow"
    echo "light-rc=$? light-start=$t light-end=$(date +%s)"
    take_shared_parts "the second stream"
    echo "second-end=$(date +%s)"
  ) >"$light_log" 2>&1 &
  light_pid=$!
  # Interrupted (Ctrl-C, a CI cancel): unshare ignores SIGTERM while it waits for its child, so SIGKILL it; end the
  # second stream and its pytest; show where each was.
  trap 'exit 130' INT TERM
  trap 'kill -KILL "$e2e_pid" 2>/dev/null; pkill -P "$light_pid" 2>/dev/null; kill "$light_pid" 2>/dev/null
        echo "(interrupted; e2e, then the second stream, so far:)"; tail -n 40 "$e2e_log" "$light_log"
        rm -rf "$e2e_log" "$light_log" "$claims"' EXIT
  ignore=()
  for f in ${SHARED_SLOW[*]}; do ignore+=("--ignore=$f"); done
  "$PYTHON" -m pytest -ra --durations=30 -m slow "${ignore[@]}" || rc=$?
  take_shared_parts "the foreground"
  t1=$(date +%s)
  wait "$e2e_pid" || e2e_rc=$?
  wait "$light_pid"
  trap 'rm -rf "$e2e_log" "$light_log" "$claims"' EXIT
  e2e_end="$(stat -c %Y "$e2e_log")"  # its last line was written as it ended
  echo "---------------- e2e scenarios (ran beside the slow tests) ----------------"
  cat "$e2e_log"
  echo "---------------- the second stream: tests not marked slow (after e2e), then shared slow parts ----------------"
  cat "$light_log"
  last="$(grep '^light-rc=' "$light_log" | tail -n 1)"
  light_rc="${last#light-rc=}"; light_rc="${light_rc%% *}"
  [ "$light_rc" = 0 ] || rc=1
  light_start="${last##*light-start=}"; light_start="${light_start%% *}"
  light_end="${last##*light-end=}"
  if [[ "$light_start" =~ ^[0-9]+$ && "$light_end" =~ ^[0-9]+$ ]]; then
    light="$(( light_end - light_start ))s"
  else
    light="(unfinished)"  # the light stream did not write its line
  fi
  second_end="$(grep '^second-end=' "$light_log" | tail -n 1)"; second_end="${second_end#second-end=}"
  [[ "$second_end" =~ ^[0-9]+$ ]] && second="$(( second_end - t0 ))s" || second="(unfinished)"
  shared=""
  for i in "${!SHARED_SLOW[@]}"; do  # every part ran, in one stream or the other, and passed
    [ "$(cat "$claims/$i/rc" 2>/dev/null)" = 0 ] || rc=1
    shared+="; $(echo ${SHARED_SLOW[$i]} | sed 's|tests/||g') by $(cat "$claims/$i/by" 2>/dev/null || echo nobody)"
  done
  parts="pytest slow $(( t1 - t0 ))s beside e2e $(( e2e_end - t0 ))s then not slow ${light}, that stream's end at"
  parts+=" ${second} (shared slow parts${shared})"
fi
[ "$e2e_rc" = 0 ] || rc=1
echo "make test: install $(( t0 - start ))s, ${parts}; total $(( $(date +%s) - start ))s" \
     "(budget on a fresh 2-core machine: 1800s in all; see README 'Tests')"
exit "$rc"
