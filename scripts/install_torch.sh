#!/usr/bin/env bash
# Install torch before the package so pip never resolves a bare `torch` to the multi-GB
# CUDA build on a CPU-only machine. With a GPU (nvidia-smi works) the default PyPI build
# (CUDA) is the right one. Skips when the venv already has a working torch.
set -euo pipefail
pip="$1"; python="$2"
if "$python" -c "import torch" 2>/dev/null; then
    exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$pip" install -q "torch>=2.10"
else
    "$pip" install -q "torch==2.13.0"   # the CPU wheel (found on local disk on our machines)
fi
