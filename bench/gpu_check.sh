#!/usr/bin/env bash
# The one command that proves the golden on a CUDA machine: sets up (the Makefile installs
# the CUDA build of torch where a GPU exists), then runs bench/gpu_check.py. Without CUDA
# it skips cleanly (exit 0). Results: bench/results/gpu_check.md.
set -euo pipefail
cd "$(dirname "$0")/.."
make setup
.venv/bin/python bench/gpu_check.py "$@"
