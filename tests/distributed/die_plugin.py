"""A toggle that kills the process running it on rank 1 (tests/test_distributed.py): a
pipeline stage dying mid-run, at its first layer."""
import os

from kernel_toggles import toggle


@toggle("rank1_dies", kernel="rms_norm", category="known-bug", description="exits rank 1 mid-run")
def _(g, x, w, eps, round_out=True):
    if os.environ.get("RANK") == "1":
        os._exit(3)
    return g.rms_norm(x, w, eps, round_out)
