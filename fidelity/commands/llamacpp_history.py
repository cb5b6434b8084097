"""`fidelity llamacpp history`: llama.cpp's builds from PyPI scored one by one against the
golden and against its twin, adjacent builds compared with each other, each change bisected
to two neighbouring PyPI builds and placed at its first tensor (fidelity.llamacpp.history).
Resumes from <out>/llamacpp-history/history.jsonl; the report is rewritten after each build."""
from __future__ import annotations

from pathlib import Path

from fidelity.errors import CommandError

DEFAULT_BUILDS = "spread:8"


def add_arguments(g):
    g.add_argument("--builds", default=None, metavar="N,N|spread:K",
                   help=f"history: llama.cpp build numbers (e.g. 9905,10502,11434), or spread:K for K "
                        f"builds evenly spaced over PyPI's DeepSeek-V4 builds, first and last included "
                        f"(default: {DEFAULT_BUILDS}, or none with --bisect)")
    g.add_argument("--bisect", default=None, metavar="A..B",
                   help="history: the first PyPI build after A whose numbers change the way B's do")
    g.add_argument("--no-bisect", action="store_true",
                   help="history: compare the builds given, do not bisect the changes between them")
    g.add_argument("--lengths", default="256,511", help="history: kld prompt lengths (default: %(default)s)")
    g.add_argument("--reps", type=int, default=2, help="history: kld prompts per (length, depth) (default: %(default)s)")
    g.add_argument("--needle-length", type=int, default=4096,
                   help="history: needle recall at this length per build, 0 for none (default: %(default)s)")


def parse_builds(text: str | None, available) -> list[int]:
    """Build numbers from --builds; `available()` lists PyPI's (asked only for spread:K)."""
    if not text:
        return []
    if text.startswith("spread:"):
        try:
            k = int(text.split(":", 1)[1])
        except ValueError:
            raise CommandError(f"--builds {text}: spread:K needs a number of builds", 2) from None
        pool = available()
        if k < 2 or k > len(pool):
            raise CommandError(f"--builds {text}: K must be 2..{len(pool)} (PyPI has {len(pool)} V4 builds)", 2)
        return sorted({pool[round(i * (len(pool) - 1) / (k - 1))] for i in range(k)})
    try:
        return sorted({int(x.strip().lstrip("b")) for x in text.split(",") if x.strip()})
    except ValueError:
        raise CommandError(f"--builds {text}: give build numbers such as 9905,10502 or spread:8", 2) from None


def parse_bisect(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    try:
        a, b = (int(x.strip().lstrip("b")) for x in text.split(".."))
    except ValueError:
        raise CommandError(f"--bisect {text}: give two builds as A..B, e.g. 9905..10502", 2) from None
    if a >= b:
        raise CommandError(f"--bisect {text}: A must be an earlier build than B", 2)
    return a, b


def run(args, src: Path) -> int:
    from fidelity.llamacpp import builds as B
    from fidelity.llamacpp import history as H
    from fidelity.llamacpp import history_report as R
    from fidelity.llamacpp import paths
    pool_cache: list[int] = []

    def available() -> list[int]:
        if not pool_cache:
            try:
                pool_cache.extend(B.available())
            except B.BuildsError as e:
                raise CommandError(str(e), 2) from None
        return pool_cache

    bis = parse_bisect(args.bisect)
    numbers = parse_builds(args.builds or (None if bis else DEFAULT_BUILDS), available)
    too_early = [n for n in numbers + list(bis or ()) if n < B.FIRST_V4]
    if too_early:
        raise CommandError(f"b{too_early[0]} predates DeepSeek-V4 in llama.cpp (first: b{B.FIRST_V4})", 2)
    out = Path(args.out or "reports") / "llamacpp-history"
    s = H.Settings(src, lengths=args.lengths, reps=args.reps,                 # F32: the graph, not Q8_0 rounding
                   needle_length=args.needle_length, threads=args.threads or 1)
    try:
        h = H.History(out, s)
    except paths.NotBuilt as e:
        raise CommandError(f"{e} (the history widens the checkpoint into the pinned build's folder)", 2) from None
    pairs = h.timeline(numbers) if numbers else []
    R.write(h)
    todo = [tuple(p["key"]) for p in pairs if p["kind"] != "identical"] if not args.no_bisect else []
    if bis:
        todo.append(bis)
    for a, b in todo:
        res = h.bisect(available(), a, b)
        print(res.get("sentence") or res.get("reason"))
        if res.get("ok") and res.get("change"):
            h.localise(*res["change"])
            h.cause(*res["change"])
        R.write(h)
    print(R.headline(h))
    print(f"report: {out / R.REPORT / 'index.html'}")
    return 0
