"""Speculative decoding on the stand-in: acceptance and speed-up of the golden with the
embedded model's MTP layer, K = 1, 2, 4, against plain decoding of the same requests --
and that every output is bit-identical to the plain one (tokens and logprobs).

Requests: held-out needle haystacks (training/data.py's v2 mix, a seed the MTP never saw),
generating `--tokens` tokens past EOS (the model goes on into the follow-up turns it was
trained on), greedy and sampled (T = 1, seeded). Wall time is the golden's own (fp64 CPU,
one thread): a stand-in's speed-up shows the path runs, not what an engine gains.

    python bench/bench_speculative.py [--model models/tiny-needle-v2] [--prompts 8]
Writes bench/results/speculative.{md,json}."""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

from reference_model import Model  # noqa: E402
from reference_model.checkpoint import load_checkpoint  # noqa: E402
from reference_model.generate import Decoder, Sampling, Scoring  # noqa: E402
from reference_model.mtp import MTP, load_mtp_weights  # noqa: E402
from reference_model.speculative import SpecDecoder  # noqa: E402
from reference_model.tokenizer import load_tokenizer  # noqa: E402

RESULTS = HERE / "bench" / "results"


def prompts(model_dir: Path, n: int, seed: int) -> list[list[int]]:
    from training.data import HaystackSampler, parse_mix
    tok = load_tokenizer(model_dir / "tokenizer.json")
    hs = HaystackSampler(tok, seed=seed, mix=parse_mix("near=0.5,random=0.2,single=0.3"), follow_ups=False)
    rng = random.Random(seed)
    exs = [hs.example(rng.randint(300, 600)) for _ in range(n)]
    return [e.ids[:e.n_prompt] for e in exs]                  # the prompt: the answer is generated


def run(dec) -> tuple[list, float]:
    t0 = time.perf_counter()
    out = dec.run()
    return (out.tokens, [(s.token, s.logprob) for s in out.scores]), time.perf_counter() - t0


def bench(a) -> dict:
    torch.set_num_threads(a.threads)
    root = Path(a.model)
    model = Model(load_checkpoint(root))
    mtp = MTP(model, load_mtp_weights(root))
    ps = prompts(root, a.prompts, a.seed)
    modes = {"greedy": lambda i: Sampling(), "sampled T=1": lambda i: Sampling(temperature=1.0, seed=100 + i)}
    rows = []
    for mode, samp in modes.items():
        plain = [run(Decoder(model, p, a.tokens, samp(i), scoring=Scoring(top=0))) for i, p in enumerate(ps)]
        t_plain = sum(t for _, t in plain)
        for k in a.k:
            out, stats, t_spec = [], [], 0.0
            for i, p in enumerate(ps):
                d = SpecDecoder(model, mtp, k, p, a.tokens, samp(i), scoring=Scoring(top=0))
                res, t = run(d)
                out.append(res)
                stats.append(d.spec)
                t_spec += t
            identical = sum(o == pl[0] for o, pl in zip(out, plain))
            drafted = sum(s.drafted for s in stats)
            acc = sum(s.accepted_total for s in stats)
            verifies = sum(s.verifies for s in stats)
            per = [sum(s.accepted[j] for s in stats) / max(1, sum(s.proposed[j] for s in stats)) for j in range(k)]
            rows.append({"mode": mode, "k": k, "prompts": len(ps), "tokens": a.tokens,
                         "bit_identical": f"{identical}/{len(ps)}", "acceptance_rate": acc / max(1, drafted),
                         "accept_length": 1 + acc / max(1, verifies), "accept_per_position": per,
                         "plain_s": t_plain, "spec_s": t_spec, "speedup": t_plain / t_spec})
            print(json.dumps(rows[-1]), flush=True)
    model = str(root.resolve().relative_to(HERE)) if root.resolve().is_relative_to(HERE) else root.name
    return {"model": model, "threads": a.threads, "seed": a.seed, "rows": rows,
            "load_average": round(os.getloadavg()[0], 1)}


def write(res: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "speculative.json").write_text(json.dumps(res, indent=2) + "\n")
    lines = ["# Speculative decoding on the stand-in (golden + the embedded MTP layer)", "",
             f"`python bench/bench_speculative.py` on {res['model']}, {res['threads']} thread(s); "
             f"{res['rows'][0]['prompts']} held-out needle haystacks (seed {res['seed']}), "
             f"{res['rows'][0]['tokens']} tokens each, generated past EOS. Acceptance: drafts accepted / "
             "drafted; accept length: tokens emitted per verify; per position: the share of verifies "
             "proposing draft j whose drafts 1..j were all accepted (vLLM's accepted-per-position). "
             "Bit-identical: tokens and logprobs equal plain decoding's. Wall time is the golden's "
             "(fp64, CPU) on a 2-core machine shared with other jobs (load average "
             f"{res.get('load_average', '?')} at the end): the speed-up shows the path runs and what "
             "the MTP's acceptance buys when a verify of K+1 tokens costs about one decode step "
             "plus K MTP forwards; it is not an engine's.", "",
             "| mode | K | bit-identical | acceptance | accept length | per position | plain s | spec s | speed-up |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        per = " / ".join(f"{x:.2f}" for x in r["accept_per_position"])
        lines.append(f"| {r['mode']} | {r['k']} | {r['bit_identical']} | {r['acceptance_rate']:.3f} | "
                     f"{r['accept_length']:.2f} | {per} | {r['plain_s']:.1f} | {r['spec_s']:.1f} | "
                     f"{r['speedup']:.2f}x |")
    (RESULTS / "speculative.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(HERE / "models" / "tiny-needle-v2"))
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=48)
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-write", action="store_true")
    a = p.parse_args(argv)
    res = bench(a)
    if not a.no_write:
        write(res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
