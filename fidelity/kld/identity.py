"""Is the server serving this checkpoint's model at all? Asked before any numerics verdict.

A provider's "deepseek-v4-flash" that is another model (anomalyco/opencode#40409: it said it
was V3.2), or a route that now serves a newer revision, makes every KLD huge -- read as a
numerics bug it sends a team bisecting kernels for weeks. One short probe prompt, scored by the
baseline (the golden) and by each endpoint: a numerics change, however broken, keeps most of
the golden's top-1 tokens and a small KL (calibrated in bench/bench_identity.py: the worst
registered toggle and every planted engine bug stay far inside both bars); another model's
weights do not. Both bars crossed: ModelMismatch, with the numbers and the name the server
gave, before any arm is scored. Non-finite answers are left to the verdict (a NaN is a bug of
this model, not another model)."""
from __future__ import annotations

import numpy as np

from fidelity.scores.bounds import compare
from fidelity.scores.dialects import Request

PROBE_TOKENS = 64
MISMATCH_TOP1 = 0.5          # same top-1 as the golden on fewer than half the positions ...
MISMATCH_KL = 1.0            # ... and a mean KL(golden || served) lower bound above 1 nat
PROBE_K = 20


class ModelMismatch(RuntimeError):
    pass


def probe(base, arm, ids: list[int], k: int = PROBE_K) -> dict:
    """Mean KL lower bound and same-top-1 share of `arm` against `base` over `ids`."""
    req = Request(k=k, steps=1)
    b, a = base.score(ids, req), arm.score(ids, req)
    rows = [compare(p, q, None) for p, q in zip(b.known, a.known)]
    fin = [r for r in rows if not r["nonfinite"]]
    return {"positions": len(rows), "finite": len(fin),
            "kl_mean": float(np.mean([r["kl_lb"] for r in fin])) if fin else float("nan"),
            "same_top1": float(np.mean([bool(r["same_top1"]) for r in fin])) if fin else float("nan")}


def mismatch(p: dict) -> bool:
    return bool(p["finite"]) and p["same_top1"] < MISMATCH_TOP1 and p["kl_mean"] > MISMATCH_KL


def check_models(entries, ids: list[int], checkpoint: str) -> dict[str, dict]:
    """Probe every endpoint arm (in-process arms run this checkpoint by construction) against
    the baseline; ModelMismatch naming the first that serves another model."""
    base = next(e for e in entries if e.role == "baseline")
    out = {}
    for e in entries:
        if e is base or getattr(e.scorer, "kind", "") != "endpoint":
            continue
        out[e.name] = check_one(base.scorer, e.name, e.scorer, ids, checkpoint)
    return out


def check_one(base, name: str, scorer, ids: list[int], checkpoint: str,
              fix: str = "Point --endpoint at a server of this checkpoint, or --checkpoint at the served model's") -> dict:
    """The probe of one endpoint against the baseline's scorer; ModelMismatch when it serves
    another model (`fix`: what the user changes, in the command's own words)."""
    p = probe(base, scorer, ids[:PROBE_TOKENS])
    if mismatch(p):
        served = getattr(scorer, "model", None)
        raise ModelMismatch(
            f"{name} does not serve {checkpoint}'s model"
            + (f" (it answers as {served!r})" if served else "")
            + f": on a {p['positions']}-token probe it agrees with the golden's top-1 on {p['same_top1']:.0%} "
            f"of positions and its mean KL is {p['kl_mean']:.3g} nats (a numerics change keeps at least "
            f"{MISMATCH_TOP1:.0%} and stays under {MISMATCH_KL:g}); no numerics verdict is made. {fix}")
    return p


class Stored:
    """A baseline's stored scores of one prompt answering the probe on a prefix of it (scores
    are causal: a position's distribution reads the ids up to it), so an engine launched after
    the golden was scored and released is probed against it without loading it again."""
    kind = "stored"

    def __init__(self, scores):
        self.scores = scores

    def score(self, ids, req):
        from fidelity.scores.dialects import PromptScores
        n, s = len(ids), self.scores
        if list(s.ids[:n]) != list(ids):
            raise ValueError("the identity probe's ids are not a prefix of the baseline's stored prompt")
        return PromptScores(list(ids), s.known[:n], s.actual[:n], s.ranks[:n])


def check_live(endpoints, target, reference=None, fix: str = "Point --endpoint at a server of "
               "this checkpoint, or --checkpoint at the served model's") -> dict[str, dict]:
    """The probe for a command that reads live endpoints without a kld baseline (consistency):
    each (connected) endpoint against `reference` (an in-process scorer of this checkpoint)
    or, without one, the golden built here for the probe alone. The probe is PROBE_TOKENS
    seeded random ids: a foreign model shows on any text, and random ids share no prefix
    with the command's own prompts, so the probe warms no cache they will read.
    ModelMismatch naming the first endpoint that serves another model."""
    import torch
    if reference is None:
        from reference_model import Numerics
        from fidelity.scores.inprocess import InProcessScorer
        reference = InProcessScorer("golden", Numerics("reference"), target.weights)
    g = torch.Generator().manual_seed(PROBE_TOKENS)
    ids = torch.randint(2, target.cfg.vocab_size, (PROBE_TOKENS,), generator=g).tolist()
    return {ep.name: check_one(reference, ep.name, ep, ids, target.name, fix) for ep in endpoints}
