"""Recall of a trained checkpoint, measured with the toolkit's own needle sweep (in-process
runner, golden arm, `reference` numerics unless told otherwise): lengths × depths ×
repetitions, greedy decoding, substring scoring, Wilson intervals, and the indexer
mechanism (was the needle's compressed entry in the golden top-k at the question).

    python -m training.evaluate models/tiny-needle --lengths 384,513 --depths 0,50,100 \
        --reps 10 --results /tmp/sweep.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from fidelity.arms import NumericsArm
from fidelity.needle_runner import InProcessRunner
from fidelity.weights.target import Target
from needle.haystack import HaystackSpec, PromptFormat
from needle.sweep import SweepConfig, run_sweep
from needle.tables import by_length, cells, mechanism
from reference_model import Numerics
from reference_model.checkpoint import load_checkpoint
from reference_model.tokenizer import load_tokenizer

SWEEP_SEED = 0


def load_target(checkpoint):
    root = Path(checkpoint)
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


def sweep(target, grid: Grid, results, *, profile="reference", compute_dtype=None,
          quiet=True, fresh=False) -> list[dict]:
    cfg = SweepConfig(lengths=list(grid.lengths), depths=[float(d) for d in grid.depths],
                      reps=grid.reps, spec=HaystackSpec(), fmt=PromptFormat("chat"), seed=grid.seed)
    runner = InProcessRunner("golden", target, golden_arm(compute_dtype), profile=profile)
    return run_sweep(cfg, [runner], results, fresh=fresh, quiet=quiet)


def summary(rows) -> dict:
    return {"cells": cells(rows), "by_length": by_length(rows), "mechanism": mechanism(rows)}


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
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    grid = Grid([int(x) for x in a.lengths.split(",")], [float(x) for x in a.depths.split(",")],
                a.reps, a.seed)
    rows = sweep(load_target(a.checkpoint), grid, a.results, quiet=False, fresh=a.fresh)
    s = summary(rows)
    for r in s["by_length"]:
        print(f"L={r['length']}: recall {r['recall']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] "
              f"n={r['n_scored']}")
    for m in s["mechanism"]:
        print(json.dumps(m))
    return 0


if __name__ == "__main__":
    sys.exit(main())
