"""`fidelity serve`'s prefix cache: latency of a 2K-token prompt that shares a 1.9K-token
prefix with a previous request, a cache hit vs a cold prefill, in one run.

One golden server (the working tree, default --page-size 64 and budget) and one started with
--no-prefix-cache. For each repetition: flush (POST /flush_cache), send request A (the
shared prefix + 100 tokens of its own), then time request B (the shared prefix + 100 other
tokens): a hit on ⌊1900/64⌋·64 = 1856 tokens. Cold: flush, time B. Baseline: B on the
server without a prefix cache (one-piece prefill). Every request asks 1 new token
(greedy, with its logprob); the three answers must be identical bit for bit.

Writes bench/results/prefix_cache.md.   python bench/bench_prefix_cache.py [--reps 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from needle_util import free_port, wait_healthy  # noqa: E402

PREFIX, TAIL = 1900, 100


class Server:
    def __init__(self, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "DSV4_FIDELITY_ARM": "golden"}
        self.p = subprocess.Popen([sys.executable, "-m", "fidelity.cli", "serve", "--port",
                                   str(self.port), *extra], cwd=ROOT, env=env,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_healthy(self.url, self.p)

    def ask(self, ids) -> tuple[float, dict]:
        t = time.perf_counter()
        r = httpx.post(self.url + "/v1/completions", json={
            "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": 1, "ignore_eos": True},
            timeout=3600)
        r.raise_for_status()
        return time.perf_counter() - t, r.json()

    def flush(self) -> None:
        httpx.post(self.url + "/flush_cache", timeout=60).raise_for_status()

    def close(self):
        self.p.terminate()
        self.p.wait(20)
        self.p.stderr.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    import random
    rng = random.Random(22)
    prefix = [rng.randrange(3, 500) for _ in range(PREFIX)]
    req_a = prefix + [rng.randrange(3, 500) for _ in range(TAIL)]
    req_b = prefix + [rng.randrange(3, 500) for _ in range(TAIL)]
    times = {"hit": [], "cold": [], "no cache": []}
    answers, cached = {}, {}
    srv = Server()
    try:
        srv.ask([1, 2, 3])                                  # warm up
        for _ in range(a.reps):
            srv.flush()
            srv.ask(req_a)
            dt, r = srv.ask(req_b)
            times["hit"].append(dt)
            answers["hit"], cached["hit"] = r["choices"][0]["logprobs"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
            srv.flush()
            dt, r = srv.ask(req_b)
            times["cold"].append(dt)
            answers["cold"], cached["cold"] = r["choices"][0]["logprobs"], r["usage"]["prompt_tokens_details"]["cached_tokens"]
        info = httpx.get(srv.url + "/get_server_info", timeout=30).json()["prefix_cache"]
    finally:
        srv.close()
    base = Server("--no-prefix-cache")
    try:
        base.ask([1, 2, 3])
        for _ in range(a.reps):
            dt, r = base.ask(req_b)
            times["no cache"].append(dt)
            answers["no cache"], cached["no cache"] = r["choices"][0]["logprobs"], 0
    finally:
        base.close()
    same = answers["hit"] == answers["cold"] == answers["no cache"]
    med = {k: statistics.median(v) for k, v in times.items()}
    print(med, cached, "identical:", same, flush=True)
    md = ["# `fidelity serve`: prefix-cache hit vs cold prefill", "",
          f"Measured {time.strftime('%Y-%m-%d %H:%M')} on this machine (2 cores; the server and "
          "this client share them). Golden arm, trained tiny model, default --page-size 64. "
          f"Request B = a {PREFIX}-token prefix shared with the previous request A + {TAIL} "
          f"tokens of its own ({PREFIX + TAIL} tokens), 1 new token (greedy, logprob). Median "
          f"of {a.reps} repetitions.", "",
          "| prefill of B | cached tokens | latency s | vs hit |", "|---|---:|---:|---:|"]
    for k, label in (("hit", "hit (after A; POST /flush_cache before A)"),
                     ("cold", "cold (after POST /flush_cache)"),
                     ("no cache", "server with --no-prefix-cache")):
        md.append(f"| {label} | {cached[k]} | {med[k]:.3f} | {med[k] / med['hit']:.1f}× |")
    md += ["", f"Hit vs cold: **{med['cold'] / med['hit']:.1f}× faster**. The three answers "
           f"(token and logprob) are {'identical bit for bit' if same else 'NOT identical'}. "
           "Cold with the cache prefills page by page to keep a snapshot at every page "
           f"boundary: {med['cold'] / med['no cache']:.2f}× the one-piece prefill of a server "
           f"without it. Cache after the run: {info['entries']} snapshots, "
           f"{info['bytes'] / 2**20:.1f} MiB (one page's snapshot: "
           f"{info['page_snapshot_bytes'] / 2**10:.0f} KiB)."]
    out = ROOT / "bench" / "results" / "prefix_cache.md"
    out.write_text("\n".join(md) + "\n")
    print(f"wrote {out}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
