"""Picking the next token from one row of logits under a request's sampling settings --
its own module so the decoder and the speculative verifier (spec_kernels.py) share it
without importing each other."""
from __future__ import annotations

import torch


def pick(logits: torch.Tensor, s, gen: torch.Generator | None) -> int:
    """The next token from one row of logits under the request's sampling `s`
    (generate.Sampling): one draw of `gen` when sampling, which the spec-decoding verifier
    makes through this same function."""
    if s.logit_bias:
        logits = logits.clone()
        for i, b in s.logit_bias.items():
            logits[i] += b
    if s.temperature <= 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits.double() / s.temperature, -1)
    if 0 < s.top_k < p.numel():
        kth = torch.topk(p, s.top_k).values[-1]
        p = torch.where(p >= kth, p, torch.zeros_like(p))
        p = p / p.sum()
    if s.top_p < 1.0:
        sp, si = torch.sort(p, descending=True)
        keep = (sp.cumsum(0) - sp) < s.top_p           # smallest prefix with mass >= top_p
        keep[0] = True
        p = torch.zeros_like(p).scatter(0, si[keep], sp[keep])
    return int(torch.multinomial(p, 1, generator=gen))
