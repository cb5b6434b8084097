"""The taps of fidelity's mlx-vlm harness (harness.py `taps`), run by mlx-vlm's venv like it:
mlx-vlm's DeepSeek-V4 module classes wrapped at run time so each layer's tensors are recorded,
under the replay's names (fidelity.mlxvlm.replay). Imports mlx, mlx_vlm and numpy only."""
from __future__ import annotations

import numpy as np


def capture(model):
    """Wrap mlx-vlm's DeepSeek-V4 classes so each layer's tensors are recorded per call, under
    the replay's names: attn_norm / attn_out (the attention's input and output), kv_comp /
    lid_comp (new compressed entries of the attention's and the indexer's compressor),
    lid_top_k (indexer picks), ffn_norm / ffn_out, ffn_moe_topk / ffn_moe_weights_scaled,
    l_out (the stream after the block)."""
    import mlx.core as mx
    from mlx_vlm.models.deepseek_v4 import language as L
    rec: dict[str, list] = {}
    names: dict[int, tuple[int, str]] = {}
    layers = model.language_model.model.layers
    for i, lay in enumerate(layers):
        names[id(lay)] = (i, "block")
        names[id(lay.attn)] = (i, "attn")
        names[id(lay.ffn)] = (i, "ffn")
        names[id(lay.ffn.gate)] = (i, "gate")
        if hasattr(lay.attn, "compressor"):
            names[id(lay.attn.compressor)] = (i, "kv_comp")
        if hasattr(lay.attn, "indexer"):
            names[id(lay.attn.indexer)] = (i, "indexer")
            names[id(lay.attn.indexer.compressor)] = (i, "lid_comp")

    def put(key, value):
        rec.setdefault(key, []).append(np.array(value.astype(mx.float32)))

    def wrap(cls, what):
        """Record `what` of each outermost call (mlx-vlm runs 2-8 token calls token by token
        through the same module: only the whole call is recorded)."""
        orig, inside = cls.__call__, set()

        def call(self, *a, **k):
            if id(self) in inside:
                return orig(self, *a, **k)
            inside.add(id(self))
            try:
                out = orig(self, *a, **k)
            finally:
                inside.discard(id(self))
            i, role = names.get(id(self), (None, None))
            if i is not None:
                what(i, role, self, a, k, out)
            return out
        cls.__call__ = call

    def block(i, role, s, a, k, out):
        put(f"l_out-{i}", out[0])

    def attn(i, role, s, a, k, out):
        put(f"attn_norm-{i}", a[0][0])
        put(f"attn_out-{i}", out[0])

    def ffn(i, role, s, a, k, out):
        put(f"ffn_norm-{i}", a[0][0])
        if "residual" not in k:                      # mlx-vlm's fused 2..8-token path returns the stream
            put(f"ffn_out-{i}", out[0])

    def gate(i, role, s, a, k, out):
        put(f"ffn_moe_topk-{i}", out[0][0])
        put(f"ffn_moe_weights_scaled-{i}", out[1][0])

    def comp(i, role, s, a, k, out):
        put(f"{role}-{i}", out[0][s._fid_before:])

    def pool_length(cls):
        """Compressor calls return the whole pool: remember its length before each call."""
        orig = cls.__call__

        def call(self, x, pool_cache, offset):
            pooled = None if pool_cache is None else pool_cache.pooled
            self._fid_before = 0 if pooled is None else pooled.shape[1]
            return orig(self, x, pool_cache, offset)
        cls.__call__ = call

    def indexer(i, role, s, a, k, out):
        """Picks per row, -1 where it picked fewer than index_topk (none before an entry exists)."""
        rows = a[0].shape[1]
        picks = np.full((rows, int(s.index_topk)), -1, np.int32)
        if out is not None:
            got = np.array(out[0]).astype(np.int32).reshape(rows, -1)
            picks[:, :got.shape[1]] = got
        rec.setdefault(f"lid_top_k-{i}", []).append(picks)

    pool_length(L.Compressor)
    wrap(L.DeepseekV4Block, block)
    wrap(L.LocalAttention, attn)
    wrap(L.DeepseekV4MoE, ffn)
    wrap(L.MoEGate, gate)
    wrap(L.Compressor, comp)
    wrap(L.Indexer, indexer)
    return rec
