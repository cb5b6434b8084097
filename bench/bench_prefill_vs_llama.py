"""The golden's prefill against llama.cpp's on the same model and the same ids (issue 62): a
4096-token prefill from an empty state on the widened tiny-needle-v2 (the checkpoint llama.cpp
is given, fidelity/llamacpp/prepare.py), one thread each, in interleaved rounds so a busy
period of a shared machine hits every kind alike.

- golden:reference / golden:exact: a fresh process per point (torch and OpenMP held to the
  point's threads) loads the checkpoint and times one `extend` of the ids (wall and CPU time).
- llama-server: the pinned build (`make llama-cpp`) on the F32 GGUF (FP8 weights dequantised
  exactly), `-t N`, one slot; per point one /completion of the same ids with the prompt cache
  off, timed by the server's own `timings.prompt_ms` (its prefill alone, no HTTP or sampling).

Usage: python bench/bench_prefill_vs_llama.py [--rounds 3] [--threads 1,2] [--tokens 4096]
       [--label after]   (points are appended to bench/results/prefill_vs_llama.json under the
       label, so a "before" run of an older checkout and an "after" run sit in one table)
Writes bench/results/prefill_vs_llama.md from every stored point."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.llamacpp.prepare import gguf  # noqa: E402
from fidelity.llamacpp.server import serving  # noqa: E402

MODEL = ROOT / "models" / "tiny-needle-v2"
RESULTS = ROOT / "bench" / "results" / "prefill_vs_llama.json"
REPORT = RESULTS.with_suffix(".md")

CHILD = r"""
import json, sys, time, torch
root, ck, profile, n, threads = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, root)
torch.set_num_threads(threads)
from reference_model import Model, Numerics
from reference_model.checkpoint_read import load_checkpoint
w = load_checkpoint(ck)
ids = torch.tensor(json.loads(sys.stdin.read()))
with torch.inference_mode():
    m = Model(w, Numerics(profile))
    c0, t0 = time.process_time(), time.perf_counter()
    m.extend(ids, logits='last')
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
print(json.dumps({"seconds": dt, "cpu_seconds": cpu}))
"""


def token_ids(n: int, vocab: int) -> list[int]:
    """The same `n` ids for every kind: seeded, past the special tokens."""
    import random
    rng = random.Random(1)
    return [rng.randrange(16, vocab) for _ in range(n)]


def golden_point(root: Path, ck: Path, profile: str, ids: list[int], threads: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), str(ck), profile, str(len(ids)), str(threads)],
                         input=json.dumps(ids), capture_output=True, text=True, env=env, timeout=3600)
    if out.returncode != 0:
        raise RuntimeError(f"golden:{profile} at {threads} threads failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def llama_point(url: str, ids: list[int]) -> dict:
    body = json.dumps({"prompt": ids, "n_predict": 1, "cache_prompt": False, "temperature": 0}).encode()
    req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        t = json.loads(r.read())["timings"]
    if t["prompt_n"] != len(ids):
        raise RuntimeError(f"llama-server prefilled {t['prompt_n']} of {len(ids)} tokens (prompt cache on?)")
    return {"seconds": t["prompt_ms"] / 1000.0}


def load_avg() -> float:
    return os.getloadavg()[0]


def measure(args) -> list[dict]:
    root = Path(args.root).resolve()
    ck, model = gguf(MODEL, "f32")
    vocab = json.loads((ck / "config.json").read_text())["vocab_size"]
    ids = token_ids(args.tokens, vocab)
    points = []
    for threads in [int(t) for t in args.threads.split(",")]:
        log = Path("/tmp") / f"bench-prefill-llama-t{threads}.log"
        with serving(model, log, ctx=args.tokens + 64, threads=threads) as url:
            llama_point(url, ids[:64])                            # the server's own warm-up
            for r in range(args.rounds):
                for kind in ("golden:reference", "llama-server", "golden:exact"):
                    la = load_avg()
                    p = (llama_point(url, ids) if kind == "llama-server"
                         else golden_point(root, ck, kind.split(":")[1], ids, threads))
                    p.update(kind=kind, threads=threads, round=r, load=round(la, 2), label=args.label,
                             tokens=args.tokens)
                    print(json.dumps(p), flush=True)
                    points.append(p)
    return points


def render(points: list[dict]) -> str:
    meta = f"{platform.machine()}, {os.cpu_count()} cores, python {platform.python_version()}"
    lines = ["# Golden prefill vs llama.cpp's (issue 62)", "",
             f"Machine: {meta}. Widened tiny-needle-v2 (head_dim 512), the same seeded ids for every kind, "
             "one fresh golden process per point (load + one `extend`; the time is the `extend` alone), "
             "llama-server b11434 on the F32 GGUF timed by its own `timings.prompt_ms`, prompt cache off. "
             "Kinds run interleaved within each round. Load = 1-minute load average at each point's start.", "",
             "| label | tokens | threads | kind | runs | min s | median s | max s | load (min-max) | median / llama-server |",
             "|---|---:|---:|---|---:|---:|---:|---:|---|---:|"]
    groups: dict = {}
    for p in points:
        groups.setdefault((p["label"], p["tokens"], p["threads"]), {}).setdefault(p["kind"], []).append(p)
    for (label, tokens, threads), kinds in sorted(groups.items()):
        llama = statistics.median(p["seconds"] for p in kinds.get("llama-server", [{"seconds": float("nan")}]))
        for kind, ps in sorted(kinds.items()):
            s = [p["seconds"] for p in ps]
            loads = [p["load"] for p in ps]
            lines.append(f"| {label} | {tokens} | {threads} | {kind} | {len(s)} | {min(s):.2f} | "
                         f"{statistics.median(s):.2f} | {max(s):.2f} | {min(loads):.2f}-{max(loads):.2f} | "
                         f"{statistics.median(s) / llama:.2f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", default="1")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--label", default="after")
    ap.add_argument("--root", default=str(ROOT), help="the checkout whose golden runs (e.g. a worktree of an older commit)")
    ap.add_argument("--render", action="store_true", help="only rewrite the table from the stored points")
    args = ap.parse_args()
    stored = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    if not args.render:
        t0 = time.time()
        new = measure(args)
        stored = [p for p in stored if p["label"] != args.label or p["tokens"] != args.tokens
                  or p["threads"] not in {n["threads"] for n in new}] + new
        RESULTS.write_text(json.dumps(stored, indent=1) + "\n")
        print(f"wall {time.time() - t0:.0f} s", file=sys.stderr)
    REPORT.write_text(render(stored))
    print(REPORT.read_text())


if __name__ == "__main__":
    main()
