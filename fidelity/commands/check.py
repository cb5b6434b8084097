"""`fidelity check`: re-threshold a saved `ab` or `kld` report without re-running (a CI
gate); fidelity.verdict.check_summary reads either into the same per-arm table."""
from __future__ import annotations


from fidelity.errors import CommandError

HELP = ("Check a saved `fidelity ab` or `fidelity kld` report; exit 1 if any arm fails. Default: the outcome "
        "(KLD) relative to the report's noise floors; the mechanism (indexer picks, experts) "
        "with --mechanism; absolute thresholds on request.")
EXAMPLES = """\
    fidelity check reports/latest                   # outcome against the report's own floors
    fidelity check reports/latest --mechanism       # also indexer picks and expert sets
    fidelity check reports/latest --arm engine --max-kld 1e-3 --min-topk-recall 0.9
    fidelity check reports/kld/kld-20261201-102334  # a `fidelity kld` report, the same gates
"""

# relative checks: summary column -> ("max": <= k x worst floor, "min": >= worst floor - margin)
RELATIVE = {"kld_mean": "max", "kld_p99": "max", "answer_kld": "max"}
# mechanism (--mechanism): against the floors that are noise for it (not the QAT floor,
# whose picks differ by design)
MECHANISM = {"topk_recall_min": "min", "expert_same_min": "min"}

# option -> (summary column, "max" or "min")
CHECKS = {
    "max_kld": ("kld_mean", "max"),
    "max_kld_p99": ("kld_p99", "max"),
    "max_decode_kld": ("decode_kld_mean", "max"),
    "min_same_top1": ("same_top1", "min"),
}


def add_arguments(p):
    p.add_argument("results", help="report directory of `fidelity ab` (or its summary.csv) or of "
                                   "`fidelity kld`")
    p.add_argument("--arm", action="append", help="arm(s) to check (default: all but the floors)")
    p.add_argument("--max-kld", type=float, help="max mean final-logit KLD")
    p.add_argument("--max-kld-p99", type=float, help="max p99 final-logit KLD")
    p.add_argument("--max-decode-kld", type=float, help="max mean decode-step KLD")
    p.add_argument("--min-same-top1", type=float, help="min same-top-1 rate")
    p.add_argument("--min-topk-recall", type=float,
                   help="min indexer top-k recall vs golden (any CSA layer, prefill)")
    p.add_argument("--kld-x-floor", type=float, default=None, metavar="K",
                   help="relative gate: KLD mean / p99 / at the answer <= K x the worst floor's "
                        "(default 3; on by default when no absolute threshold is given)")
    p.add_argument("--mechanism", action="store_true",
                   help="also gate what the arm changes inside: top-k recall and expert agreement "
                        ">= the worst of the tie-order and reduction-order floors - M")
    p.add_argument("--recall-margin", type=float, default=0.05, metavar="M",
                   help="--mechanism gate margin M (default 0.05)")


def run(args) -> int:
    from fidelity.verdict.check_summary import ReportError, read_report
    try:
        report = read_report(args.results)
    except ReportError as e:
        raise CommandError(str(e)) from None
    summary, summary_csv = report.summary, report.source
    arms = args.arm or [a for a in summary.arm if a not in report.floors]
    unknown = sorted(set(arms) - set(summary.arm))
    if unknown:
        raise CommandError(f"arm(s) {unknown} not in the report; present: {', '.join(summary.arm)}")
    thresholds = {k: getattr(args, k) for k in CHECKS if getattr(args, k) is not None}
    absolute = bool(thresholds) or args.min_topk_recall is not None
    failures = []
    if args.kld_x_floor is not None or not absolute:
        k = 3.0 if args.kld_x_floor is None else args.kld_x_floor
        rel = _relative_failures(summary, arms, RELATIVE, k, args.recall_margin, report.floors)
        if args.mechanism and rel is not None:
            from fidelity.verdict.signals import mechanism_floors
            mech = _relative_failures(summary, arms, MECHANISM, k, args.recall_margin,
                                      mechanism_floors(report.floors))
            rel += mech or []
        if rel is None:
            hint = " (or run kld with its floors / --floor)" if report.kind == "kld" else ""
            raise CommandError(f"{summary_csv} has no floor arms to be relative to; give absolute "
                               f"thresholds{hint}")
        failures += rel
    for arm in arms:
        row = summary[summary.arm == arm].iloc[0]
        for opt, limit in thresholds.items():
            col, kind = CHECKS[opt]
            v = float(row[col])
            bad = not (v <= limit) if kind == "max" else not (v >= limit)
            if bad:
                failures.append(f"{arm}: {col} = {v:.4g} {'>' if kind == 'max' else '<'} {limit:g}")
    if args.min_topk_recall is not None:
        for arm in arms:
            worst = report.recall(arm)
            if len(worst) and float(worst.min()) < args.min_topk_recall:
                failures.append(f"{arm}: indexer top-k recall {float(worst.min()):.4g} at layer "
                                f"{int(worst.idxmin())} < {args.min_topk_recall:g}")
    for f in failures:
        print("FAIL", f)
    print(f"{len(arms)} arm(s) checked, {len(failures)} failure(s)")
    return 1 if failures else 0


def _relative_failures(summary, arms, columns: dict, k: float, margin: float,
                       floor_arms: list[str]) -> list[str] | None:
    """Each of `columns` against the worst of `floor_arms` in the report: KLDs at most k
    times the largest floor value, agreement rates at least the smallest floor value minus
    margin."""
    floors = summary[summary.arm.isin(floor_arms)]
    if floors.empty:
        return None
    out = []
    for col, kind in columns.items():
        if col not in summary or floors[col].isna().all():
            continue
        if kind == "max":
            limit = k * float(floors[col].max())
        else:
            limit = float(floors[col].min()) - margin
        for arm in arms:
            v = float(summary[summary.arm == arm].iloc[0][col])
            if (kind == "max" and v > limit) or (kind == "min" and v < limit):
                rel = f"{k:g} x worst floor" if kind == "max" else f"worst floor - {margin:g}"
                out.append(f"{arm}: {col} = {v:.4g} {'>' if kind == 'max' else '<'} "
                           f"{limit:.4g} ({rel})")
    return out
