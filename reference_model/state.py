"""DeepSeek-V4's sequence state between calls: per layer, the window rows, the compressors'
open groups and the compressed entries / indexer keys built so far. Explicit, so decode
equals prefill and chunked equals one-shot by construction (V4.1's: v41/state.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class CompressorState:
    """Partial-window state of a compressor: rows of the unfinished group (score already
    has `ape` added) and, for the overlapping ratio-4 compressor, the last complete group."""
    pending_kv: torch.Tensor | None = None
    pending_score: torch.Tensor | None = None
    prev_kv: torch.Tensor | None = None
    prev_score: torch.Tensor | None = None
    n_groups: int = 0


@dataclass
class LayerState:
    window_kv: torch.Tensor | None = None          # last (window-1) KV rows, oldest first
    comp_kv: torch.Tensor | None = None            # compressed entries [n, head_dim]
    comp: CompressorState = field(default_factory=CompressorState)
    index_keys: torch.Tensor | None = None         # indexer keys [n, index_head_dim]
    index_comp: CompressorState = field(default_factory=CompressorState)


@dataclass
class SequenceState:
    layers: list[LayerState]
    pos: int = 0                                   # tokens already processed

    @classmethod
    def empty(cls, cfg) -> "SequenceState":
        return cls([LayerState() for _ in range(cfg.n_layers)])


def cat(a, b):
    """b appended to a (a may be None: nothing yet)."""
    return b if a is None else torch.cat([a, b], 0)


def state_bytes(obj) -> int:
    """Bytes of every tensor reachable from a state (dataclasses, lists): what a cached
    prefix or a pipeline stage holds; a state that spans ranks says its own
    (`all_ranks_bytes`)."""
    if hasattr(obj, "all_ranks_bytes"):
        return obj.all_ranks_bytes()
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, (list, tuple)):
        return sum(state_bytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(state_bytes(getattr(obj, k)) for k in obj.__dataclass_fields__)
    return 0
