"""What `fidelity llamacpp history` and `fidelity mlxvlm history` share (fidelity.history):
the release selection (a list, or spread:K over what PyPI has), --bisect A..B, and the run --
the timeline, each change bisected, placed and attributed, the report rewritten after each step."""
from __future__ import annotations

from pathlib import Path

from fidelity.errors import CommandError


def add_arguments(g, flag: str, unit: str, example: str, default: str, needle_length: int):
    g.add_argument(flag, default=None, metavar="A,B|spread:K",
                   help=f"history: {unit}s (e.g. {example}), or spread:K for K {unit}s evenly spaced over PyPI's "
                        f"DeepSeek-V4 {unit}s, first and last included (default: {default}, or none with --bisect)")
    g.add_argument("--bisect", default=None, metavar="A..B",
                   help=f"history: the first PyPI {unit} after A whose numbers change the way B's do")
    g.add_argument("--no-bisect", action="store_true",
                   help=f"history: compare the {unit}s given, do not bisect the changes between them")
    g.add_argument("--lengths", default="256,511", help="history: kld prompt lengths (default: %(default)s)")
    g.add_argument("--reps", type=int, default=2, help="history: kld prompts per (length, depth) (default: %(default)s)")
    g.add_argument("--needle-length", type=int, default=needle_length,
                   help=f"history: needle recall at this length per {unit}, 0 for none (default: %(default)s)")


def listed_once(fetch, error: type):
    """PyPI's releases, asked at most once (`fetch()`); its `error` becomes a CommandError."""
    pool: list = []

    def available() -> list:
        if not pool:
            try:
                pool.extend(fetch())
            except error as e:
                raise CommandError(str(e), 2) from None
        return pool
    return available


def parse_keys(text: str | None, available, one, flag: str, unit: str) -> list:
    """Keys from `flag`'s text through `one` (a ValueError: not a key); `available()` lists
    PyPI's, in order (asked only for spread:K)."""
    if not text:
        return []
    if text.startswith("spread:"):
        try:
            k = int(text.split(":", 1)[1])
        except ValueError:
            raise CommandError(f"{flag} {text}: spread:K needs a number of {unit}s", 2) from None
        pool = available()
        if k < 2 or k > len(pool):
            raise CommandError(f"{flag} {text}: K must be 2..{len(pool)} (PyPI has {len(pool)} V4 {unit}s)", 2)
        return list(dict.fromkeys(pool[round(i * (len(pool) - 1) / (k - 1))] for i in range(k)))
    try:
        return list(dict.fromkeys(one(x.strip()) for x in text.split(",") if x.strip()))
    except ValueError as e:
        raise CommandError(f"{flag} {text}: {e}", 2) from None


def parse_bisect(text: str | None, one, later, example: str, unit: str) -> tuple | None:
    """(A, B) from --bisect A..B; `later(a, b)`: whether b comes after a."""
    if not text:
        return None
    try:
        a, b = (one(x.strip()) for x in text.split(".."))
    except ValueError:
        raise CommandError(f"--bisect {text}: give two {unit}s as A..B, e.g. {example}", 2) from None
    if not later(a, b):
        raise CommandError(f"--bisect {text}: A must be an earlier {unit} than B", 2)
    return a, b


def run(h, report, keys: list, bis: tuple | None, available, no_bisect: bool, place=None, more=None) -> int:
    """The timeline of `keys`, each change between adjacent ones bisected (unless no_bisect)
    and `bis` too; at each change point the engine's `cause` and `place` (where the two part)
    run, then the engine's `more` bisections; the report (fidelity.history.report) rewritten
    after each step."""
    pairs = h.timeline(keys) if keys else []
    report.write(h)
    todo = [tuple(p["key"]) for p in pairs if p["kind"] != "identical"] if not no_bisect else []
    if bis:
        todo.append(bis)
    for a, b in todo:
        res = h.bisect(available(), a, b)
        print(res.get("sentence") or res.get("reason"))
        if res.get("ok") and res.get("change"):
            if place:
                place(*res["change"])
            h.cause(*res["change"])
        report.write(h)
    if more and not no_bisect:
        for line in more():
            print(line)
            report.write(h)
    print(report.headline(h))
    print(f"report: {Path(h.out) / report.REPORT / 'index.html'}")
    return 0
