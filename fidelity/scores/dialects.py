"""What one scoring request per (arm, prompt) asks (Request) and what its answer is parsed
into (PromptScores: per-position known distributions), whatever the engine; each engine's
own wire format lives in its module (fidelity/servers/; docs/research/engine-integration.md §1):

  sglang   POST /generate: input_ids, return_logprob, logprob_start_len 0,
           top_logprobs_num k, token_ids_logprob (exact mode), greedy max_new_tokens N
  vllm     POST /v1/completions: token-id prompt, prompt_logprobs k (-1 = the vocabulary:
           exact mode), logprobs k, return_tokens_as_token_ids, greedy max_tokens N
  llamacpp POST /completion: teacher-forced prefixes, n_probs k
  openai   POST /v1/completions: echo + logprobs k (top-k keyed by token text; mapped back
           to ids through the tokenizer, ambiguous texts dropped)

Position j of the result is the distribution after prompt token j (predicting token j+1;
the last one predicts the first new token); the greedy continuation ("decode ladder")
follows with one distribution per new token. The engine's echo of the prompt ids is
checked: scoring a different sequence than the one sent would compare nothing."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .bounds import Known


class ScoringError(ValueError):
    """A response that cannot be scored (named: what is missing or wrong)."""


@dataclass
class PromptScores:
    """One arm's scores for one prompt, as parsed from its dialect's answer."""
    ids: list[int]                                  # the prompt, as the engine echoed it
    known: list[Known]                              # one per prompt position
    actual: list[float | None]                      # logprob of token j+1 at position j
    ranks: list[int | None]                         # its rank (vLLM only)
    ladder_tokens: list[int] = field(default_factory=list)
    ladder: list[Known] = field(default_factory=list)   # before each ladder token
    indexer: np.ndarray | None = None               # (rows, CSA layers, index_topk)
    experts: np.ndarray | None = None               # (rows, layers, experts per token)
    captures_missing: str | None = None             # why captures expected from the arm are absent
    # in-process only: the indexer's scores at the last prompt position, per CSA layer over its
    # compressed entries (-inf: not visible or padding) -- selection margins (kld/margins.py)
    index_scores: np.ndarray | None = None          # (CSA layers, entries)
    # llama.cpp only: prompt tokens the server evaluated to answer each position (1: the
    # decode path on a cached prefix; more: a prefill) -- what the teacher-forced reading read
    evaluated: np.ndarray | None = None             # (prompt positions,)


@dataclass
class Request:
    k: int                          # top-k per position
    steps: int                      # decode ladder length (greedy new tokens, >= 1)
    score_ids: tuple[int, ...] = ()  # exact mode (sglang): ids scored at every position
    full_vocab: bool = False        # exact mode (vllm): prompt_logprobs -1
    captures: bool = False
    model: str | None = None


def known_from_pairs(pairs, null_is_nan: bool = False) -> Known:
    """Known from (id, logprob) pairs; duplicate ids (the actual token also in the top-k)
    kept once. A null log-prob is left out (a first prompt token has none), or kept as NaN
    with `null_is_nan` (a server that writes non-finite logits as JSON null)."""
    d: dict[int, float] = {}
    for i, v in pairs:
        if v is not None:
            d.setdefault(int(i), float(v))
        elif null_is_nan:
            d.setdefault(int(i), float("nan"))
    ids = np.fromiter(d.keys(), dtype=np.int64, count=len(d))
    return Known(ids, np.fromiter(d.values(), dtype=np.float64, count=len(d)))
