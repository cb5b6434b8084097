"""Two releases of an engine compared with each other, not with the golden: the distributions
each served for the same prompts (kld's score store, paired by prompt and request).

A pair is judged as `fidelity kld` judges an arm, on the same two signals (KL over the prompt,
KL where the answer is produced) and against the reduction-order floors of the twin -- the twin
against itself with another accumulation or tie order, prompt by prompt: by the per-prompt tail
test (a few prompts far above their own floors; fidelity.verdict.tail) and by the means'
intervals. A change below the floors is what a re-associated kernel does; one above them
changes what is computed."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from fidelity.scores.bounds import compare
from fidelity.scores.store import ScoreStore
from fidelity.verdict import tail
from fidelity.verdict.attribution import bootstrap_mean_ci
from fidelity.verdict.signals import FLOOR_EPS

TWIN, TWIN_FLOORS = "twin", ("twin~floor:fp32-accum", "twin~floor:tie-order")
IDENTICAL, WITHIN, BEYOND = "identical", "within the floors", "beyond the floors"


def stored_prompts(store: ScoreStore, arm: str) -> dict[tuple[str, str], Path]:
    """(prompt id, request key) -> file, for an arm's complete scores."""
    out = {}
    for f in sorted((store.root / arm).glob("*.npz")):
        if f.stem.endswith("-nocaptures"):
            continue
        prompt, key = f.stem.rsplit("-", 1)
        out[(prompt, key)] = f
    return out


def _same(a, b) -> bool:
    return all(np.array_equal(x.ids, y.ids) and np.array_equal(x.logp, y.logp, equal_nan=True)
               for x, y in zip(a.known + a.ladder, b.known + b.ladder)) and \
        len(a.known) == len(b.known) and len(a.ladder) == len(b.ladder)


METHOD = 3     # what a stored pair was computed by (1: prompt positions only, 2: one mean over
               # prompt and answer); a change recomputes it
SIGNALS = ("kld_mean", "answer_kld")


def prompt_kl(a, b) -> tuple[dict[str, float], bool]:
    """Per prompt, KL(A || B) lower bound as `fidelity kld`'s verdict reads it: kld_mean over
    the teacher-forced prompt positions, answer_kld where the answer is produced (the last
    prompt position and the greedy decode ladder up to where the two builds' greedy tokens
    part: later steps read other text); ({signal: nan}, True) when a side is non-finite."""
    same = next((t for t, (x, y) in enumerate(zip(a.ladder_tokens, b.ladder_tokens)) if x != y),
                min(len(a.ladder_tokens), len(b.ladder_tokens)))
    steps = range(1, min(len(a.ladder), len(b.ladder), same + 1))       # ladder[0]: the last prompt position
    prompt = [compare(p, q, None)["kl_lb"] for p, q in zip(a.known, b.known)]
    answer = prompt[-1:] + [compare(a.ladder[t], b.ladder[t], None)["kl_lb"] for t in steps]
    bad = bool(np.isnan(prompt).any() or np.isnan(answer).any())
    nan = float("nan")
    return {"kld_mean": nan if bad else float(np.mean(prompt)),
            "answer_kld": nan if bad else float(np.mean(answer))}, bad


@dataclass
class SignalDiff:
    """One signal of build A vs build B over the prompts both scored, with the twin's floors."""
    kl: tuple = (0.0, 0.0, 0.0)                # mean [lo, hi] over prompts of KL(A || B)
    floor: tuple = (0.0, 0.0, 0.0)             # the same of the twin's largest reduction-order floor
    beyond: int = 0                            # prompts above their own floor
    broken: int = 0                            # prompts at least tail.BROKEN x their own floor
    p_value: float = 1.0                       # the verdict's per-prompt tail test (Markov-binomial)
    worst: dict = field(default_factory=dict)  # the prompt furthest above its floor

    @property
    def named(self) -> bool:
        """Beyond the floors as the verdict judges an arm: the per-prompt tail test names it
        (a few prompts far above their own floors), or the mean's interval clears the floors'."""
        return (self.broken > 0 and self.p_value < tail.ALPHA) or self.kl[1] > self.floor[2]


@dataclass
class PairDiff:
    """Build A vs build B over the prompts both scored, signal by signal."""
    a: str
    b: str
    prompts: int = 0
    identical: int = 0
    nonfinite: int = 0
    signals: dict = field(default_factory=dict)       # signal -> SignalDiff

    @property
    def kind(self) -> str:
        if self.prompts and self.identical == self.prompts:
            return IDENTICAL
        if self.nonfinite or any(d.named for d in self.signals.values()):
            return BEYOND
        return WITHIN

    def lead(self) -> tuple[str, SignalDiff]:
        """The signal that decides (named, furthest above its floor), else kld_mean."""
        named = [(k, d) for k, d in self.signals.items() if d.named]
        if named:
            return max(named, key=lambda kd: kd[1].worst.get("x_floor", 0.0))
        return "kld_mean", self.signals.get("kld_mean", SignalDiff())

    def sentence(self) -> str:
        n = self.prompts
        if not n:
            return f"{self.a} and {self.b} share no scored prompt"
        if self.kind == IDENTICAL:
            return f"{self.b} serves bit-identical distributions to {self.a} on all {n} prompts"
        sig, d = self.lead()
        ci = f"{d.kl[0]:.3g} [{d.kl[1]:.3g}, {d.kl[2]:.3g}]"
        w = d.worst
        worst = (f"; worst {w['prompt']}: {w['kl']:.3g}, {w['x_floor']:.3g}x its floor" if w else "")
        tail_words = (f"; {d.broken} of {n} prompts at >= {tail.BROKEN:g}x their own floor "
                      f"(p <= {d.p_value:.2g})" if d.broken else f"; {d.beyond} of {n} prompts above their own floor")
        nf = f"; non-finite on {self.nonfinite} prompts" if self.nonfinite else ""
        return (f"{self.b} differs from {self.a} {self.kind}: {sig} {ci} (mean over n={n} prompts) vs the "
                f"twin's reduction-order floor {d.floor[0]:.3g} (upper {d.floor[2]:.3g}){tail_words}{worst}{nf}")

    def record(self) -> dict:
        sig, d = self.lead()
        return {"method": METHOD, "a": self.a, "b": self.b, "prompts": self.prompts, "identical": self.identical,
                "nonfinite": self.nonfinite, "lead": sig, "kl": list(d.kl), "floor": list(d.floor),
                "beyond": d.beyond, "worst": d.worst,
                "signals": {k: {**asdict(v), "named": v.named} for k, v in self.signals.items()},
                "kind": self.kind, "sentence": self.sentence()}


def floors_by_prompt(store: ScoreStore) -> dict[str, dict[str, float]]:
    """Per signal and prompt: the largest KL between the twin and its reduction-order
    variants (at least the signal's FLOOR_EPS, as the verdict clips its floors)."""
    tw = stored_prompts(store, TWIN)
    out: dict[str, dict[str, float]] = {k: {} for k in SIGNALS}
    for arm in TWIN_FLOORS:
        for (prompt, key), _ in stored_prompts(store, arm).items():
            if (prompt, key) in tw:
                kl, _ = prompt_kl(store.get(TWIN, prompt, key), store.get(arm, prompt, key))
                for k in SIGNALS:
                    out[k][prompt] = max(out[k].get(prompt, FLOOR_EPS[k]), kl[k])
    return out


def pair(store: ScoreStore, a: str, b: str, floors: dict | None = None, n_boot: int = 1000) -> PairDiff:
    """Arms `a` and `b` (two releases) compared prompt by prompt on what both scored."""
    floors = floors_by_prompt(store) if floors is None else floors
    sa, sb = stored_prompts(store, a), stored_prompts(store, b)
    d = PairDiff(a, b)
    values: dict[str, list[float]] = {k: [] for k in SIGNALS}
    names = []
    for prompt, key in sorted(set(sa) & set(sb)):
        x, y = store.get(a, prompt, key), store.get(b, prompt, key)
        d.prompts += 1
        names.append(prompt)
        if _same(x, y):
            d.identical += 1
            kl = {k: 0.0 for k in SIGNALS}
        else:
            kl, bad = prompt_kl(x, y)
            d.nonfinite += bad
        for k in SIGNALS:
            values[k].append(kl[k])
    if d.prompts:
        d.signals = {k: _signal(values[k], [floors[k].get(p, FLOOR_EPS[k]) for p in names], names, n_boot)
                     for k in SIGNALS}
    return d


def _signal(v: list[float], f: list[float], names: list[str], n_boot: int) -> SignalDiff:
    """One signal's judgement: the means' intervals and the verdict's per-prompt tail test
    (a non-finite prompt counts as broken)."""
    v, f = np.asarray(v, float), np.asarray(f, float)
    ratio = np.where(np.isnan(v), np.inf, v / f)
    finite = np.nan_to_num(v, nan=0.0)
    i = int(np.argmax(ratio))
    return SignalDiff(kl=bootstrap_mean_ci(finite, n_boot), floor=bootstrap_mean_ci(f, n_boot),
                      beyond=int((ratio > 1).sum()), broken=int((ratio >= tail.BROKEN).sum()),
                      p_value=tail.p_value(ratio, len(v)),
                      worst={"prompt": names[i], "kl": float(v[i]), "floor": float(f[i]), "x_floor": float(ratio[i])})
