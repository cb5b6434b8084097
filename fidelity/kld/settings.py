"""The one definition of `fidelity kld`'s settings and defaults: the CLI's options and
help, the engines spec's `[run.kld]` defaults and the docs read them from here, so they
cannot disagree. Split by concern: which prompts (PromptGrid), how they are scored and
judged (KldSettings), how requests are sent (HttpSettings)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PromptGrid:
    """The built-in needle haystacks: every (length, depth) `reps` times (fidelity.design.prompts)."""
    lengths: tuple[int, ...] = (250, 511, 1023)   # prompt lengths in tokens
    depths: tuple[float, ...] = (10, 50, 90)      # needle depths in percent
    reps: int = 1                                 # prompts per (length, depth), different needles
    seed: int = 0                                 # seed of the prompts (and of the bootstrap)


@dataclass
class KldSettings:
    """Scoring and judging (stored in the manifest's `settings`)."""
    k: int = 20                     # top-k per position asked of every endpoint
    steps: int = 8                  # greedy decode ladder length
    exact: bool = False             # arms also score the baseline's own top ids
    exact_k: int = 64               # how many of the baseline's top ids per position (sglang)
    captures: bool = True           # indexer / expert captures where an endpoint offers them
    n_boot: int = 1000
    seed: int = 0


@dataclass(frozen=True)
class HttpSettings:
    """Requests to the endpoints."""
    timeout: float = 600.0          # seconds per request attempt
    retries: int = 4                # retries per request (connection errors, timeouts, 5xx, 429, malformed)
