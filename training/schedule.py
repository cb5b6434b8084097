"""What changes with the step: the learning rate (warm-up, cosine, cool-down) and the
length of a batch's prompts (the dense or the sparse phase's range)."""
from __future__ import annotations

import math


def lr_at(step, total, peak, warmup, steps=None, cooldown=0):
    """Linear warm-up, cosine to 10% at `total`, then (optional) a linear cool-down to 10%
    of that over the last `cooldown` of `steps`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    lr = peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)))
    if cooldown and steps is not None and step >= steps - cooldown:
        lr *= 1 - 0.9 * (step - (steps - cooldown) + 1) / cooldown
    return lr


def length_at(step, a, rng):
    """Training length of a batch: uniform in the phase's range."""
    lo, hi = a.dense_len if step < a.dense_steps else a.sparse_len
    return rng.randint(lo, hi)
