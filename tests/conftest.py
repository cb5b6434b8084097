"""Test-session settings: one torch thread per process. The suite runs in several pytest
workers (and spawns server subprocesses) on a 2-core machine, where OpenMP threads
spinning against each other made tiny-model forwards 50x slower."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")     # inherited by subprocesses

import torch  # noqa: E402

torch.set_num_threads(1)
