"""What a history keeps of one release's `fidelity kld` run: its numbers against the golden
(with the golden's floors) and against its twin (with the twin's), and both verdicts."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd


def read_kld(kld_dir: Path, run_id: str) -> dict:
    """The engine arm `run_id`'s record from kld's report folders."""
    def row(run: str, who: str) -> dict:
        t = pd.read_csv(kld_dir / run / "kld_by_position.csv")
        t = t[t.bucket == "all"].set_index("arm")
        floors = [a for a in t.index if "floor:" in a]
        r = t.loc[who]
        return {"mean": float(r.kld_mean), "lo": float(r.kld_lo), "hi": float(r.kld_hi),
                "p99": float(r.kld_p99), "same_top1": float(r.same_top1), "positions": int(r.positions),
                "floor_hi": float(t.loc[floors].kld_hi.max()) if floors else None}
    m = json.loads((kld_dir / run_id / "manifest.json").read_text())
    v = m["verdict"]
    twins = v.get("twins") or []
    out = {"golden": row(run_id, run_id), "verdict": v.get("golden_sentence", v["sentence"]),
           "named_vs_golden": bool(v.get("named"))}
    server = next((a.get("server") or {} for a in m["manifest"]["arms"] if a["name"] == run_id), {})
    out["server_build"] = server.get("build")
    if twins:
        t = twins[0]
        out.update(twin=t["twin"], unexplained=t["unexplained"], twin_sentence=t["sentence"],
                   vs_twin=row(t["report"], run_id))
    return out
