#!/usr/bin/env bash
# The test part of `make test`: pytest (tests/) and the e2e scenarios (e2e/run.sh). Both print their slowest tests,
# and the last lines say what each part took against the budget docs/testing.md states, so growth shows in every CI log.
# Needs PYTHON (the venv's); MAKE_START (seconds since the epoch) counts the install in the total.
#
# Two streams side by side: the slow tests (real jobs on Ray, in the foreground), and beside them the e2e scenarios,
# then the tests not marked slow (light, single-process ones; two pytest processes share them). Each alone leaves ~30%
# of the 2 cores idle (pods and jobs wait on Ray, the operator, start-up and each other): run one after the other,
# that idle time was on the critical path (measured: 28.6% idle over 1394 s of slow tests alone); side by side the
# machine is ~85-90% busy, each part slower, the whole shorter; the waits in both have wide margins. The second
# stream's output is kept in a file and printed once both have ended, so the logs do not interleave. With PYTEST_ARGS
# (a selection of tests), pytest runs once and then e2e. The GPU suite (tests/gpu, marked `gpu`: it fails without a
# GPU) is left out of every run here (-m '... not gpu'; a PYTEST_ARGS with a -m of its own decides);
# bench/gpu_check.sh runs it.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:?the venv python}"
start="${MAKE_START:-$(date +%s)}"
t0=$(date +%s)
busy_jiffies() {  # the machine's busy and total CPU time so far (/proc/stat: all but idle and iowait are busy)
  awk '/^cpu /{t=0; for (i=2; i<=9; i++) t+=$i; print t-$5-$6, t}' /proc/stat  # (guest time is in user)
}
read -r busy0 total0 < <(busy_jiffies)
rc=0
e2e_rc=0
if [ -n "${PYTEST_ARGS:-}" ]; then
  # shellcheck disable=SC2086  # PYTEST_ARGS is a list of pytest options
  "$PYTHON" -m pytest -ra --durations=30 -m "not gpu" ${PYTEST_ARGS} || rc=$?
  t1=$(date +%s)
  e2e="not run (pytest failed)"
  if [ "$rc" = 0 ]; then
    PYTHON="$PYTHON" e2e/run.sh || e2e_rc=$?
    e2e="$(( $(date +%s) - t1 ))s"
  fi
  parts="pytest $(( t1 - t0 ))s, e2e ${e2e}"
else
  # Each stream computes on half the cores: torch's default (one thread per core) in both streams' own processes
  # (pytest's in-process models, the ranks tests spawn) puts two busy threads on each core, and its OpenMP threads
  # then wait at every op's barrier for a thread the kernel descheduled (measured: HF greedy episodes of
  # test_agents.py took 39.5 s on two threads beside one busy core, 19.3 s on one; 11.5 s on two alone). A job's
  # workers still take their pool's cpusPerDevice (worker_host.use_threads).
  OMP_NUM_THREADS="${OMP_NUM_THREADS:-$(( $(nproc) > 3 ? $(nproc) / 2 : 1 ))}"
  export OMP_NUM_THREADS
  # The slow tests are shared by the two streams module by module (tests/support/module_claims.py): the first
  # stream takes them from the front; the second, once its e2e scenarios and light tests are done, from the back,
  # so that when the second stream would end first it takes over the first's last modules (the slow stream ran alone
  # ~480 s past the other on a 2-core AVX2 machine, ~390 s on a CI run; ~24 s on a 2-core AMX machine).
  # The light tests run in two processes that share them the same way (light_claims): one process keeps less than
  # one core busy (waits on sandboxes, operator ticks, servers, subprocesses). Measured alone on a 2-core AMX
  # machine, two processes then one, the same hour: 408 s / 610 busy CPU-s, against 774 s / 677.
  claimed() {  # pytest on the modules it claims in directory $1, taking them from the $2 (front or back)
    HYBRIDFLOW_TEST_CLAIMS="$1" HYBRIDFLOW_TEST_CLAIM_FROM="$2" "$PYTHON" -m pytest "${@:3}"
  }
  claims="$(mktemp -d -t test-claims.XXXXXX)"
  light_claims="$(mktemp -d -t light-claims.XXXXXX)"
  e2e_log="$(mktemp -t e2e-log.XXXXXX)"
  light_log="$(mktemp -t light-log.XXXXXX)"
  light_back_log="$(mktemp -t light-back-log.XXXXXX)"
  light_status="$(mktemp -t light-status.XXXXXX)"
  PYTHON="$PYTHON" e2e/run.sh >"$e2e_log" 2>&1 &
  e2e_pid=$!  # run.sh execs unshare, whose --kill-child ends everything in the scenarios' namespaces
  (  # once e2e has ended: the light tests, then the slow modules the first stream has not claimed; each one's exit
     # code and times in light_status
    while kill -0 "$e2e_pid" 2>/dev/null; do sleep 2; done
    t=$(date +%s)
    claimed "$light_claims" back -ra --durations=15 -m "not slow and not gpu" >"$light_back_log" 2>&1 &
    back_pid=$!
    claimed "$light_claims" front -ra --durations=15 -m "not slow and not gpu"
    light_rc=$?
    wait "$back_pid" || light_rc=1
    light_end=$(date +%s)
    echo "---------------- light tests, the second process (modules from the back) ----------------"
    cat "$light_back_log"
    tail_rc=0
    if [ ! -e "$claims/front-done" ]; then  # (else nothing is left: not even pytest's ~15 s of collection)
      echo "---------------- slow tests from the back (those the first stream had not claimed) ----------------"
      claimed "$claims" back -ra --durations=15 -m "slow and not gpu" || tail_rc=$?
    fi
    echo "$light_rc $t $light_end $tail_rc $(date +%s)" >"$light_status"
  ) >"$light_log" 2>&1 &
  light_pid=$!
  # Interrupted (Ctrl-C, a CI cancel): unshare ignores SIGTERM while it waits for its child, so SIGKILL it; end the
  # light tests; show where each was.
  trap 'exit 130' INT TERM
  trap 'kill -KILL "$e2e_pid" 2>/dev/null; pkill -P "$light_pid" 2>/dev/null; kill "$light_pid" 2>/dev/null
        echo "(interrupted; e2e, then light tests, so far:)"; tail -n 40 "$e2e_log" "$light_log" "$light_back_log"
        rm -rf "$e2e_log" "$light_log" "$light_back_log" "$light_status" "$claims" "$light_claims"' EXIT
  claimed "$claims" front -ra --durations=30 -m "slow and not gpu" || rc=$?
  t1=$(date +%s)
  touch "$claims/front-done"
  wait "$e2e_pid" || e2e_rc=$?
  wait "$light_pid"
  trap 'rm -rf "$e2e_log" "$light_log" "$light_back_log" "$light_status" "$claims" "$light_claims"' EXIT
  e2e_end="$(stat -c %Y "$e2e_log")"  # its last line was written as it ended
  echo "---------------- e2e scenarios (ran beside the slow tests) ----------------"
  cat "$e2e_log"
  echo "---------------- tests not marked slow (ran after e2e, beside the slow tests) ----------------"
  cat "$light_log"
  read -r light_rc light_start light_end tail_rc tail_end <"$light_status"
  [ "${light_rc:-}" = 0 ] && [ "${tail_rc:-}" = 0 ] || rc=1
  light="$(( ${light_end:-0} - ${light_start:-0} ))s then slow from the back $(( ${tail_end:-0} - ${light_end:-0} ))s"
  [ -n "${tail_end:-}" ] || light="(unfinished)"  # the second stream did not write its status
  parts="pytest slow $(( t1 - t0 ))s beside e2e $(( e2e_end - t0 ))s then not slow ${light}"
fi
[ "$e2e_rc" = 0 ] || rc=1
read -r busy1 total1 < <(busy_jiffies)
busy="$(( 100 * (busy1 - busy0) / (total1 - total0 > 0 ? total1 - total0 : 1) ))"
echo "make test: install $(( t0 - start ))s, ${parts}; total $(( $(date +%s) - start ))s; cores ${busy}% busy over" \
     "the tests (budget on a fresh 2-core machine: 1800s in all; see docs/testing.md)"
exit "$rc"
