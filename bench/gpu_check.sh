#!/usr/bin/env bash
# The GPU checks of issues 14 (item 3) and 50 (item 9) in one run on one NVIDIA GPU: the pytest suite tests/gpu
# (`pytest -m gpu`; every test there is marked `gpu`, which `make test` leaves out), with this run's settings and
# time limits. Prints pytest's report and a summary table; exits 1 if any check fails. Logs and results go to
# ${OUT:-/tmp/gpu_check} (8 files at most, flat: what a device runner brings back):
#   summary.txt      the table (tests/gpu/conftest.py)   results.jsonl   one JSON line per check: outcome, facts, notes
#   env.txt          versions, nvidia-smi                  worker-logs.txt tails of the Ray workers' logs
#   pytest.log       the suite's output                    throughput.log  bench/throughput.py's output, then async's
#
# Checks (one test each; models are built from config or written with random weights, nothing is downloaded):
#   env          tests/gpu/test_gpu_env.py       preflight: torch sees the GPU (else every other check fails at
#                                                once); versions, nvidia-smi; the worker diagnostics are registered
#   vllm_sync    tests/gpu/test_gpu_fsdp.py      FSDP2 actor + vLLM on 1 GPU: after every step vLLM's weights are the
#                                                trainer's (every tensor, read in the worker), engine not rebuilt
#   nccl                                         the same job's world: backend cpu:gloo,cuda:nccl (NCCL for CUDA
#                                                tensors, gloo for CPU ones, both all-reduced), FSDP's mesh on it,
#                                                LOCAL_RANK / CUDA_VISIBLE_DEVICES as local_device_env decided
#   sleep_wake                                   the same job: vLLM sleeps (level 2) through each update (device
#                                                memory drops), wakes at the sync, then generates with the trainer's
#                                                weights, non-degenerate tokens
#   fp32_master                                  the same job (actor dtype bfloat16): fp32 parameters, gradients and
#                                                AdamW moments, bf16 compute
#   megatron     tests/gpu/test_gpu_megatron.py  megatron actor (TP 1) + vLLM on 1 GPU: weights synced every step
#   megatron_gen                                 megatron actor + megatron generation (hf runs only)
#   meta_load    tests/gpu/test_gpu_meta_load.py a Qwen2.5-1.5B-shaped model (random bf16 safetensors written first)
#                                                built by fsdp.build on one rank: meta-device init, its shards read;
#                                                CUDA allocator peak vs 1.3 x M/N and the memory model
#   throughput   tests/gpu/test_gpu_throughput.py bench/throughput.py --gpu on a Qwen2.5-0.5B-shaped model (baseline
#                                                vs defaults, tokens/s)
#   async        python bench/async.py --modes abcd --steps 12, last, informational (no row in the table; its exit
#                status counts): sync colocated vs sync / one_step_off / async on a trainer pool and a rollout pool
#                of their own. Reduced form on the CPUs: every apart mode needs one device per pool and Ray gives one
#                GPU per rank, so one GPU cannot hold it; the device machine's 16 cores can, each side on cores of
#                its own, which shows whether the overlap gains hold when the sides do not share 2 cores (as they do
#                on the 2-core dev machine). The 7B PROJECTION it prints is arithmetic.
# vllm_sync, nccl, sleep_wake and fp32_master share one job (the module's fixture; T_FSDP limits each of them, the
# first one's including the job's start): vLLM start-ups are expensive. What the checks read inside the workers
# they read through WorkerHost.diagnose (workers/hybridflow/single_controller/diagnostics.py; CPU-tested in
# tests/single_controller/test_diagnostics.py); the suite's jobs are validated on the CPU by tests/test_gpu_suite.py.
#
# --rollout hf (a machine without vLLM, e.g. this workplace's GPU device: bench/gpu_device_run.sh, one call of at
# most 7.5 minutes of device time with the machine's start): the same jobs with the plain-torch generation engine.
# vllm_sync checks hf's in-place sync and its generation after the sync; sleep_wake is not selected (vLLM's sleep
# mode only; run alone with hf it fails, saying so); megatron_gen feeds megatron generation its native shards;
# megatron with hf generation (the 3D-HybridEngine's HF conversion, CPU-tested) is not run on the GPU for the budget
# (T_MEGATRON=0; the CPU smoke run runs it); throughput runs throughput.py's GPU job with hf generation, defaults
# only (vLLM-only switches left out); async is not run (its jobs are vLLM CPU jobs). `--dry-run --rollout hf` prints
# the budget.
#
# Usage:
#   bench/gpu_check.sh                 on the GPU machine
#   bench/gpu_check.sh --rollout hf    on a GPU machine without vLLM (any mode takes --rollout, last)
#   bench/gpu_check.sh --dry-run       collects the suite, validates its jobs (tests/test_gpu_suite.py), prints the
#                                      plan and budget; starts nothing on a device
#   flock /tmp/hf-bench.lock bench/gpu_check.sh --cpu-smoke
#                                      the suite with GPU_CHECK_CPU=1: fsdp and megatron on one CPU rank, 2 steps,
#                                      meta_load with a small shape and throughput on throughput.py's CPU job made
#                                      small: the suite's code paths on gloo (no sleep mode on CPU: memory not judged)
# Environment: OUT, PYTHON (default .venv/bin/python), GPU_CHECK_BUDGET_S (whole run), T_ENV, T_FSDP, T_MEGATRON,
#   T_MEGATRON_GEN, T_META_LOAD, T_THROUGHPUT, T_ASYNC (each check's time limit, s; 0 leaves out any but env and
#   fsdp's), TP_STEPS (throughput's steps), HYBRIDFLOW_MODEL_CACHE. The suite itself reads GPU_CHECK_ROLLOUT,
#   GPU_CHECK_CPU, GPU_CHECK_STEPS, GPU_CHECK_TP_RUNS, TP_STEPS and the T_* limits (tests/gpu/gpu_harness.py).
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

OUT=${OUT:-/tmp/gpu_check}
PY=${PYTHON:-}
if [[ -z $PY ]]; then
  if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
export OUT PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export HYBRIDFLOW_MODEL_CACHE=${HYBRIDFLOW_MODEL_CACHE:-/tmp/gpu_check_models}
mkdir -p "$OUT"
rm -f "$OUT"/{summary.txt,results.jsonl,env.txt,worker-logs.txt,pytest.log,throughput.log}
rm -f "$OUT"/{throughput.json,fsdp.log,megatron.log,meta_load.log}  # written by earlier versions

GPU_CHECK_CPU=0
if [[ $MODE == cpu ]]; then
  GPU_CHECK_CPU=1; export GPU_CHECK_STEPS=${GPU_CHECK_STEPS:-2}; BUDGET=${GPU_CHECK_BUDGET_S:-1800}
  T_ENV=${T_ENV:-60}; T_FSDP=${T_FSDP:-600}; T_MEGATRON=${T_MEGATRON:-600}; T_MEGATRON_GEN=${T_MEGATRON_GEN:-600}
  T_META_LOAD=${T_META_LOAD:-180}; T_THROUGHPUT=${T_THROUGHPUT:-300}; T_ASYNC=0; TP_STEPS=${TP_STEPS:-2}
elif [[ $ROLLOUT == hf ]]; then
  # the lent GPU device (bench/gpu_device_run.sh): one call of at most 7.5 min of device time, the machine's start
  # (~90-120 s) and the carry's unpacking (~10 s) included, so ~300 s for the checks. Estimates for an H100/H200
  # with 16 cores (not measured yet): env ~10 s; fsdp ~40 s (private Ray, one worker, CUDA + NCCL start, 3 tiny
  # steps); megatron_gen ~40 s; meta_load ~30 s (3.1 GB of bf16 written, 6.2 GB of fp32 shards loaded); throughput
  # ~70 s (a 494 M model built on the CPU, 3 steps of 64 x 4 responses <= 128 tokens, HF generation). pytest's own
  # start (~5 s) comes on top. The whole run stops at the budget.
  BUDGET=${GPU_CHECK_BUDGET_S:-300}
  T_ENV=${T_ENV:-20}; T_FSDP=${T_FSDP:-70}; T_MEGATRON=${T_MEGATRON:-0}; T_MEGATRON_GEN=${T_MEGATRON_GEN:-60}
  T_META_LOAD=${T_META_LOAD:-55}; T_THROUGHPUT=${T_THROUGHPUT:-95}; T_ASYNC=${T_ASYNC:-0}; TP_STEPS=${TP_STEPS:-3}
else
  # a GPU machine with vLLM: ~515 s for the checks + 150 s for async (it gets what is left, at most T_ASYNC)
  BUDGET=${GPU_CHECK_BUDGET_S:-665}
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
export GPU_CHECK_ROLLOUT=$ROLLOUT GPU_CHECK_CPU TP_STEPS T_ENV T_FSDP T_MEGATRON T_MEGATRON_GEN T_META_LOAD T_THROUGHPUT

# the checks this run selects (pytest node ids), in the suite's order
G=tests/gpu
FSDP=(vllm_sync)  # the fsdp checks selected: they share one job, each under T_FSDP
if [[ $ROLLOUT == vllm ]]; then FSDP+=(sleep_wake); fi
FSDP+=(nccl fp32_master)
TESTS=("$G/test_gpu_env.py::test_env")
EXPECT=env
for c in "${FSDP[@]}"; do TESTS+=("$G/test_gpu_fsdp.py::test_$c"); EXPECT+=,$c; done
((T_MEGATRON > 0)) && { TESTS+=("$G/test_gpu_megatron.py::test_megatron"); EXPECT+=,megatron; }
((T_MEGATRON_GEN > 0)) && { TESTS+=("$G/test_gpu_megatron.py::test_megatron_gen"); EXPECT+=,megatron_gen; }
((T_META_LOAD > 0)) && { TESTS+=("$G/test_gpu_meta_load.py::test_meta_load"); EXPECT+=,meta_load; }
((T_THROUGHPUT > 0)) && { TESTS+=("$G/test_gpu_throughput.py::test_throughput"); EXPECT+=,throughput; }
PYTEST=("$PY" -m pytest -m gpu -ra -p no:cacheprovider)

echo "gpu_check: mode $MODE, rollout $ROLLOUT, python $PY, out $OUT, budget ${BUDGET}s (env ${T_ENV}s, fsdp" \
     "${T_FSDP}s per check, megatron ${T_MEGATRON}s, megatron_gen ${T_MEGATRON_GEN}s, meta_load ${T_META_LOAD}s," \
     "throughput ${T_THROUGHPUT}s, async ${T_ASYNC}s)"
if [[ $MODE == dry ]]; then
  "${PYTEST[@]}" --collect-only -q "${TESTS[@]}" || exit 1
  "$PY" -m pytest -q -p no:cacheprovider "tests/test_gpu_suite.py::test_every_job_of_the_suite_validates[$ROLLOUT]" \
    || exit 1
  sum=$((T_ENV + ${#FSDP[@]} * T_FSDP + T_MEGATRON + T_MEGATRON_GEN + T_META_LOAD + T_THROUGHPUT + T_ASYNC))
  echo "would run, under the ${BUDGET}s budget (each check under its own limit; 0s: not run):"
  row() { printf '  %-98s %9s\n' "$1" "$2"; }
  row "${PYTEST[*]} $G  (the checks above; results in $OUT)" "$((BUDGET - T_ASYNC))s"
  row "  env" "${T_ENV}s"
  fsdp_label=$(IFS=,; echo "${FSDP[*]}"); fsdp_label=${fsdp_label//,/, }
  row "  $fsdp_label (one job; the first one's limit covers its start)" "${T_FSDP}s each"
  row "  megatron" "${T_MEGATRON}s"
  row "  megatron_gen  (hf runs only)" "${T_MEGATRON_GEN}s"
  row "  meta_load  (Qwen2.5-1.5B shape, 1 rank)" "${T_META_LOAD}s"
  row "  throughput --steps $TP_STEPS  (Qwen2.5-0.5B shape)" "${T_THROUGHPUT}s"
  row "$PY bench/async.py --modes abcd --steps 12  (CPU ranks; in throughput.log)" "${T_ASYNC}s"
  row "sum of the limits (the budget stops the run first)" "${sum}s"
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
# The jobs' private Rays make their temp dirs under this one (tests/gpu/gpu_harness.py job_session); what a timeout
# leaves of them (their command lines name it) is ended afterwards. throughput.py makes its own Ray temp dirs: a
# timed-out throughput run may leave Ray processes until the machine is given back.
raydir=$(mktemp -d /tmp/gcXXXXXX)
cleanup() { "$PY" tests/support/processes.py "$1" 2 || true; rm -rf "$1"; }
CHECKS_BUDGET=$((BUDGET - T_ASYNC))  # async (last) gets the rest
echo "== pytest -m gpu: ${#TESTS[@]} checks, the whole run limited to ${CHECKS_BUDGET}s"
GPU_CHECK_RAY_DIR=$raydir timeout -k 8 "$CHECKS_BUDGET" "${PYTEST[@]}" "${TESTS[@]}" 2>&1 | tee -a "$OUT/pytest.log"
RC=${PIPESTATUS[0]}
cleanup "$raydir"
if ((RC == 124 || RC == 137)); then
  echo "== pytest: TIMED OUT after $(($(date +%s) - START))s (limit ${CHECKS_BUDGET}s)"
fi
# an expected check with no result (the budget ran out, a crash) is a FAIL row of the table
"$PY" - "$OUT" "$EXPECT" "$RC" <<'EOF'
import json, pathlib, sys
out, expect, rc = pathlib.Path(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3])
res = out / "results.jsonl"
seen = {json.loads(x)["check"] for x in res.read_text().splitlines() if x.strip()} if res.is_file() else set()
missing = [c for c in expect if c not in seen]
if missing:
    why = "the run timed out" if rc in (124, 137) else f"pytest exited {rc}"
    rows = [f"FAIL    {c}  no result ({why})" for c in missing]
    with open(out / "summary.txt", "a") as f:
        f.write("\n".join(rows) + "\noverall: FAIL\n")
    print("\n".join(rows))
EOF

# async: sync colocated vs sync apart / one_step_off / async (maxStaleness 2) on 1 trainer + 1 rollout CPU rank;
# prints steps/s and tokens/s ratios, idle fractions, staleness, weight-sync s and bytes, held-out reward, then the
# projection. Its jobs' Ray dirs are under $raydir, so the cleanup finds what a timeout leaves.
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
    cleanup "$raydir"
    echo "== async: exit $ASYNC_RC after $(($(date +%s) - t0))s (124/137: timed out)" | tee -a "$OUT/throughput.log"
  fi
fi

echo "gpu_check: total $(($(date +%s) - START))s"
((ASYNC_RC != 0)) && echo "async: FAIL (exit $ASYNC_RC; see throughput.log)"
((RC != 0 || ASYNC_RC != 0)) && exit 1
exit 0
