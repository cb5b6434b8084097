"""The spec family's judgement on planted speculative-decoding bugs, before and after a
change: which arms it flags and the kind it names for each. Servers (always this
checkout's `fidelity serve`, the tiny MTP checkpoint): K = 2 serving the golden and four
planted bugs (a verify not batch-exact, a rollback keeping rejected compressor rows, a
verifier ignoring temperature, a verifier accepting near-top drafts), K = 1 serving an
acceptance bug and ds4 #750's corrupt-row shape (lossless at one draft), and one plain
server as the baseline. `fidelity consistency --families spec` is run from `--root`'s
code, so its column shows what that checkout says about the same replies.

    git worktree add /tmp/before <commit>
    python bench/bench_spec_kinds.py --label before --root /tmp/before
    python bench/bench_spec_kinds.py --label after
The results go into bench/results/verdict_cases.json as the `spec` case of each label and
are rendered with the other cases (bench_verdict_cases.py --render)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE / "tests"))
sys.path.insert(0, str(HERE / "bench"))

K2 = ("golden", "verify_not_batch_exact", "rollback_keeps_rejected_compressor_rows", "verify_ignores_temperature",
      "verify_accepts_near_top")
K1 = {"accepts1": "verify_accepts_near_top", "bos1": "correction_row_not_snapshotted"}
KINDS = (("accepts drafts the target rejects", "wrong acceptance"), ("logits row read corrupt", "corrupt row (#750)"),
         ("not batch-exact", "verify numerics"), ("rollback", "state across a verify"),
         ("does not sample", "verifier not sampling"))


def kind(looks_like: str) -> str:
    """The kind a flagged spec row names, in two or three words (its first 40 characters when
    none of KINDS matches)."""
    return next((short for key, short in KINDS if key in str(looks_like)), str(looks_like)[:40])


def run(root: str) -> dict:
    from checkpoint_util import tiny_mtp_checkpoint
    from needle_util import served
    ck = tiny_mtp_checkpoint(Path(tempfile.mkdtemp()) / "tiny-mtp")
    base = ("--checkpoint", str(ck), "--page-size", "16")
    t0 = time.perf_counter()
    with served("golden", extra=base + tuple(a for b in K2 for a in ("--arm", f"{b}={b}"))
                + ("--speculative-tokens", "2")) as (spec,), \
            served("golden", extra=base + tuple(a for n, b in K1.items() for a in ("--arm", f"{n}={b}"))
                   + ("--speculative-tokens", "1")) as (spec1,), served("golden", extra=base) as (plain,):
        eps = [a for n in K2 for a in ("--endpoint", f"{n}={spec}", "--model", f"{n}={n}")]
        eps += [a for n in K1 for a in ("--endpoint", f"{n}={spec1}", "--model", f"{n}={n}")]
        out = Path(tempfile.mkdtemp())
        p = subprocess.run([sys.executable, "-m", "fidelity.cli", "consistency", *eps, "--endpoint",
                            f"plain={plain}", "--spec-baseline", "plain", "--families", "spec", "--probes", "2",
                            "--max-tokens", "20", "--spec-seeds", "6", "--length", "spec=200", "--checkpoint",
                            str(ck), "--out", str(out), "--run-id", "r", "--quiet"],
                           cwd=root, env={**os.environ, "PYTHONPATH": root}, capture_output=True, text=True)
    if p.returncode not in (0, 1):
        raise SystemExit(f"consistency failed ({p.returncode}): {p.stderr[-2000:]}")
    t = pd.read_csv(out / "consistency" / "r" / "spec.csv").set_index("arm")
    kinds = {a: (kind(r.looks_like) if r.flagged else "lossless") for a, r in t.iterrows()}
    acc = {a: f"{r.accept_first} vs {r.accept_reference}'s {t.loc[r.accept_reference, 'accept_first']} "
              f"(p = {r.p_accept_above:.2g})"
           for a, r in t.iterrows() if "p_accept_above" in t and pd.notna(r.get("p_accept_above"))}
    return {"kinds": kinds, "acceptance": acc, "seconds": round(time.perf_counter() - t0, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True, help="column name, as bench_verdict_cases.py's")
    p.add_argument("--root", default=str(HERE), help="checkout whose fidelity consistency judges")
    a = p.parse_args()
    got = run(a.root)
    path = HERE / "bench" / "results" / "verdict_cases.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(a.label, {})["spec"] = got
    path.write_text(json.dumps(data, indent=1))
    from bench_verdict_cases import write
    print(json.dumps(got, indent=1))
    print(write(None, {}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
