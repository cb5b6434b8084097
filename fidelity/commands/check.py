"""`fidelity check`: re-threshold a saved A/B report without re-running (a CI gate)."""
from __future__ import annotations

import sys
from pathlib import Path

HELP = "Check a saved `fidelity ab` report against thresholds; exit 1 if any arm fails."

# option -> (summary column, "max" or "min")
CHECKS = {
    "max_kld": ("kld_mean", "max"),
    "max_kld_p99": ("kld_p99", "max"),
    "max_decode_kld": ("decode_kld_mean", "max"),
    "min_same_top1": ("same_top1", "min"),
}


def add_arguments(p):
    p.add_argument("results", help="report directory of `fidelity ab` (or its summary.csv)")
    p.add_argument("--arm", action="append", help="arm(s) to check (default: all but the floors)")
    p.add_argument("--max-kld", type=float, help="max mean final-logit KLD")
    p.add_argument("--max-kld-p99", type=float, help="max p99 final-logit KLD")
    p.add_argument("--max-decode-kld", type=float, help="max mean decode-step KLD")
    p.add_argument("--min-same-top1", type=float, help="min same-top-1 rate")
    p.add_argument("--min-topk-recall", type=float,
                   help="min indexer top-k recall vs golden (any CSA layer, prefill)")


def run(args) -> int:
    import pandas as pd

    root = Path(args.results)
    summary_csv = root if root.suffix == ".csv" else root / "summary.csv"
    if not summary_csv.exists():
        print(f"error: no summary.csv in {root} (is it a `fidelity ab` report?)", file=sys.stderr)
        return 2
    summary = pd.read_csv(summary_csv)
    arms = args.arm or [a for a in summary.arm if not str(a).startswith("floor:")]
    unknown = sorted(set(arms) - set(summary.arm))
    if unknown:
        print(f"error: arm(s) {unknown} not in the report; present: {', '.join(summary.arm)}",
              file=sys.stderr)
        return 2
    thresholds = {k: getattr(args, k) for k in CHECKS if getattr(args, k) is not None}
    if not thresholds and args.min_topk_recall is None:
        print("error: give at least one threshold (--max-kld, --max-kld-p99, --max-decode-kld, "
              "--min-same-top1, --min-topk-recall)", file=sys.stderr)
        return 2
    failures = []
    for arm in arms:
        row = summary[summary.arm == arm].iloc[0]
        for opt, limit in thresholds.items():
            col, kind = CHECKS[opt]
            v = float(row[col])
            bad = not (v <= limit) if kind == "max" else not (v >= limit)
            if bad:
                failures.append(f"{arm}: {col} = {v:.4g} {'>' if kind == 'max' else '<'} {limit:g}")
    if args.min_topk_recall is not None:
        drift = pd.read_csv(summary_csv.parent / "drift.csv.gz")
        d = drift[(drift.tap == "attn.index.topk") & (drift.bucket == "all") & (drift.phase == "prefill")]
        for arm in arms:
            worst = d[d.arm == arm].groupby("layer")["recall"].mean()
            if len(worst) and float(worst.min()) < args.min_topk_recall:
                failures.append(f"{arm}: indexer top-k recall {float(worst.min()):.4g} at layer "
                                f"{int(worst.idxmin())} < {args.min_topk_recall:g}")
    for f in failures:
        print("FAIL", f)
    print(f"{len(arms)} arm(s) checked, {len(failures)} failure(s)")
    return 1 if failures else 0
