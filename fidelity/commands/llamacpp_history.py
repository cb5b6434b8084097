"""`fidelity llamacpp history`: llama.cpp's builds from PyPI scored one by one against the
golden and against its twin, adjacent builds compared with each other, each change bisected
to two neighbouring PyPI builds and placed at its first tensor (fidelity.llamacpp.history).
Resumes from <out>/llamacpp-history/history.jsonl; the report is rewritten after each build."""
from __future__ import annotations

from pathlib import Path

from fidelity.errors import CommandError

from . import engine_history as E

DEFAULT_BUILDS = "spread:8"


def add_arguments(g):
    E.add_arguments(g, "--builds", "build", "9905,10502,11434", DEFAULT_BUILDS, 4096)


def _number(text: str) -> int:
    try:
        return int(text.lstrip("b"))
    except ValueError:
        raise ValueError("give build numbers such as 9905,10502 or spread:8") from None


def parse_builds(text: str | None, available) -> list[int]:
    """Build numbers from --builds; `available()` lists PyPI's (asked only for spread:K)."""
    return sorted(E.parse_keys(text, available, _number, "--builds", "build"))


def parse_bisect(text: str | None) -> tuple[int, int] | None:
    return E.parse_bisect(text, _number, lambda a, b: a < b, "9905..10502", "build")


def run(args, src: Path) -> int:
    from fidelity.history import report as R
    from fidelity.llamacpp import builds as B
    from fidelity.llamacpp import history as H
    from fidelity.llamacpp import paths
    available = E.listed_once(B.available, B.BuildsError)

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
    return E.run(h, R, numbers, bis, available, args.no_bisect, place=h.localise)
