"""End to end with real processes: two `fidelity serve` servers on loopback (golden and
engine arms), one `fidelity needle` sweep over both as endpoints, and the report."""
import json
import subprocess

import httpx

from needle.results import read_rows
from needle_util import ROOT, fidelity_cmd, served


def test_two_servers_one_sweep_one_report(tmp_path):
    with served("golden", "engine") as (g, e):
        arms = [httpx.get(u + "/v1/models").json()["data"][0]["arm"] for u in (g, e)]
        assert arms[0] == "golden" and "index_keys_fp8" in arms[1]
        p = subprocess.run(fidelity_cmd(
            "needle", "--endpoint", f"golden={g}/v1", "--endpoint", f"engine={e}", "--lengths",
            "259,300", "--depths", "0,100", "--max-tokens", "2", "--temperature", "0",
            "--concurrency", "2", "--out", str(tmp_path)), cwd=ROOT, capture_output=True,
            text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "report:" in p.stdout
    header, rows = read_rows(tmp_path / "needle" / "results.jsonl")
    assert [a["name"] for a in header["arms"]] == ["golden", "engine"]
    from fidelity.weights.target import load_target
    assert header["trials"]["count_source"] == f"server-tokenize:{load_target(None).name}"
    assert len(rows) == 8 and {r["arm"] for r in rows} == {"golden", "engine"}
    for r in rows:
        assert r["n_tokens"] == r["prompt_tokens_reported"] == r["length"] and r["exact_length"]
        assert r["error"] is None and r["completion_tokens"] <= 2
        assert r["outcome"] in ("truncated", "wrong", "other", "empty", "refused")
    by_trial = {}
    for r in rows:
        by_trial.setdefault(r["trial_id"], set()).add(r["prompt_sha256"])
    assert len(by_trial) == 4 and all(len(v) == 1 for v in by_trial.values())   # paired prompts
    rep = tmp_path / "needle" / "latest"
    s = json.loads((rep / "summary.json").read_text())
    assert s["schema_version"] == 1 and [a["arm"] for a in s["tables"]["arms"]] == ["golden", "engine"]
    for f in ("heatmap_golden.png", "heatmap_engine.png", "delta_golden_vs_engine.png",
              "recall_vs_length.png", "outcomes.png", "index.html", "summary.md", "cells.csv"):
        assert (rep / f).stat().st_size > 0
