"""The speculative-decoding seam: the batched verify step, the acceptance rule and the
rollback of a layer's state to the accepted tokens, as kernels of every Numerics, so an
engine's spec-decoding bugs are toggles like its numerics (kernel_toggles/speculative.py).

Golden semantics, and why they make speculation invisible in the output:
* `spec_verify`: [last token, drafts] in ONE forward on top of the state, in the decode
  phase. The golden forward is batch- and chunk-invariant (fp64 accumulation, explicit
  state), so its rows equal K+1 one-token decode steps bit for bit.
* `spec_accept`: the target is sampled at each verified row with the request's own
  generator, in order, and a draft is accepted while it equals that sample. For greedy
  requests this is the longest prefix on which the drafts equal the argmax. For sampled
  requests with a greedy (point-mass) draft it IS the standard rejection rule: accept with
  probability min(1, p(x)/q(x)) = p(x), and on rejection the emitted token is distributed as
  the residual norm(max(0, p - q)) = p without x. One draw per emitted token, the same draws
  in the same order as plain decoding: sampled outputs are identical too, seed for seed.
* `spec_rollback`: the layer's state after the verify truncated to the accepted tokens --
  window rows, compressed entries, and the compressors' unfinished-group and overlap rows
  rebuilt from the per-token rows the verify recorded -- equal to the state of feeding only
  the accepted tokens."""
from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from .sampling import pick

SPEC_KERNELS = ("spec_verify", "spec_accept", "spec_rollback")


def _cat(a, b):
    return b if a is None else torch.cat([a, b], 0)


def snapshot_layer(st):
    """A copy of a layer state the forward will not write into (it reassigns fields of the
    state and of its compressor states; tensors are never written in place)."""
    if st is None:
        return None
    c = copy.copy(st)
    c.comp, c.index_comp = copy.copy(st.comp), copy.copy(st.index_comp)
    return c


@contextmanager
def recording_compressor_rows(nx):
    """Record every `compress_state` output (the per-token rows a compressor keeps) while
    the verify runs; yields the list, in call order (per layer: the KV compressor, then the
    indexer's)."""
    rows: list = []
    own = "compress_state" in nx.__dict__
    prev = nx.__dict__.get("compress_state")
    inner = nx.compress_state

    def rec(kv, score):
        out = inner(kv, score)
        rows.append(out)
        return out

    nx.compress_state = rec
    try:
        yield rows
    finally:
        if own:
            nx.compress_state = prev
        else:
            del nx.compress_state


def rows_by_layer(cfg, rows: list) -> dict:
    """The recorded rows per (layer, 'kv' | 'index'), from their call order."""
    out, it = {}, iter(rows)
    for i, r in enumerate(cfg.compress_ratios):
        if r:
            out[(i, "kv")] = next(it)
        if r == 4:
            out[(i, "index")] = next(it)
    return out


def _roll_compressor(before, rows, keep: int, ratio: int):
    """A compressor's state after `keep` of the recorded tokens: (state, groups closed)."""
    kv = _cat(before.pending_kv, rows[0][:keep])
    sc = _cat(before.pending_score, rows[1][:keep])
    g = kv.shape[0] // ratio
    c = copy.copy(before)
    c.pending_kv, c.pending_score = kv[g * ratio:].clone(), sc[g * ratio:].clone()
    if ratio == 4 and g:
        c.prev_kv, c.prev_score = kv[(g - 1) * ratio:g * ratio].clone(), sc[(g - 1) * ratio:g * ratio].clone()
    c.n_groups = before.n_groups + g
    return c, g


def _entries(before, after, g):
    """The entries held before plus the first g the verify added."""
    if after is None:
        return before
    n0 = 0 if before is None else before.shape[0]
    out = after[:n0 + g]
    return out if out.shape[0] or before is not None else None


class SpecKernels:
    """Mixed into Numerics (reference_model/numerics.py)."""

    def spec_verify(self, model, tokens, state, taps=None):
        """The verify step: `tokens` (the last emitted token, then the drafts) in one
        forward on `state`; returns the residual streams [n, hc, dim] the head reads."""
        return model.extend(tokens, state, "hidden", taps, phase="decode")[0]

    def spec_accept(self, rows, draft, sampling, gen) -> list[int]:
        """The tokens a verify emits: the target's pick at each row in order (the request's
        sampling and generator), stopping after the first that differs from its draft; so
        the accepted drafts plus one (the correction, or the bonus when all are accepted)."""
        out = []
        for i in range(rows.shape[0]):
            t = pick(rows[i], sampling, gen)
            out.append(t)
            if i >= len(draft) or t != int(draft[i]):
                break
        return out

    def spec_rollback(self, after, before, rows: dict, fed: int, keep: int, ratio: int):
        """Layer state after a verify of `fed` tokens, rolled back to the first `keep`.
        `before` is the state before the verify, `rows` the compressor rows it recorded
        ({'kv': (kv, score), 'index': ...}); ratio the layer's compress ratio."""
        if keep == fed:
            return after
        if keep > fed or keep < 1:
            raise ValueError(f"rollback keeps {keep} of {fed} verified tokens")
        st = copy.copy(after)
        w = model_window(after, before, fed)
        st.window_kv = _cat(before.window_kv, w[:keep])[-after.window_kv.shape[0]:].clone() \
            if after.window_kv is not None else None
        if ratio:
            st.comp, g = _roll_compressor(before.comp, rows["kv"], keep, ratio)
            st.comp_kv = _entries(before.comp_kv, after.comp_kv, g)
        if ratio == 4:
            st.index_comp, g = _roll_compressor(before.index_comp, rows["index"], keep, 4)
            st.index_keys = _entries(before.index_keys, after.index_keys, g)
        return st


def model_window(after, before, fed: int):
    """The window rows the verify wrote (its last `fed` rows; the verify must be shorter
    than the window ring, which the decoder checks)."""
    if after.window_kv is None or after.window_kv.shape[0] < fed:
        raise ValueError(f"a verify of {fed} tokens does not fit the window ring "
                         f"({0 if after.window_kv is None else after.window_kv.shape[0]} rows)")
    return after.window_kv[-fed:]
