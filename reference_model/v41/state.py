"""DeepSeek-V4.1's sequence state between calls (docs/v41-architecture.md §5.7): what each
layer owns (window; KV sources' compressed cache, open group and index keys; index sources'
per-call top-k; the candidate source's blocks) and the Engram history."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class V41LayerState:
    """One layer's state. Every layer keeps its window; KV sources own the compressed cache,
    the open ratio-2 group and the index keys (read by the layers after them); index
    sources keep their top-k picks, and the candidate source its block mask, for the layers
    after them in the same call (keyed by the chunk's first position)."""
    window_kv: torch.Tensor | None = None          # last (window-1) KV rows, oldest first
    comp_kv: torch.Tensor | None = None            # KV source: compressed entries [n, head_dim]
    pending: tuple | None = None                   # KV source, ratio 2: (K, G) fp32 of the open group
    n_groups: int = 0                              # KV source: entries emitted so far
    index_keys: torch.Tensor | None = None         # KV source: index keys [n, index_head_dim]
    fresh: bool = False                            # KV source: emitted entries in the current chunk
    topk: dict = field(default_factory=dict)       # index source: chunk start -> picks [c, index_topk]
    blocks: dict = field(default_factory=dict)     # candidate source: chunk start -> kept blocks [c, nb]


@dataclass
class V41SequenceState:
    layers: list[V41LayerState]
    pos: int = 0                                   # tokens already processed
    engram_hist: torch.Tensor | None = None        # compressed id per absolute position (Engram)
    key_writer: int | None = None                  # KV source that emitted index keys last (D1)

    @classmethod
    def empty(cls, cfg) -> "V41SequenceState":
        return cls([V41LayerState() for _ in range(cfg.n_layers)])
