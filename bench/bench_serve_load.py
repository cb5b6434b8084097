"""`fidelity serve` under load, before vs after the round-robin scheduler, in one run.

"before" is the server of an earlier commit (default: the last one where requests ran
strictly one at a time under a lock, with no cancellation), checked out into a temporary
git worktree and run with this venv's Python; "after" is the working tree. For each:

  load        N concurrent chat requests (a ~500-token user message, 8 new tokens,
              greedy), N = 16 and 64: wall time, requests/s, p50 / p99 latency, errors;
  mixed       one long completion (400 tokens) and, 0.2 s later, 8 short chats (a
              40-token message, 8 new tokens): the short ones' latency;
  abandoned   a client asks for a long completion and gives up after 0.3 s, then asks
              for 2 tokens: the retry's latency (before: it waited behind its own
              abandoned twin).

Writes bench/results/serve_load.md.   python bench/bench_serve_load.py [--before REV]
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from needle.words import ADJECTIVES, NOUNS  # noqa: E402
from needle_util import free_port, wait_healthy  # noqa: E402
from reference_model.tokenizer import load_tokenizer  # noqa: E402

BEFORE = "e9540e5"          # last commit with the one-at-a-time server
LONG_TOKENS = 400


def message(tok, n_tokens: int, seed: int) -> str:
    rng = random.Random(seed)
    words: list[str] = []
    while tok.count(" ".join(words)) < n_tokens:
        words += [rng.choice(ADJECTIVES), rng.choice(NOUNS)]
    return " ".join(words)


class Server:
    def __init__(self, tree: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(tree), "DSV4_FIDELITY_ARM": "golden"}
        self.p = subprocess.Popen([sys.executable, "-m", "fidelity.cli", "serve", "--port", str(self.port)],
                                  cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        wait_healthy(self.url, self.p)
        self.model = httpx.get(self.url + "/v1/models").json()["data"][0]["id"]

    def close(self):
        self.p.terminate()
        self.p.wait(20)
        self.p.stderr.close()


async def load(srv: Server, msgs: list[str]) -> dict:
    lat, errors = [], 0

    async def one(client, m):
        nonlocal errors
        t = time.perf_counter()
        r = await client.post("/v1/chat/completions", json={
            "model": srv.model, "messages": [{"role": "user", "content": m}], "max_tokens": 8,
            "temperature": 0})
        if r.status_code != 200:
            errors += 1
        lat.append(time.perf_counter() - t)

    limits = httpx.Limits(max_connections=len(msgs), max_keepalive_connections=len(msgs))
    async with httpx.AsyncClient(base_url=srv.url, timeout=3600, limits=limits) as c:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(c, m) for m in msgs))
        wall = time.perf_counter() - t0
    q = statistics.quantiles(lat, n=100)
    return {"n": len(msgs), "wall_s": wall, "req_per_s": len(msgs) / wall, "p50_s": q[49],
            "p99_s": q[98], "min_s": min(lat), "errors": errors}


async def mixed(srv: Server, msgs: list[str]) -> dict:
    lat = []

    async def short(client, m):
        t = time.perf_counter()
        r = await client.post("/v1/chat/completions", json={
            "model": srv.model, "messages": [{"role": "user", "content": m}], "max_tokens": 8,
            "temperature": 0})
        r.raise_for_status()
        lat.append(time.perf_counter() - t)

    async with httpx.AsyncClient(base_url=srv.url, timeout=3600) as c:
        t = time.perf_counter()
        long = asyncio.create_task(c.post("/v1/completions", json={
            "model": srv.model, "prompt": "The river", "max_tokens": LONG_TOKENS, "temperature": 0}))
        await asyncio.sleep(0.2)
        await asyncio.gather(*(short(c, m) for m in msgs))
        await long
        long_s = time.perf_counter() - t
    return {"short_p50_s": statistics.median(lat), "short_max_s": max(lat), "long_s": long_s}


def abandoned(srv: Server) -> dict:
    body = {"model": srv.model, "prompt": "The river", "max_tokens": LONG_TOKENS, "temperature": 0}
    t = time.perf_counter()
    full = httpx.post(srv.url + "/v1/completions", json=body, timeout=3600).json()
    full_s = time.perf_counter() - t
    try:
        httpx.post(srv.url + "/v1/completions", json=body, timeout=0.3)
    except httpx.ReadTimeout:
        pass
    t = time.perf_counter()
    httpx.post(srv.url + "/v1/completions", json={**body, "max_tokens": 2}, timeout=3600)
    return {"long_tokens": full["usage"]["completion_tokens"], "long_s": full_s,
            "retry_s": time.perf_counter() - t}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", default=BEFORE, help=f"git revision of the 'before' server ({BEFORE})")
    ap.add_argument("--sizes", default="16,64")
    a = ap.parse_args()
    tok = load_tokenizer(ROOT / "models" / "tiny-needle" / "tokenizer.json")
    sizes = [int(s) for s in a.sizes.split(",")]
    msgs = {n: [message(tok, 500, 1000 * n + i) for i in range(n)] for n in sizes}
    shorts = [message(tok, 40, 7 + i) for i in range(8)]
    rows, aband, mix = [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(wt), a.before], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            for label, tree in (("before", wt), ("after", ROOT)):
                srv = Server(tree)
                try:
                    for n in sizes:
                        r = asyncio.run(load(srv, msgs[n]))
                        rows.append({"server": label, **r})
                        print(label, r, flush=True)
                    mix.append({"server": label, **asyncio.run(mixed(srv, shorts))})
                    print(label, mix[-1], flush=True)
                    aband.append({"server": label, **abandoned(srv)})
                    print(label, aband[-1], flush=True)
                finally:
                    srv.close()
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(wt)], cwd=ROOT, check=False)
    md = ["# `fidelity serve` under load: before vs after the scheduler", "",
          f"Measured {time.strftime('%Y-%m-%d %H:%M')} on this machine (2 cores; the server and "
          f"this client share them). Golden arm, trained tiny model. 'before' = commit "
          f"{a.before} (one generation at a time under a lock, no cancellation); 'after' = "
          "this tree (turns of up to 1 s of compute, cancellation on disconnect, bounded queue).", "",
          "#### Concurrent chats (~500-token message, 8 new tokens, greedy)", "",
          "| server | concurrent | wall s | req/s | p50 s | p99 s | fastest s | errors |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    md += [f"| {r['server']} | {r['n']} | {r['wall_s']:.2f} | {r['req_per_s']:.2f} | {r['p50_s']:.2f} | "
           f"{r['p99_s']:.2f} | {r['min_s']:.2f} | {r['errors']} |" for r in rows]
    md += ["", "#### One long completion (400 tokens) and 8 short chats arriving 0.2 s later", "",
           "| server | short p50 s | short max s | long request s |", "|---|---:|---:|---:|"]
    md += [f"| {r['server']} | {r['short_p50_s']:.2f} | {r['short_max_s']:.2f} | {r['long_s']:.2f} |"
           for r in mix]
    md += ["", "#### A client gives up on a long completion after 0.3 s, then retries with 2 tokens", "",
           "| server | long request: tokens | long request: s | retry latency s |", "|---|---:|---:|---:|"]
    md += [f"| {r['server']} | {r['long_tokens']} | {r['long_s']:.2f} | {r['retry_s']:.2f} |" for r in aband]
    md += ["", "Throughput cannot rise: one model computes, requests are not batched (docs/serve.md "
           "says why). What changes is who waits: short requests no longer queue behind a long "
           "one, and an abandoned request stops costing anything within one step."]
    out = ROOT / "bench" / "results" / "serve_load.md"
    out.write_text("\n".join(md) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
