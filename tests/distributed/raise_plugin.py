"""A toggle whose kernel raises on rank 1 only (tests/test_distributed_commands.py): an
exception on a worker rank must come back to rank 0 as one error naming that rank."""
import os

from kernel_toggles import toggle


@toggle("rank1_raises", kernel="rms_norm", category="known-bug", description="raises on rank 1")
def _(g, x, w, eps, round_out=True):
    if os.environ.get("RANK") == "1":
        raise RuntimeError("planted failure on rank 1")
    return g.rms_norm(x, w, eps, round_out)
