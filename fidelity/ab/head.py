"""The head of a lockstep pass, a chunk of positions at a time: every arm's logits for
positions [lo, hi) are computed, reduced against golden's (and each pair's reference's)
logits of the same chunk, and dropped before the next chunk. What is kept is per
position (KLD, Δp, same top-1, row sums for the relative L2, ...): O(length) per arm, not
O(length × vocab), so a 64K-token prompt of a 129K-vocabulary model costs one chunk of
logits per arm. The rows are independent, so the tables equal a whole-prompt reduction
(bit for bit for the fp64 golden; fp32 arms' logits follow their GEMM's row blocking)."""
from __future__ import annotations

import torch

from fidelity.weights.plan_devices import METRIC_ROWS          # rows reduced at once, as the memory plan sizes it

from . import metrics as M


def row_stats(ref: torch.Tensor, arm: torch.Tensor) -> dict[str, torch.Tensor]:
    """Everything the logit tables need from one chunk of (reference, arm) logits."""
    parts = []
    for lo in range(0, ref.shape[0], METRIC_ROWS):
        r, a = ref[lo:lo + METRIC_ROWS], arm[lo:lo + METRIC_ROWS]
        parts.append({**M.tensor_row_sums(r, a), **M.logit_row_stats(r, a)})
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class ChunkedHead:
    """Per-position logit statistics of each arm against golden and of each pair, built
    chunk by chunk; `last` is golden's last-position logits (the next greedy token)."""

    def __init__(self, golden: str, pairs: dict[str, str], vocab: int):
        self.golden, self.pairs, self.vocab = golden, pairs, vocab
        self._parts: dict[tuple[str, str], list[dict]] = {}
        self.last: torch.Tensor | None = None
        self.n = 0

    def add(self, logits: dict[str, torch.Tensor]) -> None:
        g = logits[self.golden]
        todo = [(a, self.golden) for a in logits if a != self.golden]
        todo += [(a, ref) for a, ref in self.pairs.items() if a in logits and ref in logits]
        for a, ref in todo:
            self._parts.setdefault((a, ref), []).append(row_stats(logits[ref], logits[a]))
        self.last = g[-1]
        self.n += g.shape[0]

    def rows(self, arm: str, ref: str) -> dict[str, torch.Tensor]:
        parts = self._parts[(arm, ref)]
        return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.vocab)


def run_head(models: dict, streams: dict, golden: str, pairs: dict[str, str], chunk: int,
             vocab: int) -> ChunkedHead:
    """`models[a].head` over `streams[a]` for every arm, `chunk` positions at a time."""
    out = ChunkedHead(golden, pairs, vocab)
    n = streams[golden].shape[0]
    for lo in range(0, n, chunk):
        out.add({a: models[a].head(h[lo:lo + chunk]) for a, h in streams.items()})
    return out


def position_stat_bytes() -> int:
    """Bytes kept per position and arm (what the memory plan's POSITION_STAT_BYTES says)."""
    s = row_stats(torch.zeros(1, 2), torch.zeros(1, 2))
    return sum(t.element_size() for t in s.values())
