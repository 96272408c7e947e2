#!/usr/bin/env bash
# The GPU checks on a machine without vLLM, Ray or megatron-core installed (this workplace's GPU device machine):
# unpacks the carried packages (bench/gpu_carry.sh builds .gpucarry/site-cp312.tar.xz: a stripped Ray 2.60,
# megatron-core, pydantic, jsonschema and their few missing needs) into a site dir, puts it and workers/ on
# PYTHONPATH (Ray's worker processes inherit it), and runs bench/gpu_check.sh --rollout hf with the rest of the
# arguments. Nothing is installed into the machine's Python.
#
#   bench/gpu_device_run.sh                      on the device: PYTHON=python3, OUT=$OUT, budget 300 s
# One device call, at most 7.5 minutes of device time with the machine's start (~90-120 s): the checks get 300 s
# (`bench/gpu_check.sh --dry-run --rollout hf` prints each one's limit), the call's timeout_s is 540:
#   bench/gpu_carry.sh   (here, once: .gpucarry/site-cp312.tar.xz, ~21 MiB)
#   run(command="bash bench/gpu_device_run.sh", carry=[".gpucarry"], timeout_s=540), then give_back
# A rehearsal here, on the CPU (Python 3.11: the same layout built for cp311; a venv that holds only what the
# device image holds, bench/device_sim/make_venv.py):
#   bench/gpu_carry.sh 3.11 /tmp/gcsim
#   mkdir -p /tmp/gcsim/site; tar xJf /tmp/gcsim/site-cp311.tar.xz -C /tmp/gcsim/site
#   .venv/bin/python bench/device_sim/make_venv.py /work/.library/device/KINDS.md /tmp/gcsim/site /tmp/gcsim/venv
#   GPU_CARRY=/tmp/gcsim/site-cp311.tar.xz GPU_SITE=/tmp/gcsim/site PYTHON=/tmp/gcsim/venv/bin/python \
#     HYBRIDFLOW_MODEL_CACHE=/tmp/gcsim/models OUT=/tmp/gcsim/out bench/gpu_device_run.sh --cpu-smoke
# Environment: GPU_CARRY (the archive), GPU_SITE (where it is unpacked, default /tmp/site), PYTHON (default python3),
#   GPU_CHECK_BUDGET_S (default 300; --cpu-smoke: gpu_check.sh's), and gpu_check.sh's.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
CARRY=${GPU_CARRY:-.gpucarry/site-cp312.tar.xz}
SITE=${GPU_SITE:-/tmp/site}
PY=${PYTHON:-python3}
t0=$(date +%s)
mkdir -p "$SITE"
"$PY" - "$CARRY" "$SITE" <<'EOF' || exit 3
import sys, tarfile
with tarfile.open(sys.argv[1]) as tf:
    tf.extractall(sys.argv[2], filter="fully_trusted")  # executables (raylet, gcs_server) keep their modes
EOF
echo "gpu_device_run: $CARRY unpacked into $SITE in $(($(date +%s) - t0)) s;" \
     "$("$PY" --version 2>&1) at $(command -v "$PY")"
export PYTHONPATH=$SITE:$PWD/workers${PYTHONPATH:+:$PYTHONPATH}
export PYTHON=$PY
[[ " $* " == *" --cpu-smoke "* ]] || export GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-300}  # the rehearsal: its own
exec bash bench/gpu_check.sh "$@" --rollout hf
