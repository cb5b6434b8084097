"""The kernel seam: every numerically sensitive step of the forward is a method here.

`Numerics("reference")` is DeepSeek's reference semantics (docs/research/dsv4-architecture.md §4, §7): bf16 storage
between ops, FP8 activation quantisation in front of FP8/FP4 GEMMs, FP8 KV grid on the
nope dims, Hadamard + FP4 indexer, bf16 indexer scores. `Numerics("exact")` is the same
math in fp32 (or fp64) with no simulated quantisation: the noise floor.

Tensors travel between kernels in the compute dtype (fp32/fp64) holding values already
rounded to the storage dtype (bf16 in `reference`), which equals what bf16 kernels with fp32
accumulation produce, up to summation order. Engine toggles (kernel_toggles/) replace
methods via `Numerics.with_kernels`, so one set of weights serves every arm. V4.1's kernels
(reference_model/v41/numerics.py) are inherited, so every Numerics serves both versions."""
from __future__ import annotations

import copy

import torch

from . import primitives as P
from . import quant as Q
from .primitives import sinkhorn_split, topk_highest_index_ties, topk_lowest_index_ties  # noqa: F401  (re-exported)
from .numerics_attention import AttentionKernels
from .numerics_mix import MixMoeKernels, _row_elems
from .spec_kernels import SPEC_KERNELS, SpecKernels
from .v41.numerics import V41_KERNELS, V41Kernels

# Names of V4's replaceable kernels.
V4_KERNELS = (
    "fp8_linear", "bf16_linear", "rms_norm", "q_head_rescale", "rope_inv_freq", "rope_apply",
    "window_first", "kv_store", "compressor_proj", "compress_score_bias", "compress_state",
    "compress_pool", "compressed_positions", "compressed_visible",
    "index_rotate", "index_query", "index_key_store", "index_weights", "index_scores",
    "index_topk", "index_select",
    "sparse_attention", "wo_a", "hc_pre", "hc_post", "hc_head",
    "moe_gate", "moe_select", "route_weights", "swiglu", "expert_ffn", "moe_combine", "lm_head",
    "chat_request", "chat_render", "chunk_boundary", "state_restore",
)
# The seam: every kernel a toggle may replace, V4's and the steps V4.1 adds (one Numerics
# serves both versions; a V4 model never calls the V4.1 ones).
KERNELS = V4_KERNELS + V41_KERNELS + SPEC_KERNELS      # spec_*: speculative decoding (spec_kernels.py)
# chat_request / chat_render are the request-level seam (not numerics): how a chat request
# is read and rendered to a prompt, so engines' chat-handling differences are toggles like
# the rest. chunk_boundary / state_restore are the serving seam: what happens to a
# layer's state between prefill chunks and when a cached prefix's state is restored
# (reference_model.schedule), so serving behaviours and bugs are toggles too.

# Where rope_apply is called (its `site` argument): main query, window KV latent, compressed
# KV entries, indexer query, indexer keys, and the inverse rotation of the attention output.
ROPE_SITES = ("q", "kv", "compressed_kv", "index_q", "index_k", "output")

PROFILES = ("reference", "exact")

# Row blocking. On CPU the memory-bound kernels (sparse attention, indexer scores, mHC,
# the FP8 GEMMs with their quantisation and roundings) run a chunk's tokens in blocks of
# about 4 MB of compute-dtype intermediates per thread, so those stay in cache instead of
# streaming through RAM (at 2048-token chunks in fp64 they are tens of MB). Not smaller
# (1-4 MB run alike on one thread here): with 2+ threads each op of a block is an OpenMP
# region, and on a busy machine a region can wait for a descheduled thread. Every step is row-local, so the values are those of
# one call over all rows (tests/test_reference_speed_identity.py checks each blocked kernel
# against it, bit for bit, including fp64 sums that round). For that, blocks start at
# multiples of ROW_BLOCK_MIN rows and the remainder joins the last block: MKL computes the
# rows of a short GEMM (1-3 rows, or a 1-2 row remainder, or rows grouped from another
# start) by other paths whose fp64 sums round differently.
ROW_BLOCK_MIN = 64
ROW_BLOCK_ELEMS = 1 << 19            # compute-dtype elements per row block and thread (4 MB fp64)


def row_blocks(n: int, row_elems: int, min_rows: int = ROW_BLOCK_MIN) -> list[tuple[int, int]]:
    """[start, end) row ranges covering 0..n, about ROW_BLOCK_ELEMS elements per torch
    thread each, a multiple of `min_rows` rows (ranges start where MKL's row groups of one
    call over all n rows start); the remainder joins the last range, so no range but a lone
    one is shorter than the step."""
    elems = ROW_BLOCK_ELEMS * torch.get_num_threads()
    step = max(min_rows, elems // max(1, row_elems) // min_rows * min_rows)
    cuts = list(range(0, max(n, 1), step))
    if len(cuts) > 1 and n - cuts[-1] < step:
        cuts.pop()
    return list(zip(cuts, cuts[1:] + [n]))


class Numerics(AttentionKernels, MixMoeKernels, V41Kernels, SpecKernels):
    """The seam of both versions: V4's attention-side kernels here, its mHC / MoE / head /
    request kernels from MixMoeKernels (numerics_mix.py), V4.1's from V41Kernels and
    speculative decoding's verify / accept / rollback from SpecKernels (spec_kernels.py)."""

    def __init__(self, profile: str = "reference", compute_dtype: torch.dtype | None = None):
        """`reference`: bf16 storage, computed in fp64 by default ("wide accumulation": every
        step the reference does in fp32 is done in fp64 and rounded to fp32 where the
        reference stores fp32). This makes the golden deterministic and invariant to
        chunking and batch shape (decode equals prefill bit for bit), which fp32 GEMMs with
        shape-dependent blocking are not. `compute_dtype=torch.float32` gives the faster
        fp32-accumulation variant. `exact`: no simulated quantisation, fp32 (default) or
        fp64 throughout."""
        if profile not in PROFILES:
            raise ValueError(f"unknown numerics profile {profile!r}; valid: {', '.join(PROFILES)}")
        self.profile = profile
        self.quant = profile == "reference"
        if profile == "reference":
            self.cd = compute_dtype or torch.float64
            self.sd = torch.bfloat16
        else:
            self.cd = compute_dtype or torch.float32
            self.sd = self.cd
        self.replaced: dict[str, str] = {}          # kernel -> name of the replacement
        self._rope_memo = None

    def __repr__(self):
        extra = f", replaced={sorted(self.replaced)}" if self.replaced else ""
        return f"Numerics({self.profile!r}, compute={self.cd}{extra})"

    # ---- seam mechanics -----------------------------------------------------------------
    def with_kernels(self, label: str = "custom", _top: list | None = None, **fns) -> "Numerics":
        """A copy where each named kernel is replaced by `fn(golden, *args, **kw)`.
        `golden` gives the previous implementation of the kernels this call replaces (so a
        replacement can fall back or build on it) and the arm's final implementation of
        every other kernel, so a toggle on e.g. `swiglu` also acts inside another toggle's
        `expert_ffn`. `_top` is a one-element list the caller fills with the final
        Numerics once all toggles are applied (ToggleSet.numerics); default: this copy."""
        unknown = sorted(set(fns) - set(KERNELS))
        if unknown:
            raise KeyError(f"unknown kernel(s) {unknown}; valid: {', '.join(KERNELS)}")
        new = copy.copy(self)
        new.replaced = dict(self.replaced)
        top = _top if _top is not None else [new]
        below = _Below(self, top, frozenset(fns))
        for name, fn in fns.items():
            def bound(*a, _fn=fn, **k):
                return _fn(below, *a, **k)
            setattr(new, name, bound)
            new.replaced[name] = label
        return new

    def rs(self, x: torch.Tensor) -> torch.Tensor:
        """Round to the storage dtype, return in compute dtype."""
        if self.sd == self.cd:
            return x.to(self.cd)
        return self._to_sd(x).to(self.cd)          # bf16 -> fp32/fp64 is exact

    def _to_sd(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to the storage dtype, as a storage-dtype tensor: via fp32, like the
        reference (fp32 result, then the bf16 cast). On CPU torch's fp64 -> bf16 cast
        already goes through fp32 (tests/test_reference_speed_identity.py pins it on
        double-rounding cases), so one cast does it."""
        if x.device.type != "cpu" and x.dtype == torch.float64:
            x = x.float()
        return x.to(self.sd)

    def _blocked(self, row_elems: int, x: torch.Tensor, *more) -> list[tuple[int, int]]:
        """Row blocks for a kernel over x's rows: on CPU, and only when autograd records
        none of the inputs (training then runs the plain one-call formulation, so its
        gradients are unchanged); otherwise one block."""
        n = x.shape[0] if x.dim() else 0
        if x.device.type != "cpu" or Q.tracks_grad(x, *more):
            return [(0, n)]
        return row_blocks(n, row_elems)

    def _rows_of(self, x: torch.Tensor, row_elems: int, *more) -> list[tuple[int, int]]:
        """_blocked for a kernel whose rows are those of a 2-D x (any other x: one block)."""
        return self._blocked(row_elems, x, *more) if x.dim() == 2 else [(0, x.shape[0] if x.dim() else 0)]

    def _rows_rounded(self, blocks, shape, device, rows_fn, fp32: bool = False):
        """rs (r32 if `fp32`) of a kernel's output computed by `rows_fn(start, end)`
        (unrounded rows) over `blocks`; each block's rounded rows are written straight into
        one compute-dtype tensor (the rounding is elementwise: the same values as rounding
        the whole)."""
        rnd = self.r32 if fp32 else self.rs
        if len(blocks) == 1:
            return rnd(rows_fn(*blocks[0]))
        out = torch.empty(shape, dtype=self.cd, device=device)
        for a, b in blocks:
            v = rows_fn(a, b)
            if fp32:
                v = v.float() if self.quant else v
            elif self.sd != self.cd:
                v = self._to_sd(v)
            out[a:b].copy_(v)
        return out

    def r32(self, x: torch.Tensor) -> torch.Tensor:
        """Round to fp32 where the reference stores fp32 (a no-op in the exact profile)."""
        if not self.quant or self.cd == torch.float32:
            return x.to(self.cd)
        return x.float().to(self.cd)

    def c(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.cd)

    # ---- GEMMs --------------------------------------------------------------------------
    def fp8_linear(self, x, w):
        """FP8/FP4-weight GEMM: FP8 act-quant (1×128, ue8m0) of the bf16 input, fp32
        accumulate, bf16 output. `w` holds the dequantised weight values."""
        w = self.c(w)
        blocks = self._rows_of(x, x.shape[-1] + w.shape[0], w)
        return self._rows_rounded(blocks, (x.shape[0], w.shape[0]), x.device,
                                  lambda a, b: self._fp8_linear_rows(x[a:b], w))

    def _fp8_linear_rows(self, x, w):
        """fp8_linear before its output rounding."""
        if self.quant:
            x = Q.fp8_qdq(x, 128, dtype=self.cd)
        return self.c(x) @ w.T

    def bf16_linear(self, x, w):
        """Plain bf16 GEMM (e.g. `weights_proj`): fp32 accumulate, bf16 out."""
        return self.rs(self.c(x) @ self.c(w).T)

    def rms_norm(self, x, w, eps, round_out: bool = True):
        """RMSNorm in fp32 with the fp32 weight, one cast at the end (round_out=False: the
        fp32 result, which the KV and compressor paths quantise or split themselves)."""
        y = P.rms_norm(x, w, eps, self.cd)
        return self.rs(y) if round_out else y

    def q_head_rescale(self, q, eps):
        """Per-head unweighted RMS rescale of q, done in bf16 tensor arithmetic."""
        if not self.quant:
            return q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps)
        r = self.rs

        def rows(a, b):
            qb = q[a:b]
            ms = r(r(qb * qb).mean(-1, keepdim=True))
            return qb * r(torch.rsqrt(r(ms + eps)))
        return self._rows_rounded(self._blocked(_row_elems(q), q), q.shape, q.device, rows)

    def rope_inv_freq(self, cfg, ratio: int):
        """Per-layer-type RoPE: window-only layers base `rope_theta` without YaRN; compressed
        layers `compress_rope_theta` with YaRN."""
        dt = torch.float32 if self.cd == torch.float32 else torch.float64
        if ratio == 0:
            return P.rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, dtype=dt)
        return P.rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, cfg.rope_factor,
                               cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow, dtype=dt)

    def rope_apply(self, x, inv_freq, positions, site: str, inverse: bool = False,
                   phase: str = "prefill"):
        """RoPE on the last 2·len(inv_freq) dims of x as adjacent (interleaved) pairs at
        `positions` (one per row of x), fp32 rotation written back in the storage dtype.
        `site` is one of ROPE_SITES; `inverse` rotates back (the attention output, whose V
        rows carry rotated dims). The same layout and table at every site in V4."""
        table = self._rope_table(positions, inv_freq.to(positions.device))
        if self.sd == self.cd or x.device.type != "cpu" or Q.tracks_grad(x):
            return self.rs(P.apply_rope(x, table, inverse))
        # rs(cat(pass-through dims, rotated dims)), written block by block into one
        # storage-dtype tensor (rs is elementwise, so the same values)
        r = table.shape[-1] * 2
        out = torch.empty(x.shape, dtype=self.sd, device=x.device)
        out[..., :-r].copy_(x[..., :-r])                 # CPU fp64 -> bf16 goes via fp32
        for a, b in self._blocked(_row_elems(x), x):
            out[a:b, ..., -r:].copy_(P.rope_rotate(x[a:b, ..., -r:], table[a:b], inverse))
        return out.to(self.cd)

    def _rope_table(self, positions, inv_freq):
        """P.rope_table, kept for the last (positions, inv_freq) values: a layer rotates q,
        the KV latent, the indexer query and the output at the same positions."""
        memo = self._rope_memo
        if (memo is not None and all(
                m.shape == t.shape and m.dtype == t.dtype and m.device == t.device
                and torch.equal(m, t) for m, t in ((memo[0], positions), (memo[1], inv_freq)))):
            return memo[2]
        table = P.rope_table(positions, inv_freq)
        self._rope_memo = (positions.clone(), inv_freq.clone(), table)
        return table

    def window_first(self, positions, window: int):
        """First absolute position each query sees in its sliding window: t - W + 1
        (the window includes the query itself)."""
        return positions - (window - 1)

    # ---- KV and compressor --------------------------------------------------------------
    def kv_store(self, nope):
        """Window/compressed KV latent, non-RoPE dims: bf16 then FP8 e4m3 round trip in 1×64
        blocks with ue8m0 scales (QAT simulation of the current reference revision).
        Input is the fp32 RMSNorm output before its bf16 cast."""
        nope = self.rs(nope)
        return Q.fp8_qdq(nope, 64).to(self.cd) if self.quant else nope

    def compressor_proj(self, x, wkv, wgate):
        """Compressor kv/score projections: fp32 GEMM of the bf16 input with fp32 weights."""
        cd = self.cd
        x, wkv, wgate = x.to(cd), wkv.to(cd), wgate.to(cd)
        blocks = self._rows_of(x, x.shape[-1] + wkv.shape[0], wkv, wgate)
        return tuple(self._rows_rounded(blocks, (*x.shape[:-1], w.shape[0]), x.device,
                                        lambda a, b, w=w: x[a:b] @ w.T, fp32=True)
                     for w in (wkv, wgate))

    def compress_score_bias(self, score, ape, positions, ratio: int):
        """Adds the learned position bias ape[t mod ratio] to each token's score row."""
        return score + ape.to(score.dtype)[positions % ratio]

    def compressed_positions(self, groups, ratio: int):
        """RoPE position of compressed entry j: its group's first token, j·ratio."""
        return groups * ratio

    def compressed_visible(self, positions, ratio: int):
        """How many compressed entries query t may see: (t+1)//ratio (a group is visible
        once it is complete, including t itself)."""
        return (positions + 1) // ratio

    def compress_state(self, kv, score):
        """Rows as held in the compressor's partial-window state (fp32 in the reference)."""
        return self.r32(kv), self.r32(score)

    def compress_pool(self, kv, score):
        """Gated pooling: softmax over the candidate tokens per channel (fp32).
        kv, score [groups, tokens, d] -> [groups, d]."""
        w = torch.softmax(score, dim=1)
        return self.r32((w * kv).sum(1))

    # ---- lightning indexer --------------------------------------------------------------
    def index_rotate(self, x, kind: str):
        """Hadamard rotation of the indexer query (kind 'q') or key ('k'), unrounded. Its
        own kernel so engine toggles can drop it on one or both sides (vLLM #55459,
        ROCm/ATOM #1507) while keeping their own quantiser."""
        return P.hadamard(x, self.cd)

    def index_query(self, q):
        """Indexer query after RoPE: Hadamard (bf16 out) then FP4 round trip (1×32, ue8m0)."""
        if not self.quant:
            return self.index_rotate(q, "q")
        return Q.fp4_qdq(self.rs(self.index_rotate(q, "q")), 32)

    def index_key_store(self, k):
        """Indexer key after norm + RoPE: Hadamard then FP4 round trip, kept as bf16."""
        if not self.quant:
            return self.index_rotate(k, "k")
        return Q.fp4_qdq(self.rs(self.index_rotate(k, "k")), 32)

    # ---- serving: a layer's state between pieces of a prompt (reference_model.schedule) ---
    def chunk_boundary(self, st):
        """Between two prefill chunks: the reference carries the layer's state over as is."""
        return st

    def state_restore(self, st):
        """A cached prefix's layer state, saved and restored (window rows, compressor pending
        and overlap rows, compressed entries, indexer keys): an exact copy."""
        return copy.deepcopy(st)

    def index_weights(self, w, scale: float):
        """Per-head indexer weights: the bf16 `weights_proj` output times
        softmax_scale·n_heads^-0.5, a bf16 tensor op in the reference (engines fold it, and
        the fp8 query scale, in fp32)."""
        return self.rs(w * scale)

    def index_scores(self, q, keys, w):
        """score[t, T] = Σ_h relu(q[t,h]·k[T]) · w[t,h]; every step rounded to bf16 in the
        reference. q [c,h,d], keys [n,d], w [c,h] -> [c,n]."""
        q, keys = self.c(q), self.c(keys)
        # relu(s)·w in bf16 arithmetic when w holds bf16 values (as index_weights gives it):
        # the product of two bf16 values is exact in fp32, which torch's bf16 multiply
        # rounds once, as the reference rounds its product (pinned by the identity tests)
        bf = (self.quant and self.sd == torch.bfloat16 and q.device.type == "cpu"
              and not Q.tracks_grad(q, keys, w) and torch.equal(w, w.to(torch.bfloat16).to(w.dtype)))
        blocks = self._blocked(q.shape[1] * keys.shape[0], q, keys, w)
        return self._rows_rounded(blocks, (q.shape[0], keys.shape[0]), q.device,
                                  lambda a, b: self._index_scores_rows(q[a:b], keys, w[a:b], bf))

    def _index_scores_rows(self, q, keys, w, bf: bool):
        """index_scores before its last rounding."""
        r = self.rs
        s = torch.einsum("chd,nd->chn", q, keys)
        if bf:
            s = self._to_sd(s).relu_().mul_(w.to(torch.bfloat16).unsqueeze(-1))
            return s.to(self.cd).sum(1)
        s = r(s)
        s = r(s.relu() * w.unsqueeze(-1))
        return s.sum(1)

    def index_select(self, q, keys, w, visible, k: int):
        """The indexer's choice for rows of queries: (scores over every key with the keys a row
        cannot see at -inf, picks [rows, k]): the exact top-k of index_scores. Its own kernel so
        an engine's approximate selection (mlx-vlm's HISA) replaces the choice while the exact
        scores stay what margins are measured on."""
        s = self.index_scores(q, keys, w)
        cols = torch.arange(keys.shape[0], device=keys.device)
        s = s.masked_fill(cols.unsqueeze(0) >= visible.unsqueeze(1), float("-inf"))
        return s, self.index_topk(s, k)

    def recording_index_scores(self, record) -> "Numerics":
        """A copy that hands `record` the exact scores (keys a row cannot see at -inf) of each
        of its index_select calls, whatever selects the picks (a needle's mechanism ranks the
        needle's entries on them)."""
        def recorder(golden, q, keys, w, visible, k):
            s, picks = golden.index_select(q, keys, w, visible, k)
            record(s.detach().cpu())
            return s, picks
        return self.with_kernels("index-score-recorder", index_select=recorder)

    def index_topk(self, scores, k: int):
        """Top-k of each row (-inf = not visible); ties broken by the lower index. Returns
        indices [c, k] with -1 where fewer than k entries are visible."""
        blocks = self._rows_of(scores, scores.shape[-1])
        if len(blocks) == 1:
            return topk_lowest_index_ties(scores, k)
        return torch.cat([topk_lowest_index_ties(scores[a:b], k) for a, b in blocks])

    # ---- attention: numerics_attention.py (AttentionKernels) -----------------------------


class _Below:
    """What a kernel replacement sees as `golden` (see Numerics.with_kernels): the kernels
    it replaces as they were before it, every other kernel as the finished arm has it.
    Unreplaced golden kernels run on the finished arm too, so the kernels they call inside
    (e.g. `swiglu` inside `expert_ffn`) are the arm's."""

    def __init__(self, prev: Numerics, top: list, own: frozenset):
        self._prev, self._top, self._own = prev, top, own

    def __getattr__(self, name):
        if name in KERNELS and self._top:
            final = self._top[0]
            if name not in self._own:
                return getattr(final, name)
            if name not in vars(self._prev):           # golden's own implementation
                return getattr(Numerics, name).__get__(final)
        return getattr(self._prev, name)
