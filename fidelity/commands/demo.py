"""Interim main job: run the golden model (reference numerics) on the embedded default
beside the exact (fp32, no simulated quantisation) profile and report the noise floor
layer by layer. `fidelity ab` replaces this as the main job once it exists."""
from __future__ import annotations

import html
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

HELP = "Run the golden model on the embedded default and write a layer-by-layer report."


def add_arguments(p):
    p.add_argument("--out", default="reports", help="reports directory (writes <out>/latest)")
    p.add_argument("--length", type=int, default=1024, help="prompt length in tokens")
    p.add_argument("--seed", type=int, default=0, help="weights and prompt seed")


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / a.norm().clamp_min(1e-300))


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    return float(a @ b / (a.norm() * b.norm()).clamp_min(1e-300))


def run(args) -> int:
    from reference_model import Model, Numerics, Taps, random_weights, tiny

    cfg = tiny()
    weights = random_weights(cfg, args.seed)
    g = torch.Generator().manual_seed(args.seed + 1)
    tokens = torch.randint(2, cfg.vocab_size, (args.length,), generator=g)
    pats = ["layers.*.out", "logits"]
    runs = {}
    for prof in ("reference", "exact"):
        taps = Taps(pats)
        t0 = time.perf_counter()
        Model(weights, Numerics(prof)).prefill_logits(tokens, taps)
        runs[prof] = (taps, time.perf_counter() - t0)
    ref, ex = runs["reference"][0], runs["exact"][0]
    rows = []
    for i in range(cfg.n_layers):
        n = f"layers.{i}.out"
        rows.append({"layer": i, "kind": cfg.layer_kind(i), "tap": n,
                     "rel_l2": _rel_l2(ex[n], ref[n]), "cosine": _cos(ex[n], ref[n])})
    lr, le = ref["logits"].double(), ex["logits"].double()
    kld = (le.softmax(-1) * (le.log_softmax(-1) - lr.log_softmax(-1))).sum(-1)
    summary = {
        "model": cfg.name, "config_hash": cfg.config_hash(), "length": args.length,
        "seed": args.seed, "logits_rel_l2": _rel_l2(le, lr), "kld_mean": float(kld.mean()),
        "kld_max": float(kld.max()),
        "same_top1": float((lr.argmax(-1) == le.argmax(-1)).double().mean()),
        "seconds": {k: round(v[1], 3) for k, v in runs.items()},
    }
    print(f"golden 'reference' vs 'exact' on {cfg.name}, {args.length} tokens (seed {args.seed})")
    print(f"{'layer':>5} {'kind':>4} {'rel L2':>10} {'cosine':>10}")
    for r in rows:
        print(f"{r['layer']:>5} {r['kind']:>4} {r['rel_l2']:>10.4g} {r['cosine']:>10.6f}")
    print(f"logits: rel L2 {summary['logits_rel_l2']:.4g}, KLD mean {summary['kld_mean']:.4g}, "
          f"same top-1 {summary['same_top1']:.3f}")
    _write_report(Path(args.out), rows, summary)
    print(f"report: {Path(args.out) / 'latest'}")
    return 0


def _write_report(out: Path, rows: list[dict], summary: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".latest-", dir=out))
    md = ["# Golden reference: noise floor (`reference` vs `exact`)", "",
          f"Model `{summary['model']}` (config {summary['config_hash']}), "
          f"{summary['length']} tokens, seed {summary['seed']}.", "",
          "| layer | kind | rel L2 | cosine |", "|---:|---|---:|---:|"]
    md += [f"| {r['layer']} | {r['kind']} | {r['rel_l2']:.4g} | {r['cosine']:.6f} |" for r in rows]
    md += ["", f"Logits: rel L2 {summary['logits_rel_l2']:.4g}, KLD mean {summary['kld_mean']:.4g} "
           f"(max {summary['kld_max']:.4g}), same top-1 {summary['same_top1']:.3f}.", ""]
    (tmp / "summary.md").write_text("\n".join(md))
    body = "".join(f"<tr><td>{r['layer']}</td><td>{r['kind']}</td><td>{r['rel_l2']:.4g}</td>"
                   f"<td>{r['cosine']:.6f}</td></tr>" for r in rows)
    (tmp / "index.html").write_text(
        "<!doctype html><meta charset=utf-8><title>dsv4-fidelity</title>"
        f"<h1>Golden reference noise floor</h1><p>{html.escape(json.dumps(summary))}</p>"
        f"<table border=1><tr><th>layer<th>kind<th>rel L2<th>cosine</tr>{body}</table>")
    (tmp / "summary.json").write_text(json.dumps({"schema_version": 1, "summary": summary,
                                                  "layers": rows}, indent=2))
    final = out / "latest"
    if final.exists():
        old = out / f".old-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old)
    else:
        tmp.rename(final)
