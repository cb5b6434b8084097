"""Serving-state toggles: what happens to a layer's state between prefill chunks and when a
cached prefix's state is restored (the `chunk_boundary` / `state_restore` seam,
reference_model.schedule). They act only under a schedule that has such a boundary
(`arm@prefix_hit(P)`, `arm@chunked(N)`, or prompts longer than the model's chunk), which
is where the field's serving bugs live (docs/research/serving-bugs.md)."""
from __future__ import annotations

import copy

import torch

from reference_model.schedule import batch_tokens

from . import emulate as E
from .registry import Param, Provenance, toggle


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


def _last_row_twice(comp):
    """The last fed token's compressor row once more at the end of the unfinished group;
    where the group closed at the boundary, from the closed group's rows the overlapping
    ratio-4 compressor keeps (a ratio-128 one keeps none: unchanged there)."""
    c = copy.copy(comp)
    kv, score = c.pending_kv, c.pending_score
    if kv is not None and kv.shape[0]:
        c.pending_kv, c.pending_score = torch.cat([kv, kv[-1:]]), torch.cat([score, score[-1:]])
    elif c.prev_kv is not None:
        c.pending_kv, c.pending_score = c.prev_kv[-1:].clone(), c.prev_score[-1:].clone()
    return c


@toggle("restore_saved_one_token_later", kernel="state_restore", category="known-bug", wraps=True,
        _builtin=True,
        provenance=Provenance(("ROCm/ATOM", "llama.cpp"), ("prefix cache state save/restore",),
                              ("ROCm/ATOM #1417", "llama.cpp #26694"),
                              "planted: the reports name wrong output after a restored prefix; "
                              "the off-by-one save point is our reading"),
        description="A cache hit restores state saved one token later than the match it serves: "
                    "the matched prefix's last token is already in the state and is fed again, "
                    "so both compressors (main KV and indexer) count it twice -- one extra row "
                    "in the unfinished group, and every later group boundary one token early. "
                    "The window ring is positional, so rewriting that row there is harmless.")
def _restore_saved_one_token_later(golden, st):
    st = golden.state_restore(st)
    st.comp, st.index_comp = _last_row_twice(st.comp), _last_row_twice(st.index_comp)
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


@toggle("mhc_splitk_by_batch", kernel="hc_pre", category="serving", wraps=True, _builtin=True,
        params=(Param("max_tokens", int, 64, "split K only for steps of at most this many tokens",
                      min=1),
                Param("splits", int, 4, "K splits when the step is small", min=2)),
        provenance=Provenance(("sglang",), ("mHC pre-norm GEMM, split-K by token count",),
                              ("sglang PR #37292", "sglang PR #36174"),
                              "the threshold and split count are ours; the PRs report the "
                              "choice keyed on the batch's token count"),
        description="The mHC mixing GEMM's K dimension split in `splits` fp32 partial sums when "
                    "the step holds at most `max_tokens` tokens (a decode step alone), one pass "
                    "otherwise: the same token's logits then depend on what it was batched with "
                    "(sglang PR #37292: ~1e-2 on every logprob when co-batched). Under "
                    "`batch(k)` the step's tokens are k times the sequence's.")
def _mhc_splitk_by_batch(golden, H, fn, scale, base, cfg, *, max_tokens, splits):
    n = batch_tokens()
    if n is None or n > max_tokens:
        return golden.hc_pre(H, fn, scale, base, cfg)
    n_tok, hc, d = H.shape
    mixes = golden.r32(E.splitk_mixes(golden.c(H.reshape(n_tok, hc * d)), fn.to(golden.cd), cfg.norm_eps,
                                      splits, golden.r32))
    return golden.hc_collapse(H, mixes, scale, base, cfg)


@toggle("decode_splitk_by_batch", kernel="sparse_attention", phase="decode", category="serving",
        wraps=True, _builtin=True,
        params=(Param("max_splits", int, 8, "key splits of a decode step alone", min=2),),
        provenance=Provenance(("vllm", "sglang"), ("FlashMLA sparse decode, splits from the batch",),
                              ("vllm #53257",),
                              "FlashMLA's scheduler picks the split count from the batch to fill "
                              "the SMs; the rule max_splits // step tokens is ours"),
        description="Sparse decode attention split over max_splits // (tokens in the step) key "
                    "chunks with bf16 partial outputs (one pass, the reference, once the step "
                    "holds max_splits tokens): a request decoded alone and the same request "
                    "decoded beside others get different logprobs (vllm #53257: FlashMLA decode "
                    "differs by 1-2 bf16 ULP alone vs batched, and T=0 outputs split under "
                    "concurrency).")
def _decode_splitk_by_batch(golden, q, kv, sink, idx, scale, phase="prefill", *, max_splits):
    n = batch_tokens()
    splits = max_splits // max(n or 1, 1)
    if phase != "decode" or splits < 2:
        return golden.sparse_attention(q, kv, sink, idx, scale, phase)
    return E.splitk_attention(q, kv, sink, idx, scale, splits, golden.cd, round_p=golden.rs,
                              round_partial=E.bf16, round_out=golden.rs)


@toggle("decode_positions_wrap", kernel="rope_apply", phase="decode", category="known-bug", wraps=True,
        _builtin=True,
        params=(Param("at", int, 512, "size of the decode position buffer", min=2),),
        provenance=Provenance(("sglang", "vllm"), ("long generations",),
                              ("sglang #33397",),
                              "planted: the report finds long outputs corrupted and short ones "
                              "never; a decode position buffer that wraps is our reading"),
        description="Decode-step RoPE positions taken modulo `at` (a position buffer sized for "
                    "`at` tokens): prefill and every token before position `at` are exact, then "
                    "each new token's query and key rotate as if at position - `at`, so a long "
                    "generation leaves the reference a few hundred steps in while short ones "
                    "never do (sglang #33397: long outputs corrupt in 6/11 runs, short 0/19).")
def _decode_positions_wrap(golden, x, inv_freq, positions, site, inverse=False, phase="prefill", *, at):
    if phase == "decode":
        positions = positions % at
    return golden.rope_apply(x, inv_freq, positions, site, inverse, phase)
