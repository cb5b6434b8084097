"""`make bench`: every benchmark in bench/, one after another (each writes its table to
bench/results/), then the README's bench sections are regenerated. Slow: the streaming
and before/after benchmarks take minutes each on a 2-core machine. `--only NAME,...`
runs a subset (names as in BENCHES)."""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHES = ["bench_prefill", "bench_lockstep", "bench_streaming", "bench_seam", "bench_http",
           "bench_dequant", "bench_streamed_ab", "bench_plan_memory", "bench_kld_client",
           "bench_serve_load", "bench_prefix_cache", "bench_schedule_overhead", "bench_lm_eval",
           "bench_chunked_head", "bench_needle_batch", "bench_reference_speed",
           "gpu_check"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=None)
    a = ap.parse_args()
    names = a.only.split(",") if a.only else BENCHES
    unknown = [n for n in names if n not in BENCHES]
    if unknown:
        print(f"unknown benchmark(s) {unknown}; valid: {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    failed = []
    for n in names:
        t = time.time()
        print(f"== {n}", flush=True)
        rc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{n}.py")], cwd=ROOT).returncode
        print(f"== {n}: exit {rc} in {time.time() - t:.0f} s", flush=True)
        if rc:
            failed.append(n)
    subprocess.run([sys.executable, str(ROOT / "scripts" / "update_readme.py")], cwd=ROOT, check=True)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
