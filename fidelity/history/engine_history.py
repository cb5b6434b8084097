"""One engine's history on the common frame (package doc): the ledger, kld's score store,
each release scored, adjacent releases compared, a change bisected. An engine supplies how a
release is named (`label`), ordered (`order`), made ready (`ready`: build, convert, install --
its own ledger stages) and served (`serving`); optionally a cheaper first guess for a bisection
(`shortcut`: llama.cpp's converter, bisected without compiling).

Every stage of every release is one ledger line appended as it finishes; a rerun does only what
is missing. A release that cannot be made ready, served or scored is a line with its reason:
the table names it, nothing skips it silently."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fidelity.errors import CLEAN, FLAGGED
from fidelity.scores.store import ScoreStore

from . import pairs
from .kld_record import read_kld
from .ledger import Ledger, failure_reason

REPO = Path(__file__).resolve().parents[2]


@dataclass
class Settings:
    """What each release is scored on (the same for every release of one history)."""
    checkpoint: Path
    lengths: str = "256,511"
    reps: int = 2
    steps: int = 4
    top_k: int = 512
    needle_length: int = 4096             # 0: no needle
    needle_reps: int = 2
    threads: int = 1

    def record(self) -> dict:
        """The settings as the page shows them (a path inside the repository relative to it)."""
        return {k: _shown(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def _shown(p: Path) -> str:
    p = Path(p).resolve()
    return str(p.relative_to(REPO)) if p.is_relative_to(REPO) else str(p)


class EngineHistory:
    ENGINE = "engine"                     # as sentences name it
    UNIT = "release"                      # what one key is: a build, a release
    READY = ()                            # (stage, word): the engine's stages before scoring, in order
    REPLAYS = False                       # whether a change point is placed tensor by tensor ("localised")
    AXIS = "release"                      # the timeline's x axis
    BISECT_HINT = ""                      # the page's command for a bisection
    SERVE_ERRORS: tuple = ()              # what `serving` raises when a release does not start (its
                                          # message is the reason the ledger keeps)

    def __init__(self, out: Path, s: Settings, progress=print):
        self.out, self.s, self.say = Path(out), s, progress
        self.ledger = Ledger(self.out / "history.jsonl")
        self.store = ScoreStore(self.out / "kld" / "scores")
        self.ck = Path(s.checkpoint)

    # -- the engine's part ----------------------------------------------------------------------
    def label(self, key) -> str:
        """The release's name: its kld arm, run id and table row."""
        return str(key)

    def order(self, keys) -> list:
        return sorted(keys)

    def ready(self, key) -> bool:
        """Run the engine's missing READY stages; True when the release can be served."""
        return True

    def serving(self, key, log: Path, ctx: int):
        """A context manager yielding the root URL of the release's server (SERVE_ERRORS)."""
        raise NotImplementedError

    def extra_args(self, key) -> list[str]:
        """More `fidelity kld` / `fidelity needle` arguments for this release (its twin)."""
        return []

    def shortcut(self, span: list, changed) -> tuple[dict | None, dict, str]:
        """A cheaper first guess at a bisection (found record or None, what the ledger keeps of
        the guess, words to add when the guess was not the change)."""
        return None, {}, ""

    def pair_extras(self, a, b) -> dict:
        """What else the ledger keeps of a compared pair (llama.cpp: the GGUFs' difference)."""
        return {}

    # -- the engine's part of the page (fidelity.history.report) ---------------------------------
    def describe(self) -> str:
        """What was compared, in one paragraph."""
        return ""

    def row_columns(self, items: list[dict]) -> list[dict]:
        """The engine's own columns of the releases table, one dict per timeline item."""
        return [{} for _ in items]

    def pair_columns(self, p: dict) -> dict:
        """The engine's own columns of the pairs table, for one ledger pair."""
        return {}

    def findings(self) -> list[str]:
        """The engine's own change points beside the numbers' (mlx-vlm: where its loader stops
        loading DeepSeek's checkpoint), one sentence each, for the headline and the page."""
        return []

    def marks(self) -> list[tuple]:
        """The engine's own change points as (before, after, label) for the timeline picture."""
        return []

    def whose(self, cause: dict | None) -> str:
        """Whose change a change point is, from its ledger "cause" line ('' unknown)."""
        return (cause or {}).get("who", "") if (cause or {}).get("ok") else ""

    # -- one release ------------------------------------------------------------------------
    def run_build(self, key, needle: bool = True) -> dict:
        """Every stage of one release that is not in the ledger yet (the needle only when asked:
        a bisection's probes need the KLD alone); the release's summary."""
        if not self.ready(key):
            return self.summary(key)
        need_kld = self.ledger.get("scored", key) is None
        need_needle = needle and self.s.needle_length and self.ledger.get("needle", key) is None
        if need_kld or need_needle:
            ctx = max([int(x) for x in self.s.lengths.split(",")] + [self.s.needle_length]) + 512
            log = self.out / "logs" / f"server-{self.label(key)}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            try:
                with self.serving(key, log, ctx) as url:
                    if need_kld:
                        self._score(key, url)
                    if need_needle:
                        self._needle(key, url)
            except self.SERVE_ERRORS as e:
                for stage, need in (("scored", need_kld), ("needle", need_needle)):
                    if need:
                        self.ledger.add(stage, key, ok=False, reason=f"serve: {failure_reason(str(e))}")
        return self.summary(key)

    def _fidelity(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fidelity.cli", *args, "--threads", str(self.s.threads)],
                              capture_output=True, text=True, cwd=REPO)

    def _score(self, key, url: str) -> None:
        name, s = self.label(key), self.s
        self.say(f"{name}: fidelity kld against the golden and against the twin")
        start = time.monotonic()
        r = self._fidelity("kld", "--arm", "golden=golden", "--endpoint", f"{name}={url}",
                           "--checkpoint", str(self.ck), "--lengths", s.lengths, "--reps", str(s.reps),
                           "--decode-steps", str(s.steps), "--top-k", str(s.top_k), "--no-captures",
                           *self.extra_args(key), "--out", str(self.out), "--run-id", name, "--quiet")
        if r.returncode not in (CLEAN, FLAGGED):     # FLAGGED is a verdict, not a failure
            self.ledger.add("scored", key, ok=False, reason="kld: " + failure_reason(r.stderr))
            return
        self.ledger.add("scored", key, ok=True, seconds=round(time.monotonic() - start, 1),
                        **read_kld(self.out / "kld", name))

    def _needle(self, key, url: str) -> None:
        name, s = self.label(key), self.s
        self.say(f"{name}: fidelity needle at {s.needle_length} tokens")
        r = self._fidelity("needle", "--arm", "golden=golden", "--endpoint", f"{name}={url}",
                           "--checkpoint", str(self.ck), "--lengths", str(s.needle_length),
                           "--depths", "10,50,90", "--reps", str(s.needle_reps), "--out", str(self.out),
                           "--run-id", "needle", "--quiet", "--no-plots")
        if r.returncode not in (CLEAN, FLAGGED):     # FLAGGED is a verdict, not a failure
            self.ledger.add("needle", key, ok=False, reason="needle: " + failure_reason(r.stderr))
            return
        t = json.loads((self.out / "needle" / "needle" / "summary.json").read_text())["tables"]["arms"]
        rec = {a["arm"]: [a["recall"], a["ci_low"], a["ci_high"], a.get("n")] for a in t}
        self.ledger.add("needle", key, ok=True, length=s.needle_length, recall=rec.get(name),
                        golden=rec.get("golden"))

    def scored(self, key) -> bool:
        r = self.ledger.get("scored", key)
        return bool(r and r["ok"])

    def summary(self, key) -> dict:
        return {st: self.ledger.get(st, key) for st in (*(s for s, _ in self.READY), "scored", "needle")}

    # -- releases against each other --------------------------------------------------------
    def compare(self, a, b) -> dict:
        """Releases a and b compared (once; the ledger keeps it)."""
        got = self.ledger.get("pair", [a, b])
        if got is None or got.get("method") != pairs.METHOD:      # a pair computed another way: again
            d = pairs.pair(self.store, self.label(a), self.label(b), self._floors())
            got = self.ledger.add("pair", [a, b], **self.pair_extras(a, b), **d.record())
        return got

    def _floors(self) -> dict:
        if not hasattr(self, "_floor_cache"):
            self._floor_cache = pairs.floors_by_prompt(self.store)
        return self._floor_cache

    def asked(self) -> list:
        """The releases of the timeline (asked for, over every run), not a bisection's probes."""
        return self.order({n for r in self.ledger.all("timeline") for n in r["numbers"]})

    def timeline(self, keys: list) -> list[dict]:
        """Every release run, then every adjacent pair of scored releases compared (over the
        releases every run of this history asked for)."""
        keys = self.order(set(keys))
        self.ledger.add("timeline", keys, numbers=self.order(set(keys) | set(self.asked())))
        for n in keys:
            self.run_build(n)
        ok = [n for n in self.asked() if self.scored(n)]        # adjacent over every run's releases
        return [self.compare(a, b) for a, b in zip(ok, ok[1:])]

    def bisect(self, candidates: list, a, b) -> dict:
        """The first release after `a` (up to `b`, both in `candidates`, in release order)
        whose numbers differ from a's in the way b's do (bit for bit, or beyond the floors when
        b's difference is beyond them). The engine's shortcut is tried first. Releases that
        fail are stepped over, as git bisect skip does. The ledger keeps the result."""
        key = [a, b]
        got = self.ledger.get("bisect", key)
        if got is not None:
            return got
        la, lb = self.label(a), self.label(b)
        for n in (a, b):
            self.run_build(n, needle=False)
            if not self.scored(n):
                return self.ledger.add("bisect", key, ok=False, reason=f"{self.label(n)} could not be scored")
        ends = self.compare(a, b)
        if ends["kind"] == pairs.IDENTICAL:
            return self.ledger.add("bisect", key, ok=True, change=None, tested=[a, b],
                                   sentence=f"{la} and {lb} serve bit-identical distributions: nothing to bisect")
        want_beyond = ends["kind"] == pairs.BEYOND

        def changed(kind: str) -> bool:
            return kind == pairs.BEYOND if want_beyond else kind != pairs.IDENTICAL
        span = candidates[candidates.index(a):candidates.index(b) + 1]
        found, kept, not_it = self.shortcut(span, changed)
        if found is not None:
            return self.ledger.add("bisect", key, ok=True, **found, **kept)
        lo, hi, probed, skipped = self._first_change(span, self._scorable,
                                                     lambda n: changed(self.compare(a, n)["kind"]))
        before, after = span[lo], span[hi]
        change = self.compare(before, after)
        adjacent = hi - lo == 1
        lb0, la1 = self.label(before), self.label(after)
        words = (f"the first {self.UNIT} that changes after {la} is {la1} ({lb0} -> {la1}: {change['sentence']})"
                 if adjacent else
                 f"the change lies between {lb0} and {la1}; {self.UNIT}s between them failed "
                 f"({', '.join(self.label(n) for n in skipped)})")
        return self.ledger.add("bisect", key, ok=True, change=[before, after], adjacent=adjacent, via="engine",
                               tested=self.order({a, b, *probed}), skipped=skipped, **kept,
                               sentence=words + not_it)

    def _scorable(self, key) -> bool:
        self.run_build(key, needle=False)
        return self.scored(key)

    def _first_change(self, span: list, usable, differs) -> tuple[int, int, list, list]:
        """Binary search of `span` (span[0] as it was, span[-1] changed) for the first entry that
        `differs`, stepping over entries not `usable` as git bisect skip does: the indices of
        the last unchanged and the first changed entry, the entries probed, and the entries
        skipped between those two. Every bisection of a history (the numbers, llama.cpp's
        converter, mlx-vlm's loader) is this search with its own two questions."""
        lo, hi, probed, failed = 0, len(span) - 1, [], []
        while hi - lo > 1:
            probe = self._first_passing(span, (lo + hi) // 2, lo, hi, failed, usable)
            if probe is None:
                break
            probed.append(span[probe])
            if differs(span[probe]):
                hi = probe
            else:
                lo = probe
        return lo, hi, probed, [n for n in failed if lo < span.index(n) < hi]

    @staticmethod
    def _first_passing(span, mid, lo, hi, failed, ok) -> int | None:
        """`mid` when ok(its release), else the nearest index between lo and hi whose release is
        (failures are kept in `failed` and stepped over, as git bisect skip does)."""
        for i in sorted(range(lo + 1, hi), key=lambda i: (abs(i - mid), i)):
            if span[i] in failed:
                continue
            if ok(span[i]):
                return i
            failed.append(span[i])
        return None

