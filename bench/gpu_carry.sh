#!/usr/bin/env bash
# Builds what a GPU device machine lacks of the job's worker-side packages, as ONE archive that the device run
# unpacks into a --target style site dir (PYTHONPATH): .gpucarry/site-cp312.tar.xz for the device's Python 3.12.
#   bench/gpu_carry.sh [3.12|3.11] [OUTDIR]
# 3.11 builds the same layout for this machine's .venv (a local rehearsal of the device run: see bench/gpu_device_run.sh).
#
# Carried (versions from constraints/cpu.txt): ray (stripped, below), megatron-core, pydantic (+ pydantic-core,
# annotated-types, typing-inspection, typing-extensions >= 4.16 for pydantic 2.14), jsonschema (+ referencing,
# rpds-py, jsonschema-specifications; Ray needs it). The device image already holds torch, transformers, numpy,
# safetensors, aiohttp & co, grpcio, protobuf, msgpack, click, filelock, pyyaml, requests, psutil, prometheus-client
# (/work/.library/device/KINDS.md). vLLM (hundreds of MB) cannot travel: the checks run with the hf/megatron
# generation engines there.
#
# Ray 2.60's wheel is 79 MB (201 MB unpacked). Dropped here, none of it used by `ray.init` on one node, actors,
# placement groups, ray.get/put and the runtime-env agent: the Java jars, the dashboard's web client build, the
# libraries (rllib, data, serve, train, tune, llm, air, workflow), tests, Cython headers; the three native files
# (_raylet.so, raylet, gcs_server: 117 MB) lose their debug symbols (strip --strip-unneeded; dynamic symbols stay).
# Result: ~21 MiB of .tar.xz (124 MB unpacked), built in ~75 s on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.." || exit 2
PYV=${1:-3.12}
OUTDIR=${2:-.gpucarry}
TAG=cp${PYV/./}
WORK=${GPU_CARRY_WORK:-/tmp/gpucarry-build}/$TAG
mkdir -p "$WORK/dl" "$OUTDIR"
rm -rf "$WORK/site"

pin() { grep -iE "^$1==" constraints/cpu.txt | head -1; }
PKGS=()
for p in ray megatron-core pydantic pydantic_core annotated-types typing-inspection typing_extensions jsonschema \
         jsonschema-specifications referencing rpds-py; do
  v=$(pin "$p")
  [[ -n $v ]] || { echo "no pin for $p in constraints/cpu.txt" >&2; exit 1; }
  PKGS+=("$v")
done
PLAT=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp "${PLAT[@]}" \
  -d "$WORK/dl" "${PKGS[@]}" 2>&1 | grep -v "is ignored: it is neither" || true
python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: --python-version "$PYV" \
  --implementation cp "${PLAT[@]}" --target "$WORK/site" "$WORK"/dl/*.whl

S=$WORK/site
R=$S/ray
rm -rf "$R"/{jars,rllib,data,serve,train,tune,llm,air,workflow,dashboard/client} "$R"/_raylet.pxd "$R"/includes \
       "$R"/_raylet.pyi "$R"/setup-dev.py "$S"/bin
find "$S" -type d \( -name tests -o -name __pycache__ \) -prune -exec rm -rf {} +
for f in "$R/_raylet.so" "$R/core/src/ray/raylet/raylet" "$R/core/src/ray/gcs/gcs_server"; do
  strip --strip-unneeded "$f"
done
du -sh "$S"
OUTF=$OUTDIR/site-$TAG.tar.xz
python3 - "$S" "$OUTF" <<'EOF'
import lzma, os, sys, tarfile
src, dst = sys.argv[1:]
with tarfile.open(dst + ".tmp", "w:xz", preset=9) as tf:
    for name in sorted(os.listdir(src)):
        tf.add(os.path.join(src, name), arcname=name)
os.replace(dst + ".tmp", dst)
print(f"{dst}: {os.path.getsize(dst) / 2**20:.1f} MiB")
EOF
