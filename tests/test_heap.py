"""reference_model.heap: after keep_freed_memory, a large temporary freed and allocated
again reuses its pages (no page faults), where glibc's default unmaps and faults it in anew.
Counted in page faults (getrusage), not time."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHILD = r"""
import resource, sys, torch
if sys.argv[1] == "keep":
    from reference_model.heap import keep_freed_memory
    assert keep_freed_memory()
def faults_of_a_fresh_64mb_tensor():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t = torch.ones(1 << 23, dtype=torch.float64)      # 64 MB, every page touched
    del t
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults_of_a_fresh_64mb_tensor()                      # the heap grows once
print(faults_of_a_fresh_64mb_tensor())
"""


def faults(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or not platform.libc_ver()[0] == "glibc",
                    reason="glibc's malloc only")
def test_a_freed_temporary_is_not_faulted_in_again():
    pages = (1 << 26) // 4096
    assert faults("default") > pages // 2          # glibc's default: mapped anew each time
    assert faults("keep") < pages // 20            # kept: the same pages again
