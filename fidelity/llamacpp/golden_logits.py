"""The golden against llama.cpp's logits file, both ways: write the golden's distributions
for llama.cpp's own KLD tool (`llama-perplexity --kl-divergence-base golden.kld
--kl-divergence`), and score a file llama.cpp wrote (`--kl-divergence-base` on its own
model: its prefill-path distributions) against the golden, position by position, with the
same summary llama-perplexity prints (mean KLD, its 99th percentile and maximum, top-1
agreement, RMS Δp of the next token)."""
from __future__ import annotations

import numpy as np

from fidelity.scores.dialects import Request
from fidelity.scores.inprocess import InProcessScorer

from . import logits_file as F


def chunk_tokens(tokens, n_ctx: int, n_chunk: int | None = None) -> np.ndarray:
    """(n_chunk, n_ctx) from a token stream, as llama-perplexity cuts it (whole chunks only)."""
    t = np.asarray(tokens, np.int32)
    most = len(t) // n_ctx
    if most < 1 or (n_chunk is not None and n_chunk > most):
        raise ValueError(f"{len(t)} tokens make {most} chunks of {n_ctx}; {n_chunk or 1} needed")
    n = most if n_chunk is None else n_chunk
    return t[:n * n_ctx].reshape(n, n_ctx)


def evaluated(chunk: np.ndarray, bos: int | None) -> list[int]:
    """The ids llama-perplexity evaluates for a chunk: its first token replaced by BOS when
    the model adds one."""
    ids = chunk.tolist()
    if bos is not None:
        ids[0] = bos
    return ids


class GoldenRows:
    """A scorer's full-vocabulary log-probs at a chunk's scored positions."""

    def __init__(self, scorer: InProcessScorer, tokens: np.ndarray, bos: int | None):
        self.scorer, self.tokens, self.bos = scorer, tokens, bos

    def __call__(self, c: int):
        ids = evaluated(self.tokens[c], self.bos)
        known = self.scorer.score(ids, Request(k=1, steps=1)).known
        n_ctx = len(ids)
        for j in range(F.first_scored(n_ctx), n_ctx - 1):
            yield known[j].logp


def write_golden(path, scorer: InProcessScorer, tokens: np.ndarray, n_vocab: int, bos: int | None):
    """The golden's logits file for these chunks (what llama.cpp's KLD tool reads as base)."""
    return F.write(path, tokens, n_vocab, GoldenRows(scorer, tokens, bos))


def kld_rows(base: np.ndarray, other: np.ndarray) -> float:
    """KL(base ‖ other) of two log-prob rows, as llama-perplexity sums it (base entries below
    e^-16 left out)."""
    keep = base > -16.0
    p = np.exp(base[keep])
    return float(np.sum(p * (base[keep] - other[keep])))


def compare(lf: F.LogitsFile, scorer: InProcessScorer, bos: int | None) -> dict:
    """Golden (base) vs the file's distributions at every scored position: llama-perplexity's
    summary plus the per-chunk means (where along the text the departure sits)."""
    golden = GoldenRows(scorer, lf.tokens, bos)
    kl, same, dp, per_chunk = [], [], [], []
    first = F.first_scored(lf.n_ctx)
    for c in range(lf.n_chunk):
        n0 = len(kl)
        for j, (g, e) in enumerate(zip(golden(c), lf.rows(c))):
            nxt = int(lf.tokens[c, first + j + 1])
            kl.append(kld_rows(g, e))
            same.append(int(np.argmax(g)) == int(np.argmax(e)))
            dp.append(float(np.exp(e[nxt]) - np.exp(g[nxt])))
        per_chunk.append(float(np.mean(kl[n0:])))
    kl_a, dp_a = np.asarray(kl), np.asarray(dp)
    return {"positions": len(kl), "n_chunk": lf.n_chunk, "n_ctx": lf.n_ctx,
            "kld_mean": float(kl_a.mean()), "kld_p99": float(np.percentile(kl_a, 99)),
            "kld_max": float(kl_a.max()), "same_top1": float(np.mean(same)),
            "dp_rms": float(np.sqrt(np.mean(dp_a ** 2))), "kld_per_chunk": per_chunk}
