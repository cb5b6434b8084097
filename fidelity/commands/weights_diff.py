"""`fidelity weights-diff A B`: do two checkpoints of one architecture hold the same
weights? The static half of "is it the checkpoint or the engine?" (fidelity/weights/diff.py)."""
from __future__ import annotations

from fidelity.commands.options import output_options
from fidelity.errors import CommandError

# Lazy imports inside the functions: building the parser imports every command module,
# and only the command that runs should pay for its machinery (pandas, plots, readers).

HELP = ("compare two checkpoints' dequantised weights tensor by tensor (any layouts: FP8/FP4, "
        "NVFP4 experts, dense bf16), streamed layer by layer; report per tensor, family, layer "
        "and expert. Exit status like diff/cmp: 0 identical (within --tolerance), 1 they differ, "
        "2 an error")
EXAMPLES = """\
    fidelity weights-diff /models/DeepSeek-V4-Flash /models/DeepSeek-V4-Flash-NVFP4   # exit 1 when they differ
"""


def add_arguments(p):
    p.add_argument("a", help="checkpoint A, the reference (rel L2 is ||A-B|| / ||A||)")
    p.add_argument("b", help="checkpoint B")
    p.add_argument("--layers", default=None, metavar="IDS",
                   help="compare only these layers: comma-separated ids and ranges, e.g. 0,3 or "
                        "0-2,7; add 'globals' for embed/head/norm/hc_head (default: every layer "
                        "and the globals)")
    p.add_argument("--tolerance", type=float, default=None, metavar="REL_L2",
                   help="a tensor counts as changed when its rel L2 exceeds this (default: any "
                        "difference from bit-identical dequantised values)")
    output_options(p, "weights-diff", "weights-diff-<timestamp>")


def run(args) -> int:
    from fidelity.progress import Progress
    from fidelity.weights.diff import WeightsDiffError, diff_checkpoints
    from fidelity.weights.diff_report import summary_text, write_report
    try:
        res = diff_checkpoints(args.a, args.b, layers=args.layers, tolerance=args.tolerance,
                               progress=Progress(args.quiet))
    except WeightsDiffError as e:
        raise CommandError("\n  ".join(e.problems)) from None
    path = write_report(res, args.out, args.run_id)
    print(summary_text(res, path))
    return 1 if res.totals["changed"] else 0
