"""Prefill speed of the golden's `reference` and `exact` profiles against transformers'
eager DeepseekV4 on the same weights (tiny preset, random weights) at 4096 tokens, with 1
and 2 torch threads, side by side in one run; optionally also the golden of an older
checkout ("before", e.g. `git worktree add /tmp/before 3d29e61`).

Each point runs in a fresh subprocess (torch.set_num_threads and OMP_NUM_THREADS set to the
point's thread count; "2p" = 2 threads with OMP_WAIT_POLICY=PASSIVE, so OpenMP threads
waiting at a barrier sleep instead of spinning, which matters when other jobs share the cores) and times one `extend` from an empty state, as bench_prefill.py does
(the golden's first call includes converting the resident weights; transformers' includes
its own first-call work). Points run round-robin, `--repeats` times each, so slow periods of
a shared machine hit every kind alike; the table gives min and median. Golden points also
print a hash of their last-position logits, so the before and after rows show whether the
logits are bit-identical.

Usage: python bench/bench_reference_speed.py [--before /tmp/before] [--repeats 3]
Writes bench/results/reference_speed.json and the measured section of
bench/results/reference_speed.md (between the BENCH markers)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import hashlib, json, sys, time, torch
root, kind, L, threads = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
sys.path.insert(0, root)
torch.set_num_threads(threads)
from reference_model import Model, Numerics, random_weights, tiny
cfg = tiny()
w = random_weights(cfg, 0)
toks = torch.randint(2, cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(1))
digest = None
with torch.inference_mode():
    if kind.startswith('golden'):
        m = Model(w, Numerics(kind.split(':')[1]))
        c0, t0 = time.process_time(), time.perf_counter()
        out, _ = m.extend(toks, logits='last')
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        digest = hashlib.sha256(out.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
    else:
        sys.path.insert(0, {tests!r})
        from hf_oracle import build_hf_model
        hf = build_hf_model(cfg, w)
        c0, t0 = time.process_time(), time.perf_counter()
        hf(input_ids=toks[None], use_cache=False, logits_to_keep=1)
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({{"seconds": dt, "cpu_seconds": cpu, "logits_sha": digest}}))
"""


PROFILE_CHILD = r"""
import collections, functools, json, sys, time, torch
root, prof, L = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, root)
torch.set_num_threads(1)
from reference_model import Model, Numerics, random_weights, tiny
from reference_model import model as M, numerics as N, primitives as P, quant as Q
excl, calls, stack = collections.Counter(), collections.Counter(), []

def wrap(owner, name, label):
    f = getattr(owner, name)
    @functools.wraps(f)
    def g(*a, **k):
        t0 = time.process_time(); stack.append(0.0)
        try:
            return f(*a, **k)
        finally:
            dt = time.process_time() - t0; inner = stack.pop()
            excl[label] += dt - inner; calls[label] += 1
            if stack:
                stack[-1] += dt
    setattr(owner, name, g)

for k in list(N.KERNELS) + ["hc_collapse", "rs", "r32", "c"]:
    if hasattr(N.Numerics, k):
        wrap(N.Numerics, k, "Numerics." + k)
for k in ("fp8_qdq", "fp4_qdq"):
    wrap(Q, k, "quant." + k)
import importlib
def own(module, cls, names):
    try:
        owner = importlib.import_module("reference_model." + module)
    except ImportError:                  # an older tree: the code lived elsewhere
        return
    owner = getattr(owner, cls) if cls else owner
    for k in names:
        if k in vars(owner):
            wrap(owner, k, f"{cls or module}.{k} (own code)")
own("model", "Model", ("_block", "_attention", "_attn_indices", "_compress", "_indexer", "_moe",
                       "block", "layer", "embed", "head"))
own("attention", "Attention", ("__call__", "indices"))
own("attention_v4", "V4Attention", ("_compress", "_indexer"))
own("moe", None, ("moe", "moe_experts"))
if getattr(M, "moe_experts", None) and M.moe_experts.__module__ == M.__name__:   # an older tree
    wrap(M, "moe_experts", "model.moe_experts (own code)")
cfg = tiny()
w = random_weights(cfg, 0)
toks = torch.randint(2, cfg.vocab_size, (L,), generator=torch.Generator().manual_seed(1))
with torch.inference_mode():
    m = Model(w, Numerics(prof))
    m.extend(toks[:64])                       # resident weights converted before the profile
    excl.clear(); calls.clear()
    t0 = time.process_time(); m.extend(toks); total = time.process_time() - t0
    kern = [[k, calls[k], v] for k, v in excl.most_common()]
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CPU]) as p:
        m.extend(toks)
    ops = sorted(p.key_averages(), key=lambda e: -e.self_cpu_time_total)
    op_total = sum(e.self_cpu_time_total for e in ops) / 1e6
    ops = [[e.key, e.count, e.self_cpu_time_total / 1e6] for e in ops[:14]]
print(json.dumps({"total": total, "kernels": kern, "op_total": op_total, "ops": ops}))
"""


def run_profile(root: Path, prof: str, length: int, timeout: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", PROFILE_CHILD, str(root), prof, str(length)],
                         capture_output=True, text=True, timeout=timeout, env=env, cwd=str(root))
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1])
    return json.loads(out.stdout.strip().splitlines()[-1])


def profile_text(profs: dict, length: int, meta: dict) -> str:
    """profs: version -> profile dict (per-kernel exclusive CPU time, top ops)."""
    vers = [v for v in ("before", "after") if v in profs]
    lines = [f"Reference profile, {length}-token prefill from an empty state, tiny preset, random "
             f"weights, 1 thread, after a 64-token warm-up (so resident weights are already "
             f"converted); {meta['machine']}, torch {meta['torch']}, load average "
             f"{meta['load_before']} at the start. Exclusive CPU time (process time) per "
             f"`Numerics` kernel and per model-side helper (its own code, kernels excluded), "
             f"from wrappers around each; the wrappers add a little to the total.", ""]
    head = "| part | " + " | ".join(f"{v} calls | {v} s | {v} %" for v in vers) + " |"
    lines += [head, "|---|" + "---:|---:|---:|" * len(vers)]
    names = []
    for v in vers:
        for k, _, _ in profs[v]["kernels"]:
            if k not in names:
                names.append(k)
    rows = []
    for k in names:
        cells, key = [], 0.0
        for v in vers:
            d = {n: (c, t) for n, c, t in profs[v]["kernels"]}
            c, t = d.get(k, (0, 0.0))
            key = max(key, t)
            cells.append(f"{c} | {t:.3f} | {100 * t / profs[v]['total']:.1f}")
        if key >= 0.005:
            rows.append((key, f"| {k} | " + " | ".join(cells) + " |"))
    lines += [r for _, r in sorted(rows, reverse=True)]
    lines.append("| **total** | " + " | ".join(f" | **{profs[v]['total']:.2f}** | 100" for v in vers) + " |")
    for v in vers:
        lines += ["", f"Top aten ops by self CPU time, {v} (torch.profiler, a second pass; "
                      f"{profs[v]['op_total']:.2f} s in all):", "",
                  "| op | calls | self s | % |", "|---|---:|---:|---:|"]
        lines += [f"| {k} | {c} | {t:.3f} | {100 * t / profs[v]['op_total']:.1f} |" for k, c, t in profs[v]["ops"]]
    return "\n".join(lines)


def write_section(out: Path, marker: str, text: str) -> None:
    begin, end = f"<!-- {marker}:BEGIN (bench/bench_reference_speed.py) -->", f"<!-- {marker}:END -->"
    doc = out.read_text() if out.exists() else "# Reference profile speed\n"
    if begin not in doc:
        doc += f"\n{begin}\n{end}\n"
    head, rest = doc.split(begin, 1)
    tail = rest.split(end, 1)[1] if end in rest else ""
    out.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


def run_point(root: Path, kind: str, length: int, threads: str, timeout: int) -> dict:
    """threads: "1", "2", ... or "2p" (2 threads, OMP_WAIT_POLICY=PASSIVE: idle OpenMP
    threads sleep instead of spinning)."""
    code = CHILD.format(tests=str(ROOT / "tests"))
    n = threads.rstrip("p")
    env = dict(os.environ, OMP_NUM_THREADS=n, MKL_NUM_THREADS=n)
    if threads.endswith("p"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    threads = n
    try:
        out = subprocess.run([sys.executable, "-c", code, str(root), kind, str(length), str(threads)],
                             capture_output=True, text=True, timeout=timeout, env=env, cwd=str(root))
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout}s"}
    if out.returncode != 0:
        return {"error": (out.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def summarise(points: list[dict]) -> dict:
    """(kind, version, threads) -> {min, median, n, sha}."""
    groups: dict = {}
    for p in points:
        if "seconds" in p:
            groups.setdefault((p["kind"], p["version"], p["threads"]), []).append(p)
    out = {}
    for key, ps in groups.items():
        secs = sorted(p["seconds"] for p in ps)
        cpu = sorted(p["cpu_seconds"] for p in ps)
        shas = sorted({p.get("logits_sha") for p in ps if p.get("logits_sha")})
        out[key] = {"min": secs[0], "median": statistics.median(secs), "n": len(secs), "sha": shas,
                    "cpu_min": cpu[0], "cpu_median": statistics.median(cpu)}
    return out


def lab(t: str) -> str:
    return f"{t[:-1]}, passive wait" if t.endswith("p") else t


def table(points: list[dict], meta: dict) -> str:
    s = summarise(points)
    threads = sorted({k[2] for k in s})
    lines = [f"Machine: {meta['machine']}, {meta['cpus']} cores shared with other jobs (load "
             f"average {meta['load_before']} before, {meta['load_after']} after), torch "
             f"{meta['torch']}, python {meta['python']}. {meta['length']} tokens, tiny preset, "
             f"random weights (seed 0). Fresh process per point, points round-robin, "
             f"{meta['repeats']} repeats; wall {meta['wall_s']:.0f} s.", "",
             "Wall seconds decide the ratios; CPU seconds (process time, all threads) are given "
             "because on a shared machine they move less with other jobs' load.", "",
             "| threads | model | version | wall min s | wall median s | CPU min s | runs | "
             "last-position logits sha |", "|---:|---|---|---:|---:|---:|---:|---|"]
    for t in threads:
        for (kind, ver, tt), v in sorted(s.items(), key=lambda kv: (kv[0][0], kv[0][1] != "after")):
            if tt == t:
                lines.append(f"| {lab(t)} | {kind} | {ver} | {v['min']:.2f} | {v['median']:.2f} | "
                             f"{v['cpu_min']:.2f} | {v['n']} | {', '.join(v['sha']) or '-'} |")
    lines += ["", "Ratios (transformers eager time / golden time; before / after for the same profile):", "",
              "| threads | ratio | from min | from median |", "|---:|---|---:|---:|"]
    hf = "transformers:eager-fp32"
    for t in threads:
        def get(kind, ver):
            return s.get((kind, ver, t))
        for prof in ("reference", "exact"):
            for ver in ("after", "before"):
                a, b = get(hf, "after"), get(f"golden:{prof}", ver)
                if a and b:
                    lines.append(f"| {lab(t)} | transformers / {prof} ({ver}) | {a['min'] / b['min']:.2f} | "
                                 f"{a['median'] / b['median']:.2f} |")
            a, b = get(f"golden:{prof}", "before"), get(f"golden:{prof}", "after")
            if a and b:
                same = "identical logits" if a["sha"] == b["sha"] and a["sha"] else "LOGITS DIFFER"
                lines.append(f"| {lab(t)} | {prof}: before / after ({same}) | {a['min'] / b['min']:.2f} | "
                             f"{a['median'] / b['median']:.2f} |")
    return "\n".join(lines)


def load_avg() -> str:
    try:
        return open("/proc/loadavg").read().split()[0]
    except OSError:
        return "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--threads", default="1,2,2p",
                    help="thread counts; 'Np' = N threads with OMP_WAIT_POLICY=PASSIVE")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--before", default=None, help="checkout of the older golden (its repo root)")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers (golden only)")
    ap.add_argument("--timeout", type=int, default=1800)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "reference_speed.md"))
    ap.add_argument("--profile", action="store_true",
                    help="instead: where the reference profile's time goes (per kernel, top ops), "
                         "after and --before, into the PROFILE section")
    a = ap.parse_args()
    import torch
    if a.profile:
        meta = {"machine": platform.machine(), "torch": torch.__version__, "load_before": load_avg()}
        roots = {"after": ROOT, **({"before": Path(a.before)} if a.before else {})}
        profs = {v: run_profile(r, "reference", a.length, a.timeout) for v, r in roots.items()}
        (ROOT / "bench" / "results" / "reference_speed_profile.json").write_text(json.dumps(profs, indent=1))
        text = profile_text(profs, a.length, meta)
        print(text)
        write_section(Path(a.out), "PROFILE", text)
        return
    kinds = [("golden:reference", "after", ROOT), ("golden:exact", "after", ROOT)]
    if not a.no_hf:
        kinds.append(("transformers:eager-fp32", "after", ROOT))
    if a.before:
        kinds += [("golden:reference", "before", Path(a.before)), ("golden:exact", "before", Path(a.before))]
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "python": platform.python_version(), "length": a.length, "repeats": a.repeats,
            "load_before": load_avg()}
    t_start = time.perf_counter()
    points = []
    for rep in range(a.repeats):
        for t in [x.strip() for x in a.threads.split(",") if x.strip()]:
            for kind, ver, root in kinds:
                r = run_point(root, kind, a.length, t, a.timeout)
                r.update(kind=kind, version=ver, threads=t, repeat=rep)
                print(json.dumps(r), flush=True)
                points.append(r)
    meta["wall_s"] = time.perf_counter() - t_start
    meta["load_after"] = load_avg()
    res = ROOT / "bench" / "results"
    (res / "reference_speed.json").write_text(json.dumps({"meta": meta, "points": points}, indent=1))
    text = table(points, meta)
    print(text)
    write_section(Path(a.out), "BENCH", text)


if __name__ == "__main__":
    main()
