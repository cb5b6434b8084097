"""The attention side of the kernel seam: sparse attention over the gathered window and
compressed rows, and the grouped output projection. A mixin of Numerics (numerics.py), as
numerics_mix.py's mHC / MoE / head kernels are: it uses Numerics' roundings and row blocks."""
from __future__ import annotations

import torch

from .numerics_mix import _row_elems


class AttentionKernels:
    def sparse_attention(self, q, kv, sink, idx, scale, phase="prefill"):
        """One softmax over the gathered rows plus a per-head sink in the denominator.
        q [c,H,D], kv [N,D] (K = V), sink [H], idx [c,k] (-1 = empty) -> [c,H,D].
        Scores and softmax fp32; probabilities rounded to bf16 before P·V (fp32 accumulate);
        the max is taken over the selected rows (the TileLang kernel's online rescaling only
        changes where bf16 rounding of P happens)."""
        q, kv = self.c(q), self.c(kv)
        blocks = self._blocked(idx.shape[1] * kv.shape[-1], q, kv, sink)
        return self._rows_rounded(blocks, q.shape, q.device,
                                  lambda a, b: self._attend(q[a:b], kv, sink, idx[a:b], scale))

    def _attend(self, q, kv, sink, idx, scale):
        """sparse_attention for a block of queries (q, kv in the compute dtype), before the
        output's rounding."""
        valid = idx >= 0
        c, k = idx.shape
        if self.quant and self.cd == torch.float64 and q.device.type == "cpu":
            shared, where = torch.unique(idx.clamp(min=0), return_inverse=True)
            rows = kv.index_select(0, shared)
            if shared.numel() <= 4 * k and bool(torch.isfinite(rows).all()):
                return self._attend_shared(q, rows, sink, where, valid, scale)
        rows = kv.index_select(0, idx.clamp(min=0).reshape(-1)).view(c, k, kv.shape[-1])
        s = torch.einsum("chd,ckd->chk", q, rows) * scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink.to(self.cd).view(1, -1, 1) - m)
        return torch.einsum("chk,ckd->chd", self.rs(p), rows) / denom

    def _attend_shared(self, q, rows, sink, where, valid, scale):
        """_attend when the block's queries share most of their rows (V4's HCA layers: every
        query reads the same compressed entries): one GEMM of the queries against the
        distinct `rows` (where [c,k]: each pick's row among them), not c small ones against
        gathered copies. The same values in the fp64 golden: its products of bf16/FP8 grid
        values are exact and so are their fp64 sums, in any order (the premise that makes
        decode equal prefill), and the softmax runs over the same [c,H,k] scores as before.
        Only for finite rows: a query's zero weight on a row it does not read would turn
        another query's inf or NaN row into its own NaN."""
        c, k = where.shape
        h = q.shape[1]
        at = where.unsqueeze(1).expand(c, h, k)
        s = (q.reshape(c * h, -1) @ rows.T).view(c, h, -1).gather(2, at) * scale
        s = s.masked_fill(~valid.unsqueeze(1), float("-inf"))
        m = s.amax(-1, keepdim=True)
        p = torch.exp(s - m)
        denom = p.sum(-1, keepdim=True) + torch.exp(sink.to(self.cd).view(1, -1, 1) - m)
        weights = q.new_zeros(c, h, rows.shape[0]).scatter_add_(2, at, self.rs(p))
        return (weights.view(c * h, -1) @ rows).view(c, h, -1) / denom

    def wo_a(self, o, w):
        """Grouped low-rank output projection, a bf16 einsum: o [c,g,in], w [g,r,in] -> [c,g,r]."""
        o, w = self.c(o), self.c(w)
        blocks = self._blocked(_row_elems(o) + w.shape[0] * w.shape[1], o, w)
        return self._rows_rounded(blocks, (o.shape[0], w.shape[0], w.shape[1]), o.device,
                                  lambda a, b: torch.einsum("cgd,grd->cgr", o[a:b], w))
