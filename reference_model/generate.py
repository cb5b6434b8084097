"""Token generation on the golden model: prefill, then one-token decode steps, greedy or
sampled (temperature / top-p with a per-request seed), with optional logprobs. Shared by
`fidelity serve` and the in-process needle runner so both decode the same way."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .model import Model, SequenceState


@dataclass
class Generation:
    tokens: list[int]                       # generated ids (stop id not included)
    finish_reason: str                      # "stop" (eos / stop id) or "length"
    logprobs: list[float] = field(default_factory=list)          # of each generated token
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float | None] | None = None            # echo: per prompt token
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    stop_token: int | None = None


Prefill = Callable[[Model, torch.Tensor, bool], tuple[torch.Tensor, SequenceState]]


def default_prefill(model: Model, ids: torch.Tensor, all_logits: bool):
    """Run the prompt; logits of the last position ([1, V]) or of every position."""
    return model.extend(ids, None, "all" if all_logits else "last")


def _top(logp: torch.Tensor, k: int) -> list[tuple[int, float]]:
    v, i = torch.topk(logp, k)
    return [(int(a), float(b)) for a, b in zip(i, v)]


def _pick(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> int:
    if temperature <= 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        keep = (sp.cumsum(0) - sp) < top_p           # smallest prefix with mass >= top_p
        keep[0] = True
        p = torch.zeros_like(p).scatter(0, si[keep], sp[keep])
    return int(torch.multinomial(p, 1, generator=gen))


def generate(model: Model, prompt_ids, max_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int | None = None, stop_ids=(), logprobs: int | None = None,
             echo_logprobs: bool = False, prefill: Prefill = default_prefill,
             should_stop: Callable[[list[int]], bool] | None = None) -> Generation:
    """Generate up to `max_tokens` tokens after `prompt_ids`. `logprobs=k` returns each
    token's logprob (raw, before temperature: engines' `raw_logprobs`) and the top-k;
    `echo_logprobs` also scores the prompt. `should_stop(tokens)` ends early (stop strings)."""
    ids = torch.as_tensor(list(prompt_ids), dtype=torch.long)
    if max_tokens < 0:
        raise ValueError("max_tokens must be >= 0")
    stop_ids = set(stop_ids)
    gen = torch.Generator().manual_seed(int(seed)) if seed is not None else None
    if gen is None and temperature > 0:
        gen = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ()).item()))
    logits, state = prefill(model, ids, echo_logprobs)
    out = Generation([], "length")
    k = logprobs or 0
    if echo_logprobs:
        lp = torch.log_softmax(logits.double(), -1)
        out.prompt_logprobs = [None] + [float(lp[j, ids[j + 1]]) for j in range(len(ids) - 1)]
        out.prompt_top_logprobs = [None] + [_top(lp[j], k) if k else [] for j in range(len(ids) - 1)]
        logits = logits[-1:]
    step = logits[-1]
    while len(out.tokens) < max_tokens:
        tok = _pick(step, temperature, top_p, gen)
        if tok in stop_ids:
            out.finish_reason, out.stop_token = "stop", tok
            break
        if logprobs is not None:
            lp = torch.log_softmax(step.double(), -1)
            out.logprobs.append(float(lp[tok]))
            out.top_logprobs.append(_top(lp, k) if k else [])
        out.tokens.append(tok)
        if should_stop is not None and should_stop(out.tokens):
            out.finish_reason = "stop"
            break
        if len(out.tokens) >= max_tokens:
            break
        if state.pos + 1 > model.cfg.max_seq_len:
            break
        lg, state = model.extend(torch.tensor([tok]), state, "last")
        step = lg[-1]
    return out
