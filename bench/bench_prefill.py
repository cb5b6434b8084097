"""Prefill time and peak RSS of the golden model on the tiny preset at 1K-64K tokens, and
of transformers' eager DeepseekV4 on the same weights at the lengths it can do.

Each point runs in a fresh subprocess so peak RSS (VmHWM) is that run's alone.
Usage: python bench/bench_prefill.py [--lengths 1024,8192,32768,65536] [--hf-lengths 1024,8192]
Writes bench/results/prefill.md."""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, torch
sys.path.insert(0, {root!r})
from reference_model import Model, Numerics, random_weights, tiny
kind, L = sys.argv[1], int(sys.argv[2])
cfg = tiny()
w = random_weights(cfg, 0)
toks = torch.randint(2, cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(1))
def hwm():
    for line in open('/proc/self/status'):
        if line.startswith('VmHWM'):
            return int(line.split()[1]) / 1024
base = hwm()
with torch.inference_mode():
    if kind.startswith('golden'):
        prof = kind.split(':')[1]
        m = Model(w, Numerics(prof))
        t0 = time.perf_counter(); m.extend(toks, logits='last'); dt = time.perf_counter() - t0
    else:
        sys.path.insert(0, {tests!r})
        from hf_oracle import build_hf_model
        hf = build_hf_model(cfg, w)
        t0 = time.perf_counter(); hf(input_ids=toks[None], use_cache=False, logits_to_keep=1); dt = time.perf_counter() - t0
print(json.dumps({{"kind": kind, "length": L, "seconds": dt, "peak_rss_mb": hwm(), "rss_before_mb": base}}))
"""


def run_point(kind: str, length: int, timeout: int) -> dict:
    code = CHILD.format(root=str(ROOT), tests=str(ROOT / "tests"))
    try:
        out = subprocess.run([sys.executable, "-c", code, kind, str(length)], capture_output=True,
                             text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"kind": kind, "length": length, "error": f"timeout {timeout}s"}
    if out.returncode != 0:
        return {"kind": kind, "length": length, "error": out.stderr.strip().splitlines()[-1][:120]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="1024,8192,32768,65536")
    ap.add_argument("--hf-lengths", default="1024,8192")
    ap.add_argument("--timeout", type=int, default=3600)
    a = ap.parse_args()
    store = ROOT / "bench" / "results" / "prefill.json"
    points = {(r["kind"], r["length"]): r for r in (json.loads(store.read_text()) if store.exists() else [])}
    ints = lambda text: [int(x) for x in text.split(",") if x.strip()]   # noqa: E731
    todo = [(k, L) for L in ints(a.lengths) for k in ("golden:reference", "golden:exact")]
    todo += [("transformers:eager-fp32", L) for L in ints(a.hf_lengths)]
    for kind, L in todo:
        r = run_point(kind, L, a.timeout)
        print(r, flush=True)
        points[(kind, L)] = r
        store.write_text(json.dumps(sorted(points.values(), key=lambda r: (r["kind"], r["length"])), indent=1))
    lines = ["# Prefill benchmark (tiny preset, random weights)", "",
             f"Machine: {platform.machine()}, 2 cores, 1 torch thread, python {platform.python_version()}. "
             "One fresh process per point; peak RSS = VmHWM (includes ~0.3 GB of python + torch). "
             "Points are kept in prefill.json; a run updates the points it measures.", "",
             "| model | tokens | seconds | peak RSS (MB) |", "|---|---:|---:|---:|"]
    for r in sorted(points.values(), key=lambda r: (r["length"], r["kind"])):
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['length']} | {r['error']} | |")
        else:
            lines.append(f"| {r['kind']} | {r['length']} | {r['seconds']:.2f} | {r['peak_rss_mb']:.0f} |")
    out = ROOT / "bench" / "results" / "prefill.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
