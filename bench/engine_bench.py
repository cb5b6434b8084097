"""What the engine benches (llama.cpp, mlx-vlm) share: the fidelity CLI run as a subprocess
(a finding's exit 1 is an answer, not a failure), and one arm of a `fidelity kld` run folder as a
row of a bench's table -- its KLD against the baseline with the highest in-process floor, and
its judgement against its twin (the run's manifest and its -vs-<twin> folder)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]


def fidelity(*args) -> subprocess.CompletedProcess:
    r = subprocess.run([sys.executable, "-m", "fidelity.cli", *args, "--threads", "1"],
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"fidelity {' '.join(args[:2])} failed ({r.returncode}): {r.stderr[-2000:]}")
    return r


def kld_row(out: Path, run_id: str, arm: str) -> dict:
    d = Path(out) / "kld" / run_id
    m = json.loads((d / "manifest.json").read_text())
    t = pd.read_csv(d / "kld_by_position.csv")
    allk = t[t.bucket == "all"].set_index("arm")
    floors = [a for a in allk.index if a.startswith("floor:")]
    tw = m["manifest"]["twins"][0]
    vs = pd.read_csv(Path(out) / "kld" / f"{run_id}-vs-{tw['name']}" / "kld_by_position.csv")
    vs = vs[vs.bucket == "all"].set_index("arm")
    twin_floors = vs.loc[[a for a in vs.index if a.startswith(f"{tw['name']}~")]].kld_hi   # the twin judgement's floors
    r = allk.loc[arm]
    return {"kld_mean": r.kld_mean, "kld_lo": r.kld_lo, "kld_hi": r.kld_hi, "kld_p99": r.kld_p99,
            "kld_max": r.kld_max, "same_top1": r.same_top1, "positions": int(r.positions),
            "floor_kld_hi": float(allk.loc[floors].kld_hi.max()), "floor_arm": str(allk.loc[floors].kld_hi.idxmax()),
            "verdict": m["verdict"].get("golden_sentence", m["verdict"]["sentence"]),
            "twin": tw["twin"], "vs_twin": float(vs.loc[arm].kld_mean), "vs_twin_lo": float(vs.loc[arm].kld_lo),
            "vs_twin_hi": float(vs.loc[arm].kld_hi), "twin_unexplained": bool(tw["unexplained"]),
            "twin_verdict": tw["sentence"],
            "twin_floor_kld_hi": float(twin_floors.max()) if len(twin_floors) else None,
            "twin_floor_arm": str(twin_floors.idxmax()) if len(twin_floors) else None,
            "golden_vs_twin": float(allk.loc[tw["name"]].kld_mean) if tw["name"] in allk.index else None}
