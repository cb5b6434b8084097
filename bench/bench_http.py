"""HTTP client cost of the needle runner. Three measurements:

  overhead     the runner's client CPU per request (process_time of this process / N) and
               wall latency at concurrency 1, against an instant local stub server that
               runs in a child process (so its CPU is not counted);
  throughput   requests/s vs concurrency against the stub answering after a fixed delay
               (an idealised concurrent server: should scale as c / delay until the
               client saturates) and with no delay (client-bound);
  serve        `fidelity serve` (golden, tiny model, 1-token answers): latency and
               throughput at concurrency 1 and 4 -- one model computes, so
               concurrency only shares its steps (bench_serve_load.py measures that).

All traffic is loopback. Writes bench/results/http.md.

    python bench/bench_http.py [--requests 200] [--delay 0.05] [--no-serve]
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from needle.haystack import HaystackSpec, LocalCounter, PromptFormat, build_prompt  # noqa: E402
from infra.http import RetryPolicy  # noqa: E402
import needle.http as H  # noqa: E402
from needle.http import HttpRunner, RequestOptions  # noqa: E402
from reference_model.tokenizer import load_tokenizer  # noqa: E402

CHILD = """
import sys, time
from needle.stub import StubServer
s = StubServer(delay=float(sys.argv[1]), wrong_every=0).start()
print(s.port, flush=True)
sys.stdin.read()
"""


class Stub:
    """The stub server in a child process (stdin closed = stop)."""

    def __init__(self, delay: float):
        self.p = subprocess.Popen([sys.executable, "-c", CHILD, str(delay)], cwd=ROOT,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.url = f"http://127.0.0.1:{int(self.p.stdout.readline())}/v1"

    def close(self):
        self.p.stdin.close()
        self.p.wait(10)


async def _run(runner: HttpRunner, prompt, n: int) -> tuple[float, float, list[float]]:
    await runner.aopen()
    try:
        await asyncio.gather(*(runner.arun(prompt, i) for i in range(runner.concurrency)))  # warm
        c0, t0 = time.process_time(), time.perf_counter()
        res = await asyncio.gather(*(runner.arun(prompt, i) for i in range(n)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    finally:
        await runner.aclose()
    bad = [r for r in res if r.get("error")]
    if bad:
        raise RuntimeError(f"{len(bad)} failed requests: {bad[0]['error']}")
    return wall, cpu, [r["latency_s"] for r in res]


def measure(url: str, prompt, n: int, concurrency: int, api: str = "chat", model=None) -> dict:
    r = HttpRunner("bench", url, api=api, model=model, concurrency=concurrency,
                   options=RequestOptions(temperature=0.0, max_tokens=1),
                   policy=RetryPolicy(retries=0, timeout=600))
    wall, cpu, lat = asyncio.run(_run(r, prompt, n))
    return {"concurrency": concurrency, "requests": n, "req_per_s": n / wall,
            "client_cpu_ms": 1000 * cpu / n, "lat_median_ms": 1000 * statistics.median(lat),
            "lat_p90_ms": 1000 * sorted(lat)[int(0.9 * (len(lat) - 1))]}


def _table(rows: list[dict]) -> list[str]:
    cols = ["concurrency", "requests", "req_per_s", "client_cpu_ms", "lat_median_ms", "lat_p90_ms"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c])
                                     for c in cols) + " |")
    return out + [""]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--delay", type=float, default=0.05, help="stub answer delay (s)")
    ap.add_argument("--no-serve", action="store_true", help="skip the fidelity serve section")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "http.md"))
    a = ap.parse_args()

    tok = load_tokenizer()
    prompt = build_prompt(HaystackSpec(), PromptFormat(), LocalCounter(tok), 2048, 50, 1)
    md = ["# HTTP needle client: overhead and throughput", "",
          f"Measured {time.strftime('%Y-%m-%d %H:%M')} on this machine (2 cores, shared with other "
          "jobs: numbers are indicative). Loopback only. Chat requests with a 2048-token "
          "needle prompt (~7 KB of JSON), `max_tokens` 1. `client_cpu_ms` is this process's CPU "
          "per request (the stub runs in a child process).", ""]

    stub = Stub(0.0)
    try:
        over = measure(stub.url, prompt, a.requests, 1)
        md += ["## Client overhead (instant stub, concurrency 1)", "", *_table([over])]
        fast = [measure(stub.url, prompt, a.requests, c) for c in (1, 4, 16, 64)]
    finally:
        stub.close()
    stub = Stub(a.delay)
    try:
        slow = [measure(stub.url, prompt, min(a.requests, 40 * c), c) for c in (1, 2, 4, 8, 16, 32, 64)]
        shard, H.SHARD = H.SHARD, 10 ** 6                   # one httpx pool for everything
        try:
            single = [measure(stub.url, prompt, a.requests, c) for c in (16, 64)]
        finally:
            H.SHARD = shard
    finally:
        stub.close()
    md += [f"## Throughput vs concurrency, stub answering after {1000 * a.delay:.0f} ms", "",
           f"Ideal: concurrency / {a.delay} s. The runner spreads connections over httpx "
           f"clients of {H.SHARD} connections each.", "", *_table(slow),
           "Same, with a single httpx client for all connections (what the runner avoids):", "",
           *_table(single),
           "## Throughput vs concurrency, instant stub (client-bound)", "", *_table(fast)]

    if not a.no_serve:
        from needle_util import served
        short = build_prompt(HaystackSpec(), PromptFormat(), LocalCounter(tok), 260, 50, 1)
        with served("golden") as (url,):
            sv = [measure(url, short, 8, c) for c in (1, 4)]
        md += ["## `fidelity serve` (golden, tiny model, 260-token prompt, 1-token answer)", "",
               "One generation at a time on the server: concurrency queues requests, it does "
               "not add throughput; latency here is the model's prefill.", "", *_table(sv)]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
