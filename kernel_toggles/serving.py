"""Serving-state toggles: what happens to a layer's state between prefill chunks and when a
cached prefix's state is restored (the `chunk_boundary` / `state_restore` seam,
reference_model.schedule). They act only under a schedule that has such a boundary
(`arm@prefix_hit(P)`, `arm@chunked(N)`, or prompts longer than the model's chunk), which
is where the field's serving bugs live (../research serving-bugs.md)."""
from __future__ import annotations

import copy

import torch

from .registry import Provenance, toggle


def _without_pending(comp):
    c = copy.copy(comp)
    c.pending_kv = c.pending_score = c.prev_kv = c.prev_score = None
    return c


@toggle("restore_drops_compressor_pending", kernel="state_restore", category="known-bug", wraps=True,
        _builtin=True,
        provenance=Provenance(("vllm-ascend-deepseekv4",), ("speculative verifier",),
                              ("GDzhu01/vllm-ascend-deepseekv4 #131",),
                              "planted: the issue saves the compressor state incompletely; "
                              "which rows it drops is our reading"),
        description="A restored prefix state without the compressors' unfinished group and "
                    "overlap rows (main KV and indexer): the partial group at the prefix "
                    "boundary restarts empty, so the next compressed entry pools too few "
                    "tokens and the overlapping ratio-4 compressor loses its previous group.")
def _restore_drops_compressor_pending(golden, st):
    st = golden.state_restore(st)
    st.comp, st.index_comp = _without_pending(st.comp), _without_pending(st.index_comp)
    return st


@toggle("restore_window_one_off", kernel="state_restore", category="known-bug", wraps=True,
        _builtin=True,
        provenance=Provenance(("sglang", "llama.cpp"), ("prefix cache / SWA ring",),
                              ("sglang #33656", "llama.cpp #26694"),
                              "planted: the reports name the SWA ring restore, not the offset"),
        description="The sliding-window ring restored one row off: the window's rows come back "
                    "rotated by one (the oldest row where the newest belongs), so every query "
                    "after a cache hit attends to a mis-positioned window.")
def _restore_window_one_off(golden, st):
    st = golden.state_restore(st)
    if st.window_kv is not None and st.window_kv.shape[0] > 1:
        st.window_kv = torch.roll(st.window_kv, 1, 0)
    return st


@toggle("chunk_stale_index_keys", kernel="chunk_boundary", category="known-bug", wraps=True,
        _builtin=True,
        provenance=Provenance(("vllm",), ("chunked prefill", "prefix-cache hits"),
                              ("vllm PR #51252",),
                              "planted: the PR leaves K rows uninitialised; zeros stand in"),
        description="An indexer workspace sized for the current chunk only: at each prefill "
                    "chunk boundary the indexer keys of everything before it are lost "
                    "(zeroed), so the indexer sees the earlier context as all-zero keys and "
                    "top-k is wrong only on chunked shapes.")
def _chunk_stale_index_keys(golden, st):
    st = copy.copy(golden.chunk_boundary(st))
    if st.index_keys is not None:
        st.index_keys = torch.zeros_like(st.index_keys)
    return st
