"""mlx-vlm 0.7.10, DeepSeek-V4: called without a cache (as a scorer or a fine-tuning loop calls
it), the model is not causal: every position attends to every compressed entry, including the
entries built from later tokens.

With a cache, PoolingCache.make_mask hides entry i from positions before its window ends; with
cache=None, CompressedAttention / SparseCompressedAttention and the Indexer get no pool mask at
all. Changing the last tokens of a prompt then changes the log-probs at position 0. Run with
mlx-vlm's own venv:
    python docs/mlx-vlm-repro/forward_without_cache.py"""
import mlx.core as mx
from mlx_vlm.models.deepseek_v4.config import ModelConfig
from mlx_vlm.models.deepseek_v4.language import LanguageModel

mx.random.seed(0)
cfg = ModelConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, head_dim=32,
                  qk_rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16, n_routed_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=32, num_hash_layers=0, sliding_window=8,
                  index_n_heads=2, index_head_dim=32, index_topk=4, compress_ratios=[0, 4])
model = LanguageModel(cfg)
ids = mx.random.randint(0, 64, (1, 32))
changed = mx.concatenate([ids[:, :24], (ids[:, 24:] + 1) % 64], axis=1)   # only tokens 24.. differ


def first_logits(tokens, cache):
    return model(tokens, cache=cache).logits[0, :24]


no_cache = mx.abs(first_logits(ids, None) - first_logits(changed, None)).max(axis=-1)
with_cache = mx.abs(first_logits(ids, model.make_cache()) - first_logits(changed, model.make_cache())).max(axis=-1)
print("positions 0-23, max |logit change| when tokens 24-31 change:")
print("  without a cache:", round(float(no_cache.max()), 4), "(position 0:", round(float(no_cache[0]), 4), ")")
print("  with its cache: ", round(float(with_cache.max()), 6))
