#!/usr/bin/env bash
# The GPU checks of issues 14 (item 3) and 50 (item 9) in one run on one NVIDIA GPU. Prints PASS/FAIL per check with
# seconds and a summary table; exits 1 if any check fails. Logs and results go to ${OUT:-/tmp/gpu_check}
# (8 files at most, flat: what a device runner brings back):
#   summary.txt      the table              results.jsonl   one JSON line per check: verdict, facts, notes
#   env.txt          versions, nvidia-smi   worker-logs.txt tails of the Ray workers' logs (NCCL, vLLM sleep lines)
#   fsdp.log  megatron.log (megatron and megatron_gen)  meta_load.log  throughput.log   each timed run's output
#   (throughput.log also ends with bench/async.py's output; throughput.py's table is in results.jsonl)
#
# Checks (bench/gpu_check.py holds one function per check; models are built from config, nothing is downloaded):
#   env          preflight: torch sees the GPU (else nothing else runs); versions, nvidia-smi
#   vllm_sync    FSDP2 actor + vLLM on 1 GPU: after every step vLLM's weights are the trainer's, engine not rebuilt
#   nccl         the same job's world: backend cpu:gloo,cuda:nccl (NCCL for CUDA tensors, gloo for CPU ones, both
#                all-reduced), FSDP's mesh on it, LOCAL_RANK / CUDA_VISIBLE_DEVICES as local_device_env decided
#   sleep_wake   the same job: vLLM sleeps (level 2) through each update (device memory drops), wakes at the sync,
#                then generates with the trainer's weights, non-degenerate tokens
#   fp32_master  the same job (actor dtype bfloat16): fp32 parameters, gradients and AdamW moments, bf16 compute
#   megatron     megatron actor (TP 1) + vLLM on 1 GPU: weights synced after every step
#   meta_load    a Qwen2.5-1.5B-shaped model (random bf16 safetensors written first) built by fsdp.build on one
#                rank: meta-device init, its shards read; CUDA allocator peak vs 1.3 x M/N and the memory model
#   throughput   bench/throughput.py --gpu --steps 3 on a Qwen2.5-0.5B-shaped model (baseline vs defaults, tokens/s)
#   async        python bench/async.py --modes abcd --steps 12, last, informational (no PASS/FAIL row; its exit
#                status counts): sync colocated vs sync / one_step_off / async on a trainer pool and a rollout pool
#                of their own. Reduced form on the CPUs: every apart mode needs one device per pool and Ray gives one
#                GPU per rank, so one GPU cannot hold it; the device machine's 16 cores can, each side on cores of
#                its own, which shows whether the overlap gains hold when the sides do not share 2 cores (as they do
#                on the 2-core dev machine). The 7B PROJECTION it prints is arithmetic.
# vllm_sync, nccl, sleep_wake and fp32_master share one job (one timeout, "fsdp"): vLLM start-ups are expensive.
#
# --rollout hf (a machine without vLLM, e.g. this workplace's GPU device: bench/gpu_device_run.sh, one call of at
# most 7.5 minutes of device time with the machine's start): the same jobs with the plain-torch generation engine.
# vllm_sync checks hf's in-place sync and its generation after the sync; sleep_wake is SKIP (vLLM's sleep mode
# only); megatron_gen (log appended to megatron.log) feeds megatron generation its native shards; megatron with hf
# generation (the 3D-HybridEngine's HF conversion, CPU-tested) is not run on the GPU for the budget (T_MEGATRON=0;
# the CPU rehearsal runs it); throughput runs throughput.py's GPU job with hf generation, defaults only (vLLM-only
# switches left out); async is not run (its jobs are vLLM CPU jobs). `--dry-run --rollout hf` prints the budget.
#
# Usage:
#   bench/gpu_check.sh                 on the GPU machine
#   bench/gpu_check.sh --rollout hf    on a GPU machine without vLLM (any mode takes --rollout, last)
#   bench/gpu_check.sh --dry-run       validates the jobs (parse_job), prints the plan and budget; starts nothing
#   flock /tmp/hf-bench.lock bench/gpu_check.sh --cpu-smoke
#                                      fsdp and megatron on one CPU rank, 2 steps, meta_load with a small shape and
#                                      throughput on throughput.py's CPU job made small (the tiny model, one rank):
#                                      this script's code paths on gloo (no sleep mode on CPU: sleep_wake is SKIP)
# Environment: OUT, PYTHON (default .venv/bin/python), GPU_CHECK_BUDGET_S (whole run), T_ENV, T_FSDP, T_MEGATRON,
#   T_MEGATRON_GEN, T_META_LOAD, T_THROUGHPUT, T_ASYNC (each run's timeout, s; 0 skips any but env and fsdp),
#   TP_STEPS (throughput's steps), HYBRIDFLOW_MODEL_CACHE.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

MODE=gpu
ROLLOUT=vllm
while (($#)); do
  case "$1" in
    --dry-run) MODE=dry ;;
    --cpu-smoke) MODE=cpu ;;
    --rollout) ROLLOUT=${2:-}; shift ;;
    *) echo "usage: $0 [--dry-run | --cpu-smoke] [--rollout vllm|hf]" >&2; exit 2 ;;
  esac
  shift
done
case "$ROLLOUT" in vllm | hf) ;; *) echo "--rollout: vllm or hf" >&2; exit 2 ;; esac
RO=(--rollout "$ROLLOUT")

OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HYBRIDFLOW_MODEL_CACHE=${HYBRIDFLOW_MODEL_CACHE:-/tmp/gpu_check_models}
mkdir -p "$OUT"
rm -f "$OUT"/{summary.txt,results.jsonl,env.txt,worker-logs.txt,fsdp.log,megatron.log,meta_load.log,throughput.log}
rm -f "$OUT"/throughput.json  # written by earlier versions

if [[ $MODE == cpu ]]; then
  CPU=(--cpu); STEPS=(--steps 2); BUDGET=${GPU_CHECK_BUDGET_S:-1800}
  T_ENV=${T_ENV:-60}; T_FSDP=${T_FSDP:-600}; T_MEGATRON=${T_MEGATRON:-600}; T_MEGATRON_GEN=${T_MEGATRON_GEN:-600}
  T_META_LOAD=${T_META_LOAD:-180}; T_THROUGHPUT=${T_THROUGHPUT:-300}; T_ASYNC=0; TP_STEPS=${TP_STEPS:-2}
elif [[ $ROLLOUT == hf ]]; then
  # the lent GPU device (bench/gpu_device_run.sh): one call of at most 7.5 min of device time, the machine's start
  # (~90-120 s) and the carry's unpacking (~10 s) included, so ~300 s for the checks. Estimates for an H100/H200
  # with 16 cores (not measured yet): env ~10 s; fsdp ~40 s (private Ray, one worker, CUDA + NCCL start, 3 tiny
  # steps); megatron_gen ~40 s; meta_load ~30 s (3.1 GB of bf16 written, 6.2 GB of fp32 shards loaded); throughput
  # ~70 s (a 494 M model built on the CPU, 3 steps of 64 x 4 responses <= 128 tokens, HF generation). A run gets
  # at most what is left of the budget.
  CPU=(); STEPS=(); BUDGET=${GPU_CHECK_BUDGET_S:-300}
  T_ENV=${T_ENV:-20}; T_FSDP=${T_FSDP:-70}; T_MEGATRON=${T_MEGATRON:-0}; T_MEGATRON_GEN=${T_MEGATRON_GEN:-60}
  T_META_LOAD=${T_META_LOAD:-55}; T_THROUGHPUT=${T_THROUGHPUT:-95}; T_ASYNC=${T_ASYNC:-0}; TP_STEPS=${TP_STEPS:-3}
else
  # a GPU machine with vLLM: ~515 s for the checks + 150 s for async (it gets what is left, at most T_ASYNC)
  CPU=(); STEPS=(); BUDGET=${GPU_CHECK_BUDGET_S:-665}
  # estimates for an H200 (not measured yet): env ~10 s, fsdp ~60 s, megatron ~60-90 s (vLLM in fp32: Triton
  # attention, compiled on first use), meta_load ~30 s, throughput ~140 s (two jobs of a 0.5B-shaped model)
  T_ENV=${T_ENV:-25}; T_FSDP=${T_FSDP:-110}; T_MEGATRON=${T_MEGATRON:-115}; T_META_LOAD=${T_META_LOAD:-60}
  T_THROUGHPUT=${T_THROUGHPUT:-205}; TP_STEPS=${TP_STEPS:-4}
  # async: 4 CPU jobs of 12 steps, ~25-35 s each with 16 cores (estimate; ~60 s each on the 2-core dev machine)
  T_ASYNC=${T_ASYNC:-150}
fi
if [[ $ROLLOUT == vllm ]]; then
  T_MEGATRON_GEN=0  # megatron generation: a machine without vLLM only (with vLLM, megatron checks vLLM's sync)
else
  if ((T_ASYNC > 0)); then
    echo "gpu_check: --rollout $ROLLOUT: async not run (bench/async.py runs examples/tiny-grpo.yaml's vLLM CPU jobs)"
  fi
  T_ASYNC=0
fi

echo "gpu_check: mode $MODE, rollout $ROLLOUT, python $PY, out $OUT, budget ${BUDGET}s (env ${T_ENV}s, fsdp" \
     "${T_FSDP}s, megatron ${T_MEGATRON}s, megatron_gen ${T_MEGATRON_GEN}s, meta_load ${T_META_LOAD}s, throughput" \
     "${T_THROUGHPUT}s, async ${T_ASYNC}s)"
if [[ $MODE == dry ]]; then
  "$PY" bench/gpu_check.py plan "${RO[@]}" --steps "$TP_STEPS" || exit 1
  sum=$((T_ENV + T_FSDP + T_MEGATRON + T_MEGATRON_GEN + T_META_LOAD + T_THROUGHPUT + T_ASYNC))
  echo "would run, each under timeout, in this order (a run gets at most what is left of the ${BUDGET}s budget;" \
       "0s: not run):"
  row() { printf '  %-98s %9s\n' "$1" "$2"; }
  row "$PY bench/gpu_check.py env ${RO[*]}" "${T_ENV}s"
  row "$PY bench/gpu_check.py fsdp ${RO[*]}  (vllm_sync, nccl, sleep_wake, fp32_master)" "${T_FSDP}s"
  row "$PY bench/gpu_check.py megatron ${RO[*]}" "${T_MEGATRON}s"
  row "$PY bench/gpu_check.py megatron_gen  (hf runs only)" "${T_MEGATRON_GEN}s"
  row "$PY bench/gpu_check.py meta_load  (Qwen2.5-1.5B shape, 1 rank)" "${T_META_LOAD}s"
  row "$PY bench/gpu_check.py throughput ${RO[*]} --steps $TP_STEPS  (Qwen2.5-0.5B shape)" "${T_THROUGHPUT}s"
  row "$PY bench/async.py --modes abcd --steps 12  (CPU ranks; in throughput.log)" "${T_ASYNC}s"
  row "$PY bench/gpu_check.py summary ${RO[*]}" "-"
  row "sum of the limits (budget ${BUDGET}s)" "${sum}s"
  if [[ $ROLLOUT == hf ]]; then
    echo "device time of one call (bench/gpu_device_run.sh; run's timeout_s 540; at most 450 s in all):"
    row "machine start (before the command)" "~90-120s"
    row "unpacking the carried packages" "~10s"
    row "the checks (GPU_CHECK_BUDGET_S, at most)" "${BUDGET}s"
    row "summary, cleanup, transfers" "~5-10s"
    row "total (call give_back after it, or +30 s warm)" "~$((BUDGET + 105))-$((BUDGET + 140))s"
  fi
  if [[ $ROLLOUT == vllm ]]; then
    "$PY" bench/async.py --dry-run --modes abcd --steps 12 | grep '^ok ' || exit 1
  fi
  exit 0
fi

START=$(date +%s)
GROUPS_ARGS=()
LAST_RC=0

# run NAME LIMIT CHECKS ARGS...: `gpu_check.py NAME ARGS` under `timeout`, output to the terminal and OUT/NAME.log
# (env writes OUT/env.txt itself); then the Ray processes the run left behind (their command lines name the run's
# Ray temp dir, $GPU_CHECK_RAY_DIR) are ended, and the run is remembered for the summary. throughput.py makes its
# own Ray temp dirs: a timed-out throughput run may leave Ray processes until the machine is given back.
run() {
  local name=$1 limit=$2 checks=$3; shift 3
  local left=$((START + BUDGET - $(date +%s)))
  local t=$((limit < left ? limit : left))
  if ((t < 15)); then
    echo "== $name: skipped, ${left}s of the budget left"
    GROUPS_ARGS+=(--group "$name:-1:0:$limit:$checks")
    LAST_RC=1
    return
  fi
  local raydir
  raydir=$(mktemp -d /tmp/gcXXXXXX)
  echo "== $name ($checks): limit ${t}s"
  local t0 rc log=/dev/null
  [[ $name != env ]] && log=$OUT/${name%_gen}.log  # megatron_gen: megatron.log (8 files come back, no more)
  t0=$(date +%s)
  GPU_CHECK_RAY_DIR=$raydir timeout -k 8 "$t" "$PY" bench/gpu_check.py "$name" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  local secs=$(($(date +%s) - t0))
  "$PY" bench/gpu_check.py cleanup --mention "$raydir" --grace 2 || true
  rm -rf "$raydir"
  if ((rc == 124 || rc == 137)); then
    echo "== $name: TIMED OUT after ${secs}s (limit ${t}s)"
  else
    echo "== $name: exit $rc after ${secs}s"
  fi
  GROUPS_ARGS+=(--group "$name:$rc:$secs:$t:$checks")
  LAST_RC=$rc
}

EXPECT=env,vllm_sync,nccl,sleep_wake,fp32_master
((T_MEGATRON > 0)) && EXPECT+=,megatron
((T_MEGATRON_GEN > 0)) && EXPECT+=,megatron_gen
((T_META_LOAD > 0)) && EXPECT+=,meta_load
((T_THROUGHPUT > 0)) && EXPECT+=,throughput
run env "$T_ENV" env "${CPU[@]}" "${RO[@]}"
if [[ $MODE == gpu && $LAST_RC != 0 ]]; then
  echo "== preflight failed (torch sees no GPU, or a worker-side import fails: see env above): the other checks" \
       "are not run"
  T_ASYNC=0
else
  run fsdp "$T_FSDP" vllm_sync,nccl,sleep_wake,fp32_master "${CPU[@]}" "${STEPS[@]}" "${RO[@]}"
  if ((T_MEGATRON > 0)); then
    run megatron "$T_MEGATRON" megatron "${CPU[@]}" "${STEPS[@]}" "${RO[@]}"
  fi
  if ((T_MEGATRON_GEN > 0)); then
    run megatron_gen "$T_MEGATRON_GEN" megatron_gen "${CPU[@]}" "${STEPS[@]}"
  fi
  if ((T_META_LOAD > 0)); then
    run meta_load "$T_META_LOAD" meta_load "${CPU[@]}"
  fi
  if ((T_THROUGHPUT > 0)); then
    lim=$T_THROUGHPUT  # the last run (no async after it) may take whatever the earlier ones left of the budget
    ((T_ASYNC == 0 && START + BUDGET - $(date +%s) > lim)) && lim=$((START + BUDGET - $(date +%s)))
    run throughput "$lim" throughput --steps "$TP_STEPS" "${CPU[@]}" "${RO[@]}"
  fi
fi

# async: sync colocated vs sync apart / one_step_off / async (maxStaleness 2) on 1 trainer + 1 rollout CPU rank;
# prints steps/s and tokens/s ratios, idle fractions, staleness, weight-sync s and bytes, held-out reward, then
# the projection. Not through run(): bench/gpu_check.py has no such check (its summary lists its own); the jobs'
# Ray dirs are under $raydir, so the cleanup finds what a timeout leaves.
ASYNC_RC=0
if ((T_ASYNC > 0)); then
  left=$((START + BUDGET - $(date +%s)))
  t=$((T_ASYNC < left ? T_ASYNC : left))
  if ((t < 60)); then
    echo "== async: skipped, ${left}s of the budget left"
  else
    raydir=$(mktemp -d /tmp/gcXXXXXX)
    echo "== async (bench/async.py --modes abcd --steps 12): limit ${t}s" | tee -a "$OUT/throughput.log"
    t0=$(date +%s)
    timeout -k 8 "$t" "$PY" bench/async.py --modes abcd --steps 12 --keep "$raydir" 2>&1 | tee -a "$OUT/throughput.log"
    ASYNC_RC=${PIPESTATUS[0]}
    "$PY" bench/gpu_check.py cleanup --mention "$raydir" --grace 2 || true
    rm -rf "$raydir"
    echo "== async: exit $ASYNC_RC after $(($(date +%s) - t0))s (124/137: timed out)" | tee -a "$OUT/throughput.log"
  fi
fi

TOTAL=$(($(date +%s) - START))
echo
"$PY" bench/gpu_check.py summary --expect "$EXPECT" --total "$TOTAL" "${GROUPS_ARGS[@]}" "${RO[@]}"
SUMMARY_RC=$?
((ASYNC_RC != 0)) && echo "async: FAIL (exit $ASYNC_RC; see throughput.log)"
((SUMMARY_RC != 0 || ASYNC_RC != 0)) && exit 1
exit 0
