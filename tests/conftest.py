"""Test-session settings: one torch thread per process. The suite runs in several pytest
workers (and spawns server subprocesses) on a 2-core machine, where OpenMP threads
spinning against each other made tiny-model forwards 50x slower.

Fixtures shared by the server tests: `url`, a real `fidelity serve` process serving one
golden arm (one per test module that asks; a module's own `url` fixture overrides it),
and `http`, an httpx client on it."""
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")     # inherited by subprocesses

import httpx  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from needle_util import served  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def url():
    with served("golden") as (u,):
        yield u


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c
