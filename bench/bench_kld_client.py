"""Client cost of `fidelity kld` / `fidelity engines` (docs/research/engine-integration.md §1):

  parse     a 4096-token prompt scored with top-20 prompt logprobs, as SGLang's /generate
            and vLLM's /v1/completions return it (responses synthesised in each engine's
            documented shape): JSON decode + our parser, per position; then the bound
            computation per position, and the score store's write + read.
  launcher  what `fidelity engines run` adds to an arm beyond the engine's own start-up:
            readiness detection, the start-up probes (models, model info, version, server
            info), and stopping the process group; measured on `fidelity serve`.

Writes bench/results/kld_client.md.    python bench/bench_kld_client.py [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from fidelity.scores.bounds import Known, compare  # noqa: E402
from fidelity.scores.dialects import Request  # noqa: E402
from fidelity.servers.sglang import parse as sglang_parse  # noqa: E402
from fidelity.servers.vllm import parse as vllm_parse  # noqa: E402
from fidelity.scores.store import ScoreStore  # noqa: E402

N, K, V = 4096, 20, 129280


def _responses(rng):
    ids = rng.integers(0, V, N).tolist()
    tops = [rng.choice(V, K, replace=False).tolist() for _ in range(N)]
    vals = [sorted((-rng.exponential(2, K)).tolist(), reverse=True) for _ in range(N)]
    sg = {"meta_info": {
        "input_token_logprobs": [[None if j == 0 else float(vals[j][3]), ids[j], None] for j in range(N)],
        "input_top_logprobs": [None] + [[[v, i, None] for v, i in zip(vals[j], tops[j])] for j in range(1, N)],
        "output_token_logprobs": [[vals[0][0], tops[0][0], None]],
        "output_top_logprobs": [[[v, i, None] for v, i in zip(vals[0], tops[0])]]}}
    vl = {"choices": [{"prompt_token_ids": ids, "prompt_logprobs": [None] + [
        {str(ids[j]): {"logprob": vals[j][3], "rank": 40, "decoded_token": "x"},
         **{str(i): {"logprob": v, "rank": r + 1, "decoded_token": "y"}
            for r, (v, i) in enumerate(zip(vals[j], tops[j]))}} for j in range(1, N)],
        "logprobs": {"tokens": [f"token_id:{tops[0][0]}"], "token_logprobs": [vals[0][0]],
                     "top_logprobs": [{f"token_id:{i}": v for v, i in zip(vals[0], tops[0])}]}}]}
    return ids, json.dumps(sg), json.dumps(vl)


def _best(fn, repeat):
    ts = []
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return min(ts), out


def parse_rows(repeat):
    rng = np.random.default_rng(0)
    ids, sg, vl = _responses(rng)
    req = Request(k=K, steps=1)
    rows = []
    for name, text, parse in (("sglang", sg, sglang_parse), ("vllm", vl, vllm_parse)):
        t_json, data = _best(lambda: json.loads(text), repeat)
        t_parse, scores = _best(lambda: parse(data, ids, req), repeat)
        rows.append({"dialect": name, "MB": len(text) / 1e6, "json_us_per_pos": t_json / N * 1e6,
                     "parse_us_per_pos": t_parse / N * 1e6, "total_s": t_json + t_parse})
    base = [Known(np.arange(V), np.log(rng.dirichlet(np.ones(V)))) for _ in range(64)]
    t_cmp, _ = _best(lambda: [compare(b, s, 5) for b, s in zip(base, scores.known)], repeat)
    t_cmp_k, _ = _best(lambda: [compare(s, s, 5) for s in scores.known[:1024]], repeat)
    with tempfile.TemporaryDirectory() as d:
        st = ScoreStore(Path(d))
        t_put, _ = _best(lambda: st.put("a", "p", "k", scores), repeat)
        t_get, _ = _best(lambda: st.get("a", "p", "k"), repeat)
        size = (Path(d) / "a" / "p-k.npz").stat().st_size
    other = {"compare_full_vocab_us": t_cmp / 64 * 1e6, "compare_topk_us": t_cmp_k / 1024 * 1e6,
             "store_put_s": t_put, "store_get_s": t_get, "store_kb": size / 1e3}
    return rows, other


def launcher_rows(repeat):
    from needle_util import free_port
    from infra.server_process import EngineProcess, LaunchPlan
    from fidelity.kld.endpoint import Endpoint
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for i in range(repeat):
            port = free_port()
            plan = LaunchPlan("a", "fs", "fidelity", f"http://127.0.0.1:{port}",
                              [sys.executable, "-m", "fidelity.cli", "serve", "--port", str(port)],
                              {"DSV4_FIDELITY_ARM": "golden"}, "/health_generate", 120, 10)
            p = EngineProcess(plan, Path(d) / f"{i}.log", cwd=ROOT)
            t0 = time.perf_counter()
            p.start()
            t_start = time.perf_counter() - t0
            ready = p.wait_ready(poll=0.2)
            t = time.perf_counter()
            Endpoint("a", plan.url).connect()
            t_connect = time.perf_counter() - t
            t = time.perf_counter()
            p.stop()
            rows.append({"spawn_s": t_start, "ready_s": ready, "probes_s": t_connect,
                         "stop_s": time.perf_counter() - t})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    rows, other = parse_rows(a.repeat)
    lr = launcher_rows(a.repeat)
    md = ["# KLD client and launcher cost", "",
          f"Measured {time.strftime('%Y-%m-%d %H:%M')} on this machine (2 cores, 1 torch thread; best of "
          f"{a.repeat}). A {N}-token prompt, top-{K} prompt logprobs, vocabulary {V} (DeepSeek-V4's).", "",
          "#### Parsing one scoring response", "",
          "| dialect | response MB | JSON µs/position | parse µs/position | total s |", "|---|---:|---:|---:|---:|"]
    md += [f"| {r['dialect']} | {r['MB']:.1f} | {r['json_us_per_pos']:.1f} | {r['parse_us_per_pos']:.1f} | "
           f"{r['total_s']:.2f} |" for r in rows]
    md += ["", f"Bounds per position: {other['compare_topk_us']:.0f} µs against a top-{K} baseline, "
           f"{other['compare_full_vocab_us']:.0f} µs against a full-vocabulary (in-process) baseline. "
           f"Score store: {other['store_kb']:.0f} kB per prompt, write {other['store_put_s']:.2f} s, "
           f"read {other['store_get_s']:.2f} s.", "",
           "#### Launcher overhead per arm (`fidelity serve`, tiny model)", "",
           "| run | spawn s | until ready s | start-up probes s | stop s |", "|---:|---:|---:|---:|---:|"]
    md += [f"| {i + 1} | {r['spawn_s']:.3f} | {r['ready_s']:.2f} | {r['probes_s']:.3f} | {r['stop_s']:.3f} |"
           for i, r in enumerate(lr)]
    over = statistics.median(r["spawn_s"] + r["probes_s"] + r["stop_s"] for r in lr)
    md += ["", f"Beyond the engine's own start-up, the launcher adds about {over:.2f} s per arm "
           "(spawn + probes + stop), plus up to one readiness poll interval (1 s for SGLang/vLLM, "
           "0.2 s for fidelity serve) — nothing next to a real engine's 5–20 minutes "
           "(docs/research/dsv4-architecture.md §4.2)."]
    out = ROOT / "bench" / "results" / "kld_client.md"
    out.write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
