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
from dataclasses import dataclass, field
from typing import Callable

import torch

from reference_model import Model, Numerics, Taps

from . import metrics as M

MODES = ("propagated", "isolated")

# Taps compared by default: cheap enough for long contexts on a real checkpoint.
DEFAULT_TAPS = ("layers.*.attn.kv", "layers.*.attn.index.topk", "layers.*.attn.out",
                "layers.*.hc_attn.comb", "layers.*.ffn.router.experts", "layers.*.ffn.out",
                "layers.*.out")


@dataclass(frozen=True)
class Arm:
    name: str
    numerics: Numerics
    toggles: frozenset = frozenset()
    role: str = "arm"                   # "golden", "floor" or "arm"


@dataclass
class Prompt:
    id: str
    tokens: torch.Tensor
    group: str = ""                     # e.g. the length bucket it was built for
    needle_tokens: tuple[int, ...] = ()  # positions of the needle value's tokens (if any)

    @property
    def length(self) -> int:
        return int(self.tokens.numel())


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


def needle_entries(needle_tokens, pos: int, ratio: int = 4) -> list[int]:
    """Compressed entries (ratio 4, overlapping) holding a needle token and visible to the
    query at `pos`: entry j pools tokens 4j..4j+3 and, in half its channels, 4j-4..4j-1."""
    own = {t // ratio for t in needle_tokens}
    return sorted(j for j in own | {j + 1 for j in own} if j < (pos + 1) // ratio)


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


class LockstepRunner:
    def __init__(self, weights, arms: list[Arm], mode: str = "propagated", decode_steps: int = 4,
                 taps=DEFAULT_TAPS, keep=(), progress: Callable[[str], None] | None = None,
                 chunk_tokens: int = 2048, pairs: dict[str, str] | None = None):
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
        self.weights = weights
        self.cfg = weights.cfg
        self.arms = arms
        self.mode = mode
        self.decode_steps = decode_steps
        self.patterns = list(taps) + list(keep)
        self.keep = list(keep)
        self.progress = progress or (lambda msg: None)
        self.models = {a.name: Model(weights, a.numerics, chunk_tokens=chunk_tokens) for a in arms}

    # ------------------------------------------------------------------------------------
    def run(self, prompts: list[Prompt]) -> LockstepResult:
        res = LockstepResult()
        for k, p in enumerate(prompts):
            self.progress(f"  prompt {k + 1}/{len(prompts)} ({p.id}, {p.length} tokens)")
            self._run_prompt(p, res)
        return res

    def _run_prompt(self, prompt: Prompt, res: LockstepResult) -> None:
        golden = self.arms[0].name
        alive = [a.name for a in self.arms]
        states = {a: self.models[a].new_state() for a in alive}
        bad: set[str] = set()
        tokens = prompt.tokens
        H = {a: self.models[a].embed(tokens) for a in alive}
        logits = self._layers(prompt, tokens, H, states, alive, "prefill", -1, res, bad, "all")
        self._logit_rows(prompt, logits, alive, "prefill", -1, res)
        nxt = int(logits[golden][-1].argmax())
        for step in range(self.decode_steps):
            tok = torch.tensor([nxt], device=tokens.device)
            H = {a: self.models[a].embed(tok) for a in alive}
            logits = self._layers(prompt, tok, H, states, alive, "decode", step, res, bad, "last")
            self._logit_rows(prompt, logits, alive, "decode", step, res)
            nxt = int(logits[golden][-1].argmax())

    def _layers(self, prompt, tokens, H, states, alive, phase, step, res, bad, which):
        golden = self.arms[0].name
        for i in range(self.cfg.n_layers):
            g_in = H[golden]
            taps = {}
            for a in list(alive):
                taps[a] = Taps(self.patterns)
                x_in = g_in if (self.mode == "isolated" and a != golden) else H[a]
                try:
                    H[a] = self.models[a].layer(i, x_in, tokens, states[a], taps[a], phase)
                except Exception as e:                       # an arm must not kill the run
                    if a == golden:
                        raise
                    res.events.append({"prompt": prompt.id, "arm": a, "phase": phase, "step": step,
                                       "layer": i, "event": "error", "detail": f"{type(e).__name__}: {e}"})
                    alive.remove(a)
            self._tap_rows(prompt, taps, alive, phase, step, res, bad)
            self._pair_rows(prompt, taps, alive, phase, step, res)
            if phase == "prefill" and prompt.needle_tokens:
                self._needle_rows(prompt, i, taps, alive, res)
        for a in alive:
            states[a].pos += tokens.numel()          # as Model.extend does after its layers
        return {a: self.models[a].head(H[a] if which == "all" else H[a][-1:]) for a in alive}

    def _tap_rows(self, prompt, taps, alive, phase, step, res, bad):
        golden = self.arms[0].name
        gt = taps[golden]
        for a in alive:
            for name in gt.names():
                if name not in taps[a]:
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
                buckets = self._buckets(name, ga, phase, prompt)
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
                if name in taps[a]:
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
        for a in alive:
            if name in taps[a]:
                picks = set(taps[a][name][-1].tolist())
                res.needle.append({"prompt": prompt.id, "group": prompt.group, "arm": a, "layer": i,
                                   "golden_picked": bool(g & set(held)),
                                   "picked": bool(picks & set(held)), "entries": len(held)})

    def _buckets(self, name, t, phase, prompt):
        per_token = phase == "prefill" and t.dim() >= 1 and t.shape[0] == prompt.length
        rows = [("all", 0, t.shape[0])]
        if per_token:
            rows += position_buckets(prompt.length, self.cfg.window_size)
        return rows

    def _logit_rows(self, prompt, logits, alive, phase, step, res):
        golden = self.arms[0].name
        g = logits[golden]
        pos0 = 0 if phase == "prefill" else prompt.length + step
        for a in alive:
            if a == golden:
                continue
            kl = M.kld_per_position(g, logits[a])
            for j, v in enumerate(kl.tolist()):
                res.kld.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                "arm": a, "phase": phase, "step": step, "position": pos0 + j,
                                "kld": v if math.isfinite(v) else math.inf})
            spans = self._buckets("logits", g, phase, prompt)
            rel = M.tensor_metrics_rows(g, logits[a], [(lo, hi) for _, lo, hi in spans])
            for (label, lo, hi), r in zip(spans, rel):
                m = M.logits_metrics(g[lo:hi], logits[a][lo:hi])
                res.drift.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                  "arm": a, "phase": phase, "step": step, "layer": self.cfg.n_layers,
                                  "tap": "logits", "bucket": label, "rel_l2": r["rel_l2"], **m})
        for a, ref in self.pairs.items():
            if a in alive and ref in alive:
                kl = M.kld_per_position(logits[ref], logits[a])
                for j, v in enumerate(kl.tolist()):
                    res.pair_kld.append({"prompt": prompt.id, "group": prompt.group, "length": prompt.length,
                                         "arm": a, "vs": ref, "phase": phase, "step": step,
                                         "position": pos0 + j, "kld": v if math.isfinite(v) else math.inf})
                m = M.tensor_metrics(logits[ref], logits[a])
                res.pairs.append({"prompt": prompt.id, "group": prompt.group, "arm": a, "vs": ref,
                                  "phase": phase, "step": step, "layer": self.cfg.n_layers,
                                  "tap": "logits", "bucket": "all", **m})
