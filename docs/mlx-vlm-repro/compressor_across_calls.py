"""mlx-vlm 0.7.10, DeepSeek-V4: the overlapping (ratio-4) compressor loses the previous window
when its tokens arrive in separate calls (decode, chunked prefill).

DeepSeek-V4's ratio-4 compressor builds entry j from the first half of window j-1 and the second
half of window j. mlx-vlm's PoolingCache keeps only the unfinished window between calls, so
Compressor._overlap_compress_kv pads the first window of every call with zeros / -inf, as if it
were the sequence's first. The same 16 tokens in one call and one per call (what generation does)
give different entries from entry 1 on. Run with mlx-vlm's own venv:
    python docs/mlx-vlm-repro/compressor_across_calls.py"""
import mlx.core as mx
from mlx_vlm.models.cache import PoolingCache
from mlx_vlm.models.deepseek_v4.config import ModelConfig
from mlx_vlm.models.deepseek_v4.language import Compressor, _overlap_compress_kv

mx.random.seed(0)
cfg = ModelConfig(hidden_size=64, qk_rope_head_dim=16, num_hidden_layers=1, compress_ratios=[4])
comp = Compressor(cfg, compress_ratio=4, head_dim=32)
comp.ape = mx.random.normal(comp.ape.shape)
x = mx.random.normal((1, 16, 64))

one_call = comp(x, PoolingCache(4), 0)                   # 16 tokens, one call: 4 entries
cache = PoolingCache(4)
for t in range(16):                                      # the same tokens, one per call
    per_token = comp(x[:, t:t + 1], cache, t)
diff = mx.abs(one_call - per_token).max(axis=-1)[0]
print("max |one call - one token per call| per compressed entry:", [round(float(d), 4) for d in diff])
print("entry 0 equal:", float(diff[0]) < 1e-5, "| entries 1-3 differ:", bool((diff[1:] > 1e-2).all()))

# A candidate fix: the cache keeps the last completed window, and the compressor puts it before the
# windows completed in this call (then drops the entry it yields, which the previous call made).
overlap = Compressor.__call__


def carried(self, x, pool_cache, offset):
    if pool_cache is None or not self.overlap:
        return overlap(self, x, pool_cache, offset)
    kv, gate = self.wkv(x), self.wgate(x)
    ready_kv, ready_gate, base = pool_cache.accumulate_windows(kv, gate, offset)
    if ready_kv.size == 0:
        return pool_cache.update_and_fetch(mx.zeros((x.shape[0], 0, self.head_dim), dtype=x.dtype))
    prev = getattr(pool_cache, "prev_window", None)
    pool_cache.prev_window = (ready_kv[:, -4:], ready_gate[:, -4:])
    if prev is not None:
        ready_kv, ready_gate = mx.concatenate([prev[0], ready_kv], 1), mx.concatenate([prev[1], ready_gate], 1)
    new = _overlap_compress_kv(mx.unflatten(ready_kv, 1, (-1, 4)), mx.unflatten(ready_gate, 1, (-1, 4)),
                               self.ape, self.head_dim)
    new = self.norm(new[:, 1:] if prev is not None else new)
    return pool_cache.update_and_fetch(self.rope(new[:, None], offset=base).squeeze(1))


Compressor.__call__ = carried
cache = PoolingCache(4)
for t in range(16):
    fixed = comp(x[:, t:t + 1], cache, t)
print("with the previous window carried across calls, max |difference|:", round(float(mx.abs(one_call - fixed).max()), 7))
