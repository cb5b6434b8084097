"""Recall of a trained checkpoint, measured with the toolkit's own needle sweep (in-process
runner, golden arm, `reference` numerics unless told otherwise): lengths × depths ×
repetitions, greedy decoding, substring scoring, Wilson intervals, and the indexer
mechanism (was the needle's compressed entry in the golden top-k at the question; for
multikey, also how many distractor needles' entries the indexer kept: `discrimination`).

    python -m training.evaluate models/tiny-needle --lengths 384,513 --depths 0,50,100 \
        --reps 10 --results /tmp/sweep.jsonl
    python -m training.evaluate models/tiny-needle-v2 --kind multikey --distractors near \
        --n-keys 4 --lengths 512,1024 --reps 4 --results /tmp/near4.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fidelity.design.arms import NumericsArm
from fidelity.needle_run.runner import InProcessOptions, InProcessRunner
from fidelity.weights.target import Target
from needle.haystack import HaystackSpec, PromptFormat
from needle.sweep import SweepConfig, run_sweep
from needle.tables import by_length, cells, mechanism
from reference_model import Numerics
from reference_model.checkpoint import load_checkpoint
from reference_model.tokenizer import load_tokenizer

SWEEP_SEED = 0


def load_target(checkpoint):
    from fidelity.weights.source import resolve_checkpoint
    root = resolve_checkpoint(checkpoint)
    return Target(root.name, load_checkpoint(root), load_tokenizer(root / "tokenizer.json"),
                  f"checkpoint {root}")


def golden_arm(compute_dtype=None):
    return NumericsArm("golden", lambda profile="reference": Numerics(profile, compute_dtype))


@dataclass(frozen=True)
class Grid:
    """The sweep's cells: prompt lengths × needle depths (%) × repetitions; the seed picks
    the haystacks."""
    lengths: list[int]
    depths: list[float]
    reps: int
    seed: int = SWEEP_SEED


def sweep_config(grid: Grid, spec: HaystackSpec | None = None) -> SweepConfig:
    return SweepConfig(lengths=list(grid.lengths), depths=[float(d) for d in grid.depths],
                       reps=grid.reps, spec=spec or HaystackSpec(), fmt=PromptFormat("chat"),
                       seed=grid.seed)


def sweep(target, grid: Grid, results, *, spec: HaystackSpec | None = None, profile="reference",
          compute_dtype=None, quiet=True, fresh=False) -> list[dict]:
    """The golden arm's rows for every trial of `grid` (default spec: single needle)."""
    runner = InProcessRunner("golden", target, golden_arm(compute_dtype),
                             options=InProcessOptions(profile=profile))
    return run_sweep(sweep_config(grid, spec), [runner], results, fresh=fresh, quiet=quiet)


def summary(rows) -> dict:
    return {"cells": cells(rows), "by_length": by_length(rows), "mechanism": mechanism(rows)}


def spec_of(header: dict) -> HaystackSpec:
    """The HaystackSpec a results log was swept with (its header's trial settings)."""
    d = dict(header["trials"]["spec"])
    d.pop("template", None)
    return HaystackSpec(**d)


def discrimination(rows, spec: HaystackSpec, tokenizer, seed: int = SWEEP_SEED,
                   window: int = 32) -> list[dict]:
    """Multikey: per CSA layer, at the question's last token, how many *distractor* needles
    had an entry holding their value among the indexer's picks (the sweep records the picks;
    the prompts are rebuilt from the trial seeds, so the distractors' token positions are
    exact). `clean`: the queried needle kept and every distractor left out; `dist_kept`:
    mean distractor needles kept, of n_keys-1. Trials with a needle in the (sliding) window
    are left out."""
    from collections import defaultdict

    from needle.haystack import LocalCounter, needle_entries, value_token_positions
    from needle.stats import wilson
    from needle.sweep import Trial, build_prompts
    rows = [r for r in rows if r.get("mechanism") and r.get("distractors")]
    if not rows:
        return []
    cfg = SweepConfig(lengths=[], depths=[], spec=spec, fmt=PromptFormat("chat"), seed=seed)
    plan = {t.trial_id: t for t in SweepConfig(
        lengths=sorted({r["length"] for r in rows}), depths=sorted({r["depth"] for r in rows}),
        reps=max(r["rep"] for r in rows) + 1, spec=spec, fmt=PromptFormat("chat"), seed=seed).plan()}
    trials = [plan[r["trial_id"]] for r in rows if r["trial_id"] in plan]
    prompts = build_prompts(cfg, trials, LocalCounter(tokenizer), quiet=True)
    g = defaultdict(list)
    for r in rows:
        p = prompts.get(r["trial_id"])
        if p is None or p.sha256 != r["prompt_sha256"]:
            continue
        ids, offsets = tokenizer.encode_with_offsets(p.text)
        pos = len(ids) - 1
        dist_tok = []
        for v in r["distractors"]:
            a = p.text.index(v)
            dist_tok.append(value_token_positions(offsets, [(a, a + len(v))]))
        win = pos - window
        for m in r["mechanism"]:
            if m.get("in_topk") is None or m.get("in_window") or any(t > win for d in dist_tok for t in d):
                continue
            picks = set(m["picks"])
            kept = [bool(set(needle_entries(d, pos)) & picks) for d in dist_tok]
            g[m["layer"]].append((m["in_topk"], sum(kept), len(kept), r["outcome"] == "correct"))
    out = []
    for layer, v in sorted(g.items()):
        clean = [q and k == 0 for q, k, _, _ in v]
        lo, hi = wilson(sum(clean), len(clean))
        out.append({"layer": layer, "n": len(v), "queried_kept": sum(q for q, *_ in v) / len(v),
                    "dist_kept": sum(k for _, k, _, _ in v) / len(v),
                    "n_distractors": v[0][2],
                    "any_dist_kept": sum(k > 0 for _, k, _, _ in v) / len(v),
                    "clean": sum(clean) / len(clean), "clean_ci": [lo, hi],
                    "clean_correct": (sum(c for c, (*_, ok) in zip(clean, v) if ok)
                                      / max(1, sum(ok for *_, ok in v)))})
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--lengths", required=True)
    p.add_argument("--depths", default="0,25,50,75,100")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--results", required=True)
    p.add_argument("--seed", type=int, default=SWEEP_SEED)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--fresh", action="store_true")
    p.add_argument("--kind", default="single", help="needle kind (needle/haystack.py KINDS)")
    p.add_argument("--distractors", default="random", help="multikey distractor keys: random, near")
    p.add_argument("--n-keys", type=int, default=4, help="multikey: needles (queried + distractors)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    grid = Grid([int(x) for x in a.lengths.split(",")], [float(x) for x in a.depths.split(",")],
                a.reps, a.seed)
    spec = HaystackSpec(kind=a.kind, distractors=a.distractors, n_keys=a.n_keys)
    target = load_target(a.checkpoint)
    rows = sweep(target, grid, a.results, spec=spec, quiet=False, fresh=a.fresh)
    s = summary(rows)
    for r in s["by_length"]:
        print(f"L={r['length']}: recall {r['recall']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] "
              f"n={r['n_scored']}")
    for m in s["mechanism"]:
        print(json.dumps(m))
    for d in discrimination(rows, spec, target.tokenizer, a.seed):
        print(json.dumps(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
