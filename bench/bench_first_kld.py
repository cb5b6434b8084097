"""A user's first `fidelity kld` against llama.cpp (issue 62): nothing stored, so the golden,
its floors, llama.cpp's decode-path twin (scored position by position, as llama-server's
teacher-forced reading is) and the twin's floors are all computed, then the same command
again (a "later variant": every in-process score stored, only the endpoint scored). The
same settings as bench_llama_cpp.py's kld (256/511/1023 tokens x 2, 4 decode steps, top 512)
on the widened tiny-needle-v2 and the F32 GGUF, one thread for the toolkit, one for the server.

Usage: python bench/bench_first_kld.py [--root CHECKOUT] [--label after]
Appends {label, first_s, later_s, load} to bench/results/first_kld.json and rewrites
bench/results/first_kld.md from every stored row."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.llamacpp.flags import scored_twin  # noqa: E402
from fidelity.llamacpp.prepare import gguf  # noqa: E402
from fidelity.llamacpp.server import serving  # noqa: E402

MODEL = ROOT / "models" / "tiny-needle-v2"
RESULTS = ROOT / "bench" / "results" / "first_kld.json"


def kld(root: Path, url: str, ck: Path, out: Path) -> float:
    """Seconds of one `fidelity kld` run of checkout `root` into `out`."""
    args = [sys.executable, "-m", "fidelity.cli", "kld", "--arm", "golden=golden", "--endpoint", f"llama={url}",
            "--checkpoint", str(ck), "--twin", f"llama={scored_twin([])}", "--lengths", "256,511,1023",
            "--reps", "2", "--decode-steps", "4", "--top-k", "512", "--no-captures", "--out", str(out),
            "--quiet", "--run-id", "first", "--threads", "1"]
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=root, capture_output=True, text=True,
                       env=dict(os.environ, PYTHONPATH=str(root)))
    if r.returncode not in (0, 1):
        raise RuntimeError(f"fidelity kld failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return time.perf_counter() - t0


def render(rows: list[dict]) -> str:
    lines = ["# A first `fidelity kld` against llama.cpp, and a later one (issue 62)", "",
             "Widened tiny-needle-v2, llama-server b11434 on the F32 GGUF (`-t 1`), `fidelity kld` with "
             "`--threads 1`, prompts 256/511/1023 tokens x 2, 4 decode steps, top 512. First: an empty run "
             "folder (golden, floors, the decode-path twin and its floors computed); later: the same command "
             "again (in-process scores stored, the endpoint scored). Load = 1-minute load average at the start "
             "and end of the first run.", "",
             "| label | commit | first s | later s | first / later | load |", "|---|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['label']} | {r['commit']} | {r['first_s']:.0f} | {r['later_s']:.0f} | "
                     f"{r['first_s'] / r['later_s']:.1f} | {r['load']} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=str(ROOT))
    ap.add_argument("--label", default="after")
    args = ap.parse_args()
    root = Path(args.root).resolve()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                            text=True).stdout.strip()
    ck, model = gguf(MODEL, "f32")
    out = Path("/tmp") / f"bench-first-kld-{args.label}"
    shutil.rmtree(out, ignore_errors=True)
    with serving(model, Path("/tmp/bench-first-kld-server.log"), ctx=2048, threads=1) as url:
        l0 = os.getloadavg()[0]
        first = kld(root, url, ck, out)
        l1 = os.getloadavg()[0]
        later = kld(root, url, ck, out)
    rows = json.loads(RESULTS.read_text()) if RESULTS.is_file() else []
    rows = [r for r in rows if r["label"] != args.label] + [
        {"label": args.label, "commit": commit, "first_s": first, "later_s": later, "load": f"{l0:.1f}-{l1:.1f}"}]
    RESULTS.write_text(json.dumps(rows, indent=1) + "\n")
    RESULTS.with_suffix(".md").write_text(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
