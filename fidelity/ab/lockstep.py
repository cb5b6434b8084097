"""Lockstep runner: every arm runs layer i before any arm runs layer i+1, so each layer's
weights are fetched once (a streamed checkpoint holds one layer at a time) and metrics
for layer i are reduced against golden before its activations are dropped.

Modes: `propagated` (each arm feeds itself: total drift) and `isolated` (each arm's layer
i gets golden's input to layer i: that layer's own error). Prefill, then N teacher-forced
decode steps on golden's greedy tokens, so decode-only kernels are measured too.

Besides every arm against golden, `pairs` compares chosen arms directly with another arm
(e.g. engine + bug against engine): the two are bit-identical until the bug first acts,
so that comparison places it exactly. For needle prompts the indexer's picks at the
question (the last prompt token) are checked for the needle's compressed entries."""
from __future__ import annotations

import fnmatch
import math
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import torch

from needle.haystack import needle_entries
from reference_model import Numerics, Taps, build_model
from reference_model.schedule import ONESHOT, Schedule

from ..design.prompts import Prompt
from . import metrics as M
from .head import ChunkedHead, run_head
from .margins import margin_fields
from .runner_settings import DEFAULT_TAPS, Chunking, RunnerSettings, RunSite  # noqa: F401 (DEFAULT_TAPS: its API)

MODES = ("propagated", "isolated")
LAST_SCORES = "attn.index.last_scores"   # selection margins only (margins.py), never compared



@dataclass(frozen=True)
class LockstepArm:
    """One arm of a lockstep run: its numerics, the toggles attribution credits, its role."""
    name: str
    numerics: Numerics
    toggles: frozenset = frozenset()
    role: str = "arm"                   # "golden", "floor" or "arm"
    weights: object | None = None       # another checkpoint of the same architecture (None: the run's)
    schedule: Schedule = ONESHOT        # how its prompts are fed (chunks, a cache hit, decode path)


@dataclass
class LockstepResult:
    drift: list[dict] = field(default_factory=list)     # one row per tap/arm/layer/phase/bucket
    kld: list[dict] = field(default_factory=list)       # final-logit KLD per position
    events: list[dict] = field(default_factory=list)    # non-finite values, arm failures
    kept: dict = field(default_factory=dict)            # (prompt, arm, tap) -> tensor
    pairs: list[dict] = field(default_factory=list)     # drift of an arm vs another arm
    pair_kld: list[dict] = field(default_factory=list)  # final-logit KLD of an arm vs another arm
    needle: list[dict] = field(default_factory=list)    # needle entry picked at the question

    def extend(self, other: "LockstepResult") -> None:
        for name in ("drift", "kld", "events", "pairs", "pair_kld", "needle"):
            getattr(self, name).extend(getattr(other, name))
        self.kept.update(other.kept)


def position_buckets(n: int, window: int) -> list[tuple[str, int, int]]:
    """Context-position buckets: [0, window), then ×4 each: [window, 4w), [4w, 16w), ..."""
    edges = [0, window]
    while edges[-1] < n:
        edges.append(edges[-1] * 4)
    out = []
    for a, b in zip(edges, edges[1:]):
        if a < n:
            out.append((f"{a}-{min(b, n) - 1}", a, min(b, n)))
    return out


def _layer_of(tap: str) -> int:
    parts = tap.split(".")
    return int(parts[1]) if parts[0] == "layers" else -1


def _short(tap: str) -> str:
    parts = tap.split(".")
    return ".".join(parts[2:]) if parts[0] == "layers" else tap


def compare_tap(tap: str, golden: torch.Tensor, arm: torch.Tensor,
                spans: list[tuple[int, int]]) -> list[dict]:
    """Metrics appropriate to the tap's kind, for each row span."""
    if tap.endswith("index.topk"):
        return M.set_metrics_rows(golden, arm, spans)
    if tap.endswith("router.experts"):
        return M.expert_agreement_rows(golden, arm, spans)
    return M.tensor_metrics_rows(golden, arm, spans)


@dataclass
class _PromptRun:
    """One prompt's progress through a layer-major run: every arm's state, the arms still
    alive, the next greedy token, and its own rows."""
    prompt: Prompt
    states: dict
    alive: list
    bad: set = field(default_factory=set)
    tokens: torch.Tensor | None = None
    next: int = 0
    res: LockstepResult = field(default_factory=LockstepResult)
    parts: list = field(default_factory=list)       # (phase index, rows of that phase)


class StreamStore:
    """Residual streams of every prompt and arm between layers. Kept in memory up to
    `budget` bytes (None = no limit); beyond it a prompt's streams wait on disk (a
    temporary directory removed by clear()), so many long prompts fit in one pass."""

    def __init__(self, budget: int | None = None):
        self.budget = budget
        self.mem: dict[str, dict] = {}
        self.bytes = 0
        self.dir: str | None = None
        self.files: dict[str, str] = {}
        self.spilled = 0                      # how many times streams went to disk

    @staticmethod
    def _size(h: dict) -> int:
        return sum(t.numel() * t.element_size() for t in h.values())

    def put(self, key: str, h: dict) -> None:
        size = self._size(h)
        if self.budget is None or self.bytes + size <= self.budget:
            self.mem[key] = h
            self.bytes += size
            return
        if self.dir is None:
            self.dir = tempfile.mkdtemp(prefix="fidelity-streams-")
        self.spilled += 1
        path = self.files[key] = os.path.join(self.dir, f"{self.spilled}.pt")
        torch.save({a: t.cpu() for a, t in h.items()}, path)

    def get(self, key: str) -> dict:
        if key in self.mem:
            h = self.mem.pop(key)
            self.bytes -= self._size(h)
            return h
        path = self.files.pop(key)
        h = torch.load(path, weights_only=True)
        os.remove(path)
        return h

    def clear(self) -> None:
        self.mem.clear()
        self.files.clear()
        self.bytes = 0
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None


class LockstepRunner:
    def __init__(self, weights, arms: list[LockstepArm], settings: RunnerSettings = RunnerSettings(),
                 pairs: dict[str, str] | None = None, site: RunSite = RunSite(),
                 chunking: Chunking = Chunking()):
        """`settings`' devices ("cpu",) mean no placement (build_model's default)."""
        mode, decode_steps, keep, stage = settings.mode, settings.decode_steps, settings.keep, site.stage
        chunk_tokens, head_chunk = chunking.tokens, chunking.head
        devices = list(settings.devices) if settings.devices != ("cpu",) else None
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; valid: {', '.join(MODES)}")
        if not arms or arms[0].role != "golden":
            raise ValueError("the first arm must be the golden arm (role='golden')")
        names = [a.name for a in arms]
        if len(set(names)) != len(names):
            raise ValueError(f"arm names must be unique, got {names}")
        unknown = sorted({*(pairs or {}), *(pairs or {}).values()} - set(names))
        if unknown:
            raise ValueError(f"pairs name arms that are not in the run: {unknown}")
        self.pairs = dict(pairs or {})
        self.stage = stage                     # a fidelity.pipeline.stage.Stage: only its layers run here
        self.layers = stage.layers if stage is not None else range(weights.cfg.n_layers)
        self.weights = weights
        self.cfg = weights.cfg
        self.arms = arms
        self.mode = mode
        self.decode_steps = decode_steps
        self.patterns = list(settings.taps) + list(keep) + [f"layers.*.{LAST_SCORES}"]
        self.keep = list(keep)
        self.progress = site.progress or (lambda msg: None)
        for a in arms:
            diff = weights.cfg.differences(a.weights.cfg) if a.weights is not None else []
            if diff:
                raise ValueError(f"arm {a.name}: its checkpoint is another architecture "
                                 f"(config differs in {', '.join(diff)})")
        caches: dict = {}                      # arms on one checkpoint share converted weights
        self.models = {a.name: build_model(a.weights or weights, a.numerics, chunk_tokens=chunk_tokens,
                                           weight_cache=caches.setdefault(id(a.weights or weights), {}),
                                           devices=devices, schedule=a.schedule) for a in arms}
        self.streams = StreamStore(settings.activation_budget)
        # positions per head call (fidelity.ab.head): the layers' chunk by default, so an
        # fp32 arm's head sees the row blocks its layers saw
        self.head_chunk = head_chunk or chunk_tokens
        if self.head_chunk < 1:
            raise ValueError(f"head_chunk must be a positive number of positions, got {head_chunk}")

    # ------------------------------------------------------------------------------------
    def run(self, prompts: list[Prompt]) -> LockstepResult:
        """All prompts through each layer before the next layer (layer-major): a streamed
        checkpoint's layer is fetched once per pass for every prompt and arm, not once per
        prompt. Rows come out in prompt order, as if the prompts had run one by one. On a
        pipeline stage (fidelity.pipeline) this rank runs its own layers only; every rank
        returns the whole run's rows."""
        ids = [p.id for p in prompts]
        if len(set(ids)) != len(ids):
            raise ValueError(f"prompt ids must be unique, got {ids}")
        if self.stage is not None and prompts:
            from fidelity.pipeline.stage import weights_mode
            from fidelity.weights.plan import PassSpec
            self.stage.check_memory(self.cfg, PassSpec(max(p.length for p in prompts) + self.decode_steps,
                                                       len(prompts), len(self.arms), weights_mode(self.weights)))
        from fidelity.pipeline.stage import stage_state
        runs = [_PromptRun(p, {a.name: stage_state(self.models[a.name], self.stage) for a in self.arms},
                           [a.name for a in self.arms]) for p in prompts]
        phases = [("prefill", -1)] + [("decode", s) for s in range(self.decode_steps)]
        try:
            for k, (phase, step) in enumerate(phases):
                for r in runs:
                    r.tokens = (r.prompt.tokens if phase == "prefill"
                                else torch.tensor([r.next], device=r.prompt.tokens.device))
                self._streams_in(runs, phase, step)
                self._pass(runs, phase, step)
                self._streams_out(runs, phase, step)
                for r in runs:                            # this phase's rows, in stage order later
                    r.parts.append((k, r.res))
                    r.res = LockstepResult()
        finally:
            self.streams.clear()                      # spilled streams never outlive the run
        return self._collect(runs)

    def _streams_in(self, runs, phase, step):
        """The residual streams entering this stage's first layer: the embedding on the
        first stage, the previous stage's output (and which arms are alive) on the others."""
        st = self.stage
        for r in runs:
            if st is None or st.first:
                self.streams.put(r.prompt.id, {a: self.models[a].embed(r.tokens) for a in r.alive})
                continue
            meta, hs = st.recv_streams(f"{r.prompt.id} {phase} streams")
            r.alive, r.bad = list(meta["alive"]), set(meta["bad"])
            self._carry_in(r, meta["carried"])
            self.streams.put(r.prompt.id, dict(zip(r.alive, hs)))

    def _streams_out(self, runs, phase, step):
        """To the next stage; or, on the last, the head, its rows and the next greedy token
        (which every stage then learns, with the arms still alive)."""
        st = self.stage
        if st is not None and not st.last:
            for r in runs:
                H = self.streams.get(r.prompt.id)
                st.send_streams({"alive": r.alive, "bad": sorted(r.bad), "carried": self._carried(r)},
                                [H[a] for a in r.alive], f"{r.prompt.id} {phase} streams")
        else:
            for r in runs:
                head = self._head(r, phase)
                self._logit_rows(r.prompt, head, r.alive, phase, step, r.res)
                r.next = int(head.last.argmax())
        if st is not None:
            sync = st.from_last({r.prompt.id: (r.next, r.alive, sorted(r.bad), self._carried(r)) for r in runs},
                                f"the next tokens after {phase}")
            for r in runs:
                r.next, r.alive, r.bad = sync[r.prompt.id][0], list(sync[r.prompt.id][1]), set(sync[r.prompt.id][2])
                self._carry_in(r, sync[r.prompt.id][3])

    @staticmethod
    def _carried(r) -> dict:
        """Each arm's sequence-level fields after this stage (fidelity.pipeline.stage.carried)."""
        from fidelity.pipeline.stage import carried
        return {a: carried(r.states[a]) for a in r.alive}

    @staticmethod
    def _carry_in(r, fields: dict) -> None:
        from fidelity.pipeline.stage import carry_in
        for a, f in fields.items():
            carry_in(r.states[a], f)

    def _collect(self, runs) -> LockstepResult:
        """Every stage's rows of every prompt: per prompt, phase by phase, in stage order
        (= layer order, the head last), as one process appends them."""
        parts = {r.prompt.id: [(k, 0, res) for k, res in r.parts] for r in runs}
        if self.stage is not None:
            gathered = self.stage.gather({pid: [(k, res) for k, _, res in v] for pid, v in parts.items()},
                                         "the run's rows")
            parts = {pid: [(k, rank, res) for rank, g in enumerate(gathered) for k, res in g[pid]]
                     for pid in parts}
        out = LockstepResult()
        for r in runs:
            for _, _, res in sorted(parts[r.prompt.id], key=lambda x: (x[0], x[1])):
                out.extend(res)
        return out

    def _pass(self, runs, phase, step):
        """This stage's layers for every prompt and arm, layer i before layer i+1; residual
        streams wait in the stream store (in memory, or on disk beyond the activation budget)."""
        t0, layers = time.monotonic(), self.layers
        for n, i in enumerate(layers, 1):
            for r in runs:
                H = self.streams.get(r.prompt.id)
                self._layer(r, i, H, phase, step)
                self.streams.put(r.prompt.id, H)
            el = time.monotonic() - t0
            self.progress(f"  {phase}{'' if step < 0 else f' step {step + 1}'}: layer {i + 1}/{self.cfg.n_layers} "
                          f"for {len(runs)} prompt(s), {el:.0f} s, eta {el / n * (len(layers) - n):.0f} s")
        for r in runs:
            for a in r.alive:
                r.states[a].pos += r.tokens.numel()          # as Model.extend does after its layers

    def _layer(self, r, i, H, phase, step):
        golden, prompt, res = self.arms[0].name, r.prompt, r.res
        g_in = H[golden]
        taps = {}
        for a in list(r.alive):
            taps[a] = Taps(self.patterns)
            x_in = g_in if (self.mode == "isolated" and a != golden) else H[a]
            try:
                H[a] = self.models[a].layer(i, x_in, r.tokens, r.states[a], taps[a], phase)
            except Exception as e:                       # an arm must not kill the run
                if a == golden:
                    raise
                res.events.append({"prompt": prompt.id, "arm": a, "phase": phase, "step": step,
                                   "layer": i, "event": "error", "detail": f"{type(e).__name__}: {e}"})
                r.alive.remove(a)
                H.pop(a, None)
        self._tap_rows(r, taps, phase, step, res)
        self._pair_rows(prompt, taps, r.alive, phase, step, res)
        if phase == "prefill" and prompt.needle_tokens:
            self._needle_rows(prompt, i, taps, r.alive, res)

    def _head(self, r, phase) -> ChunkedHead:
        """Every arm's logits, `head_chunk` positions at a time, reduced on the fly."""
        H = self.streams.get(r.prompt.id)
        rows = {a: H[a] if phase == "prefill" else H[a][-1:] for a in r.alive}
        pairs = {a: ref for a, ref in self.pairs.items() if a in rows and ref in rows}
        return run_head(self.models, rows, self.arms[0].name, pairs, self.head_chunk,
                        self.cfg.vocab_size)

    def _tap_rows(self, r: _PromptRun, taps, phase, step, res):
        prompt, alive, bad = r.prompt, r.alive, r.bad
        golden = self.arms[0].name
        gt = taps[golden]
        for a in alive:
            for name in gt.names():
                if name not in taps[a] or name.endswith(LAST_SCORES):
                    continue
                ga, aa = gt[name], taps[a][name]
                if any(fnmatch.fnmatchcase(name, k) for k in self.keep):
                    res.kept[(prompt.id, a, phase, step, name)] = aa
                if a == golden:
                    continue
                if aa.is_floating_point() and a not in bad and not bool(torch.isfinite(aa).all()):
                    bad.add(a)
                    res.events.append({"prompt": prompt.id, "arm": a, "phase": phase, "step": step,
                                       "layer": _layer_of(name), "event": "non-finite",
                                       "detail": f"first non-finite value at tap {name}"})
                buckets = self._buckets(ga.shape[0], phase, prompt)
                mets = compare_tap(name, ga, aa, [(lo, hi) for _, lo, hi in buckets])
                for (label, _, _), m in zip(buckets, mets):
                    res.drift.append({"prompt": prompt.id, "group": prompt.group,
                                      "length": prompt.length, "arm": a, "phase": phase,
                                      "step": step, "layer": _layer_of(name), "tap": _short(name),
                                      "bucket": label, **m})

    def _pair_rows(self, prompt, taps, alive, phase, step, res):
        for a, ref in self.pairs.items():
            if a not in alive or ref not in alive:
                continue
            for name in taps[ref].names():
                if name in taps[a] and not name.endswith(LAST_SCORES):
                    m = compare_tap(name, taps[ref][name], taps[a][name], [(0, taps[ref][name].shape[0])])[0]
                    res.pairs.append({"prompt": prompt.id, "group": prompt.group, "arm": a, "vs": ref,
                                      "phase": phase, "step": step, "layer": _layer_of(name),
                                      "tap": _short(name), "bucket": "all", **m})

    def _needle_rows(self, prompt, i, taps, alive, res):
        """Was one of the needle's compressed entries among layer i's picks at the question?"""
        name = f"layers.{i}.attn.index.topk"
        golden = self.arms[0].name
        if name not in taps[golden]:
            return
        held = needle_entries(prompt.needle_tokens, prompt.length - 1)
        if not held:
            return
        g = set(taps[golden][name][-1].tolist())
        scores = f"layers.{i}.{LAST_SCORES}"
        for a in alive:
            if name in taps[a]:
                picks = set(taps[a][name][-1].tolist())
                margins = (margin_fields(taps[golden].last(scores)[-1], taps[a].last(scores)[-1], held,
                                         self.cfg.index_topk) if scores in taps[a] else {})
                res.needle.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                   "arm": a, "layer": i, "golden_picked": bool(g & set(held)),
                                   "picked": bool(picks & set(held)), "entries": len(held), **margins})

    def _buckets(self, n_rows, phase, prompt):
        """All rows, and in prefill also the context-position buckets (a per-token tensor)."""
        rows = [("all", 0, n_rows)]
        if phase == "prefill" and n_rows == prompt.length:
            rows += position_buckets(prompt.length, self.cfg.window_size)
        return rows

    def _logit_rows(self, prompt, head: ChunkedHead, alive, phase, step, res):
        golden = self.arms[0].name
        pos0 = 0 if phase == "prefill" else prompt.length + step
        spans = self._buckets(head.n, phase, prompt)
        for a in alive:
            if a == golden:
                continue
            rows = head.rows(a, golden)
            for j, v in enumerate(rows["kld"].tolist()):
                res.kld.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                "arm": a, "phase": phase, "step": step, "position": pos0 + j,
                                "kld": v if math.isfinite(v) else math.inf})
            rel = M.tensor_metrics_from_rows(rows, [(lo, hi) for _, lo, hi in spans], head.shape)
            for (label, lo, hi), r in zip(spans, rel):
                m = M.logits_summary({k: rows[k][lo:hi] for k in ("kld", "dp", "same", "finite")})
                res.drift.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                  "arm": a, "phase": phase, "step": step, "layer": self.cfg.n_layers,
                                  "tap": "logits", "bucket": label, "rel_l2": r["rel_l2"], **m})
        for a, ref in self.pairs.items():
            if a in alive and ref in alive:
                rows = head.rows(a, ref)
                for j, v in enumerate(rows["kld"].tolist()):
                    res.pair_kld.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                         "arm": a, "vs": ref, "phase": phase, "step": step,
                                         "position": pos0 + j, "kld": v if math.isfinite(v) else math.inf})
                m = M.tensor_metrics_from_rows(rows, [(0, head.n)], head.shape)[0]
                res.pairs.append({"prompt": prompt.id, "group": prompt.group, "arm": a, "vs": ref,
                                  "phase": phase, "step": step, "layer": self.cfg.n_layers,
                                  "tap": "logits", "bucket": "all", **m})
