"""Two llama.cpp builds compared with each other, not with the golden: the distributions each
served for the same prompts (kld's score store, paired by prompt and request), the GGUF each
build's converter wrote, and -- at a change point -- the tensors each computes on the same
ids, so a change is placed at its first tensor.

A build pair's KL is judged against the reduction-order floors of its twin: the KL between
the twin and the same twin with another accumulation or tie order, prompt by prompt. A change
below them is what a re-associated kernel does; one above them changes what is computed."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fidelity.kld.bounds import compare
from fidelity.kld.store import ScoreStore
from fidelity.verdict.attribution import bootstrap_mean_ci

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


METHOD = 2     # what a stored pair was computed by (1: prompt positions only); a change recomputes it


def prompt_kl(a, b) -> tuple[float, bool]:
    """Mean KL(A || B) lower bound over a prompt's teacher-forced positions and its greedy
    decode ladder up to where the two builds' greedy tokens part (later steps read other
    text): where the answer is produced; (nan, True) when a side's distribution is non-finite."""
    same = next((t for t, (x, y) in enumerate(zip(a.ladder_tokens, b.ladder_tokens)) if x != y),
                min(len(a.ladder_tokens), len(b.ladder_tokens)))
    steps = range(1, min(len(a.ladder), len(b.ladder), same + 1))       # ladder[0]: the last prompt position
    pairs = list(zip(a.known, b.known)) + [(a.ladder[t], b.ladder[t]) for t in steps]
    kl = [compare(p, q, None)["kl_lb"] for p, q in pairs]
    bad = bool(np.isnan(kl).any())
    return (float("nan") if bad else float(np.mean(kl))), bad


@dataclass
class PairDiff:
    """Build A vs build B over the prompts both scored."""
    a: str
    b: str
    prompts: int = 0
    identical: int = 0
    kl: tuple = (0.0, 0.0, 0.0)                # mean [lo, hi] over prompts of KL(A || B)
    floor: tuple = (0.0, 0.0, 0.0)             # the same of the twin's largest reduction-order floor
    beyond: int = 0                            # prompts whose KL exceeds their own floor
    nonfinite: int = 0
    worst: dict = field(default_factory=dict)  # the prompt furthest above its floor

    @property
    def kind(self) -> str:
        if self.prompts and self.identical == self.prompts:
            return IDENTICAL
        if self.nonfinite or self.kl[1] > self.floor[2]:
            return BEYOND
        return WITHIN

    def sentence(self) -> str:
        n = self.prompts
        if not n:
            return f"{self.a} and {self.b} share no scored prompt"
        if self.kind == IDENTICAL:
            return f"{self.b} serves bit-identical distributions to {self.a} on all {n} prompts"
        ci = f"{self.kl[0]:.3g} [{self.kl[1]:.3g}, {self.kl[2]:.3g}]"
        floor = f"the twin's reduction-order floor {self.floor[0]:.3g} (upper {self.floor[2]:.3g})"
        nf = f"; non-finite on {self.nonfinite} prompts" if self.nonfinite else ""
        return (f"{self.b} differs from {self.a} {self.kind}: mean KL {ci} over {n} prompts (n={n}) vs "
                f"{floor}; {self.beyond} of {n} prompts above their own floor{nf}")

    def record(self) -> dict:
        return {"method": METHOD, "a": self.a, "b": self.b, "prompts": self.prompts, "identical": self.identical,
                "kl": list(self.kl), "floor": list(self.floor), "beyond": self.beyond,
                "nonfinite": self.nonfinite, "worst": self.worst, "kind": self.kind, "sentence": self.sentence()}


def floors_by_prompt(store: ScoreStore) -> dict[str, float]:
    """Per prompt: the largest KL between the twin and its reduction-order variants."""
    tw = stored_prompts(store, TWIN)
    out: dict[str, float] = {}
    for arm in TWIN_FLOORS:
        for (prompt, key), _ in stored_prompts(store, arm).items():
            if (prompt, key) in tw:
                kl, _ = prompt_kl(store.get(TWIN, prompt, key), store.get(arm, prompt, key))
                out[prompt] = max(out.get(prompt, 0.0), kl)
    return out


def pair(store: ScoreStore, a: str, b: str, floors: dict[str, float] | None = None,
         n_boot: int = 1000) -> PairDiff:
    """Arms `a` and `b` (two builds) compared prompt by prompt on what both scored."""
    floors = floors_by_prompt(store) if floors is None else floors
    sa, sb = stored_prompts(store, a), stored_prompts(store, b)
    d = PairDiff(a, b)
    kls, fl, worst = [], [], (-1.0, None)
    for prompt, key in sorted(set(sa) & set(sb)):
        x, y = store.get(a, prompt, key), store.get(b, prompt, key)
        d.prompts += 1
        bad = False
        if _same(x, y):
            d.identical += 1
            kls.append(0.0)
        else:
            kl, bad = prompt_kl(x, y)
            d.nonfinite += bad
            kls.append(0.0 if bad else kl)
        f = floors.get(prompt, 0.0)
        fl.append(f)
        d.beyond += bad or kls[-1] > f
        ratio = kls[-1] / f if f > 0 else (np.inf if kls[-1] > 0 else 0.0)
        if ratio > worst[0]:
            worst = (ratio, {"prompt": prompt, "kl": kls[-1], "floor": f, "x_floor": ratio})
    if d.prompts:
        d.kl = bootstrap_mean_ci(kls, n_boot)
        d.floor = bootstrap_mean_ci(fl, n_boot)
        d.worst = worst[1] or {}
    return d


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def tensor_diff(dump_a: dict[str, np.ndarray], dump_b: dict[str, np.ndarray], order: list[str]) -> dict:
    """Two builds' dumped tensors on the same ids, in graph order (`order`: build B's names):
    the first tensor that is not bit-identical (with its relative L2 difference), the tensors
    one build has and the other does not."""
    common = [n for n in order if n in dump_a]
    first = None
    for n in common:
        x, y = dump_a[n].astype(np.float64), dump_b[n].astype(np.float64)
        if x.shape != y.shape:
            first = {"tensor": n, "why": f"shape {x.shape} then, {y.shape} now"}
            break
        if not np.array_equal(x, y, equal_nan=True):
            den = np.linalg.norm(x) or 1.0
            first = {"tensor": n, "rel": float(np.linalg.norm(x - y) / den), "why": "values"}
            break
    return {"compared": len(common), "first": first,
            "only_a": sorted(set(dump_a) - set(dump_b)), "only_b": sorted(set(dump_b) - set(dump_a))}


def gguf_diff(path_a: Path, path_b: Path, gguf_py: Path) -> dict:
    """Two GGUF files compared (with the gguf-py of a build, `gguf_py`): the metadata keys
    added, dropped or changed (the chat template named, not quoted) and the tensors whose
    type, shape or values differ -- where a converter's change is, when the files differ."""
    import sys
    if str(gguf_py) not in sys.path:
        sys.path.insert(0, str(gguf_py))
    from gguf import GGUFReader
    a, b = GGUFReader(str(path_a)), GGUFReader(str(path_b))

    def meta(r) -> dict:
        out = {}
        for k, f in r.fields.items():
            if k.startswith("GGUF."):
                continue
            try:
                out[k] = f.contents()
            except Exception:                                   # a type this gguf-py cannot render
                out[k] = bytes(f.parts[-1]).hex() if f.parts else None
        return out
    ma, mb = meta(a), meta(b)
    words = lambda v: (str(v)[:80] + "...") if len(str(v)) > 80 else v  # noqa: E731
    changed = {k: [words(ma.get(k)), words(mb.get(k))] for k in sorted(set(ma) | set(mb)) if ma.get(k) != mb.get(k)}
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    tensors = []
    for n in sorted(set(ta) & set(tb)):
        x, y = ta[n], tb[n]
        if x.tensor_type != y.tensor_type or list(x.shape) != list(y.shape):
            tensors.append(f"{n}: {x.tensor_type.name} {list(x.shape)} then, {y.tensor_type.name} {list(y.shape)} now")
        elif not np.array_equal(np.asarray(x.data), np.asarray(y.data)):
            tensors.append(f"{n}: values")
    return {"metadata": changed, "tensors": tensors, "only_a": sorted(set(ta) - set(tb)),
            "only_b": sorted(set(tb) - set(ta))}


def gguf_words(d: dict) -> str:
    """A GGUF difference in one line."""
    added = [k for k, (x, y) in d["metadata"].items() if x is None]
    dropped = [k for k, (x, y) in d["metadata"].items() if y is None]
    changed = [k for k, (x, y) in d["metadata"].items() if x is not None and y is not None]
    parts = [f"metadata added: {', '.join(added)}" if added else "", f"dropped: {', '.join(dropped)}" if dropped else "",
             f"changed: {', '.join(changed)}" if changed else "",
             f"{len(d['tensors'])} tensors differ ({'; '.join(d['tensors'][:3])})" if d["tensors"] else "tensors identical"]
    if d["only_a"] or d["only_b"]:
        parts.append(f"tensors only before: {len(d['only_a'])}, only after: {len(d['only_b'])}")
    return "; ".join(p for p in parts if p)
