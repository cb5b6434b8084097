"""An arm computed here rather than served: the reference model under a toggle arm, with
the whole vocabulary known at every position (so KL against it is exact), a greedy decode
ladder, and the same captures a served arm returns. Used as the baseline when the served
model is one we can run (the embedded model or --checkpoint)."""
from __future__ import annotations

import numpy as np
import torch

from reference_model import Model
from reference_model.schedule import ONESHOT
from reference_model.taps import Taps

from .bounds import Known
from .dialects import PromptScores, Request

CAPTURE_TAPS = ["layers.*.attn.index.topk", "layers.*.ffn.router.experts"]


def capture_shape(cfg) -> dict:
    """What the captures of a model with this config look like (as an endpoint's
    /get_model_info says): known without loading the model."""
    return {"indexer_layers": [i for i, r in enumerate(cfg.compress_ratios) if r == 4],
            "index_topk": cfg.index_topk, "num_hidden_layers": cfg.n_layers,
            "num_experts_per_tok": cfg.n_activated_experts}


class InProcessScorer:
    """Scores prompts on an arm computed here (see the module docstring)."""

    kind = "inprocess"

    def __init__(self, name: str, numerics, weights, label: str | None = None, devices=None,
                 schedule=ONESHOT, weight_cache: dict | None = None):
        """`weight_cache`: converted weights shared by the scorers of one run (Model's), so
        several arms over one checkpoint hold one copy per compute dtype."""
        self.name, self.label = name, label or name
        self.model = Model(weights, numerics, devices=devices, schedule=schedule, weight_cache=weight_cache)
        cfg = weights.cfg
        self.shape = capture_shape(cfg)
        self.csa = self.shape["indexer_layers"]
        self.n_layers = cfg.n_layers

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "arm": self.label}

    @staticmethod
    def _full(logits: torch.Tensor) -> list[Known]:
        lp = torch.log_softmax(logits.double(), -1).numpy()
        ids = np.arange(lp.shape[-1])
        return [Known(ids, row) for row in lp]

    def score(self, ids: list[int], req: Request) -> PromptScores:
        taps = Taps(CAPTURE_TAPS) if req.captures else None
        logits, st = self.model.extend(torch.tensor(ids), None, "all", taps)
        known = self._full(logits)
        n = len(ids)
        actual = [float(known[j].logp[ids[j + 1]]) for j in range(n - 1)] + [None]
        ladder, toks = [known[-1]], []
        for t in range(req.steps):
            toks.append(int(np.argmax(ladder[-1].logp)))
            if t < req.steps - 1:
                lg, st = self.model.extend(torch.tensor([toks[-1]]), st, "last", taps)
                ladder += self._full(lg)
        s = PromptScores(list(ids), known, actual, [None] * n, toks, ladder)
        if taps is not None:
            s.indexer = torch.stack([taps[f"layers.{i}.attn.index.topk"] for i in self.csa], 1).numpy()
            s.experts = torch.stack([taps[f"layers.{i}.ffn.router.experts"]
                                     for i in range(self.n_layers)], 1).numpy()
        return s
