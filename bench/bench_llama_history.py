"""llama.cpp's history on this machine: `fidelity llamacpp history` over PyPI builds from
b9905 (the first with DeepSeek-V4) to the pinned b11434, every change between adjacent builds
bisected and replayed; then docs/llamacpp-history.md's measured block (the builds table, the
pairs, the change points, the time each step took) and its timeline picture, from the history
folder's ledger.

    python bench/bench_llama_history.py                 # run (resumes) and write the doc
    python bench/bench_llama_history.py --render        # the doc again from the ledger
Builds each llama.cpp version it has not built (about 7 minutes each on 2 cores, less where
ccache holds a neighbour's objects); the scoring takes a few minutes per build."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
OUT = Path("/tmp/bench-llama-history")
HIST = OUT / "llamacpp-history"
DOC = ROOT / "docs" / "llamacpp-history.md"
PICTURE = ROOT / "docs" / "screenshots" / "llamacpp-history-timeline.png"
BUILDS = "9905,10103,10306,10502,10705,10901,11104,11311,11434"


def run() -> None:
    subprocess.run([sys.executable, "-m", "fidelity.cli", "llamacpp", "history", "--builds", BUILDS,
                    "--out", str(OUT)], check=True, cwd=ROOT)


def _md(df: pd.DataFrame) -> str:
    def cell(v):
        if isinstance(v, float):
            return "" if pd.isna(v) else f"{v:.3g}"
        return str(v).replace("|", "\\|")
    return "\n".join(["| " + " | ".join(df.columns) + " |", "|" + "---|" * len(df.columns)]
                     + ["| " + " | ".join(cell(v) for v in r) + " |" for r in df.itertuples(index=False)])


def timings(lines: list[dict]) -> str:
    """What each stage took, from the ledger (a cached build: built earlier, 0 s here)."""
    def col(stage):
        return [r["seconds"] for r in lines if r["stage"] == stage and r.get("ok") and r.get("seconds")]
    built, conv, kld = col("built"), col("converted"), col("scored")
    cached = sum(1 for r in lines if r["stage"] == "built" and r.get("cached"))
    parts = [f"builds compiled by the history: {len(built)}" + (f", {min(built):.0f}-{max(built):.0f} s each"
                                                               if built else "") + f"; found built: {cached}"]
    if conv:
        parts.append(f"conversion {min(conv):.0f}-{max(conv):.0f} s per build")
    if kld:
        parts.append(f"`fidelity kld` (golden and twin) {kld[0]:.0f} s for the first build (the golden, floors "
                     f"and twin scored once), then {min(kld[1:] or kld):.0f}-{max(kld[1:] or kld):.0f} s per build")
    return "; ".join(parts) + "."


def render() -> str:
    lines = [json.loads(x) for x in (HIST / "history.jsonl").read_text().splitlines() if x.strip()]
    rep = HIST / "report"
    builds = pd.read_csv(rep / "builds.csv").drop(columns=["server says"], errors="ignore")
    pairs = pd.read_csv(rep / "pairs.csv")
    summary = (rep / "summary.md").read_text()
    verdict = next(ln for ln in summary.splitlines() if ln.startswith("**Verdict.**"))
    changes = summary.split("## Change points", 1)[1].split("\n## ", 1)[0].split("\nRun settings")[0].strip() \
        if "## Change points" in summary else ""
    if (rep / "timeline.png").is_file():
        PICTURE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(rep / "timeline.png", PICTURE)
    s = next(r for r in lines if r["stage"] == "scored" and r.get("ok"))
    return "\n".join([
        f"`python bench/bench_llama_history.py` on this machine (2 cores, shared): `fidelity llamacpp history "
        f"--builds {BUILDS}`; the embedded model, FP8 weights as F32; twin `{s.get('twin')}`.", "",
        verdict.replace("**Verdict.** ", "**Verdict.** "), "",
        f"![KLD per build against the golden and the twin](screenshots/{PICTURE.name})", "",
        "Builds:", "", _md(builds), "", "Adjacent builds against each other:", "", _md(pairs), "",
        "Change points:", "", changes or "none bisected.", "", "Time: " + timings(lines)])


def write_doc() -> None:
    text = DOC.read_text()
    a, b = text.index("<!-- history:start -->"), text.index("<!-- history:end -->")
    DOC.write_text(text[:a] + "<!-- history:start -->\n" + render() + "\n" + text[b:])


if __name__ == "__main__":
    if sys.argv[1:] != ["--render"]:
        run()
    write_doc()
