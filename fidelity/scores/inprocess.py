"""An arm computed here rather than served: the reference model under a toggle arm, with
the whole vocabulary known at every position (so KL against it is exact), a greedy decode
ladder, and the same captures a served arm returns, plus what no engine returns: the
indexer's scores at the last prompt position per CSA layer (`index_scores`, for the
selection margins of fidelity.kld.margins). Used as the baseline when the served model is
one we can run (the embedded model or --checkpoint).

The per-position distributions are `HeadRows`: the head runs over a chunk of positions
when a row of it is first read, so a long prompt never holds [tokens, vocab] log-probs
(the score store keeps the top ids of each row as it iterates)."""
from __future__ import annotations

import numpy as np
import torch

from collections.abc import Sequence

from reference_model import build_model
from reference_model.schedule import ONESHOT
from reference_model.taps import Taps

from .bounds import Known
from .dialects import PromptScores, Request

LAST_SCORES = "attn.index.last_scores"
CAPTURE_TAPS = ["layers.*.attn.index.topk", "layers.*.ffn.router.experts", f"layers.*.{LAST_SCORES}"]
# the selection margins need the question's score row alone: only the newest chunk's is kept
LATEST_TAPS = [f"layers.*.{LAST_SCORES}"]


def last_score_rows(taps: Taps, csa: list[int]) -> np.ndarray:
    """(CSA layers, entries) float64: each layer's indexer scores at the last position the
    taps saw, -inf where an entry is not visible, padded with -inf to the widest layer (a
    layer with no compressed entry yet has no tap: all -inf)."""
    rows = [taps.last(f"layers.{i}.{LAST_SCORES}")[-1].double().numpy()
            if f"layers.{i}.{LAST_SCORES}" in taps else np.zeros(0) for i in csa]
    out = np.full((len(csa), max((len(r) for r in rows), default=0)), -np.inf)
    for c, r in enumerate(rows):
        out[c, :len(r)] = r
    return out


def capture_shape(cfg) -> dict:
    """What the captures of a model with this config look like (as an endpoint's
    /get_model_info says): known without loading the model."""
    return {"indexer_layers": cfg.indexer_layers(), "compress_ratios": list(cfg.compress_ratios),
            "index_topk": cfg.index_topk, "num_hidden_layers": cfg.n_layers,
            "num_experts_per_tok": cfg.n_activated_experts}


class HeadRows(Sequence):
    """Known log-probs per position, from the final residual streams `H` (Model.extend's
    'hidden'), computed `chunk` positions at a time: the current chunk is the only one
    held. Slices are lazy views; iteration walks the chunks in order."""

    def __init__(self, model, H: torch.Tensor, chunk: int, start: int = 0, stop: int | None = None,
                 cache: list | None = None):
        self.model, self.H, self.chunk = model, H, chunk
        self.start, self.stop = start, H.shape[0] if stop is None else stop
        self._cache = cache if cache is not None else [None, None]     # [chunk start, rows], shared by views

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, j):
        if isinstance(j, slice):
            a, b, step = j.indices(len(self))
            if step != 1:
                return [self[i] for i in range(a, b, step)]
            return HeadRows(self.model, self.H, self.chunk, self.start + a, self.start + max(a, b), self._cache)
        if j < 0:
            j += len(self)
        if not 0 <= j < len(self):
            raise IndexError(j)
        j += self.start
        a = j - j % self.chunk
        if self._cache[0] != a:
            self._cache[:] = [None, None]                       # drop the old chunk first
            self._cache[:] = [a, InProcessScorer._full(self.model.head(self.H[a:a + self.chunk]))]
        return self._cache[1][j - a]


class InProcessScorer:
    """Scores prompts on an arm computed here (see the module docstring)."""

    kind = "inprocess"

    def __init__(self, name: str, numerics, weights, label: str | None = None, devices=None,
                 schedule=ONESHOT, weight_cache: dict | None = None, model=None):
        """`weight_cache`: converted weights shared by the scorers of one run (Model's), so
        several arms over one checkpoint hold one copy per compute dtype. `model`: one built
        already (a fidelity.pipeline.model.PipelineModel under --distributed)."""
        self.name, self.label = name, label or name
        self.model = model or build_model(weights, numerics, devices=devices, schedule=schedule,
                                          weight_cache=weight_cache)
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
        taps = Taps(CAPTURE_TAPS, latest=LATEST_TAPS) if req.captures else None
        H, st = self.model.extend(torch.tensor(ids), None, "hidden", taps)
        # read before the ladder's decode steps replace them with their own rows
        last_scores = last_score_rows(taps, self.csa) if taps is not None else None
        known = HeadRows(self.model, H, self.model.chunk_tokens)
        n = len(ids)
        actual = [float(k.logp[t]) for k, t in zip(known, ids[1:])] + [None]
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
            s.index_scores = last_scores
        return s
