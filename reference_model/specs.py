"""The checkpoint's tensor table, generated from a config (docs/research/dsv4-architecture.md §3.1): every tensor's
DeepSeek-native name, logical shape and on-disk format. One source of truth for random
init, the checkpoint reader/writer, validation and parameter counting."""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

# on-disk formats
FP8 = "fp8"      # F8_E4M3 weight + `.scale` F8_E8M0 on a 128×128 grid
FP4 = "fp4"      # I8 packed e2m1 (two per byte, low nibble first) + `.scale` F8_E8M0 per 1×32
BF16 = "bf16"
F32 = "f32"
I64 = "i64"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]      # logical shape (unpacked, before quantisation)
    fmt: str                    # one of FP8, FP4, BF16, F32, I64

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def _linear(name, out, inp, fmt=FP8):
    return TensorSpec(name + ".weight", (out, inp), fmt)


def attention_block_specs(cfg, i: int, fp8: str = FP8) -> list[TensorSpec]:
    """What every layer of both versions has: norms, the two mHC sites, attention sink and
    projections (FP8 weights in the version's format `fp8`)."""
    p = f"layers.{i}."
    hc, d = cfg.hc_mult, cfg.dim
    mix = (2 + hc) * hc
    s = [
        TensorSpec(p + "attn_norm.weight", (d,), BF16),
        TensorSpec(p + "ffn_norm.weight", (d,), BF16),
    ]
    for sub in ("attn", "ffn"):
        s += [TensorSpec(p + f"hc_{sub}_fn", (mix, hc * d), F32),
              TensorSpec(p + f"hc_{sub}_base", (mix,), F32),
              TensorSpec(p + f"hc_{sub}_scale", (3,), F32)]
    a = p + "attn."
    return s + [
        TensorSpec(a + "attn_sink", (cfg.n_heads,), F32),
        _linear(a + "wq_a", cfg.q_lora_rank, d, fp8),
        TensorSpec(a + "q_norm.weight", (cfg.q_lora_rank,), BF16),
        _linear(a + "wq_b", cfg.n_heads * cfg.head_dim, cfg.q_lora_rank, fp8),
        _linear(a + "wkv", cfg.head_dim, d, fp8),
        TensorSpec(a + "kv_norm.weight", (cfg.head_dim,), BF16),
        _linear(a + "wo_a", cfg.o_groups * cfg.o_lora_rank, cfg.n_heads * cfg.head_dim // cfg.o_groups, fp8),
        _linear(a + "wo_b", d, cfg.o_groups * cfg.o_lora_rank, fp8),
    ]


def layer_specs(cfg: ModelConfig, i: int) -> list[TensorSpec]:
    p = f"layers.{i}."
    a = p + "attn."
    d = cfg.dim
    s = attention_block_specs(cfg, i)
    ratio = cfg.compress_ratios[i]
    if ratio:
        s += compressor_specs(a + "compressor.", ratio, cfg.head_dim, d)
    if ratio == 4:
        ix = a + "indexer."
        s += [
            _linear(ix + "wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            _linear(ix + "weights_proj", cfg.index_n_heads, d, BF16),
        ]
        s += compressor_specs(ix + "compressor.", 4, cfg.index_head_dim, d)
    f = p + "ffn."
    s.append(_linear(f + "gate", cfg.n_routed_experts, d, BF16))
    if cfg.is_hash_layer(i):
        s.append(TensorSpec(f + "gate.tid2eid", (cfg.vocab_size, cfg.n_activated_experts), I64))
    else:
        s.append(TensorSpec(f + "gate.bias", (cfg.n_routed_experts,), F32))
    if cfg.n_shared_experts:
        s += expert_specs(f + "shared_experts.", cfg, FP8)
    for e in range(cfg.n_routed_experts):
        s += expert_specs(f + f"experts.{e}.", cfg, FP4)
    return s


def compressor_specs(prefix: str, ratio: int, head_dim: int, dim: int) -> list[TensorSpec]:
    coff = 2 if ratio == 4 else 1
    return [
        _linear(prefix + "wkv", coff * head_dim, dim, BF16),
        _linear(prefix + "wgate", coff * head_dim, dim, BF16),
        TensorSpec(prefix + "ape", (ratio, coff * head_dim), F32),
        TensorSpec(prefix + "norm.weight", (head_dim,), BF16),
    ]


def expert_specs(prefix: str, cfg, fmt: str) -> list[TensorSpec]:
    """One SwiGLU expert's w1 / w3 / w2 in format `fmt`."""
    return [_linear(prefix + "w1", cfg.moe_inter_dim, cfg.dim, fmt),
            _linear(prefix + "w3", cfg.moe_inter_dim, cfg.dim, fmt),
            _linear(prefix + "w2", cfg.dim, cfg.moe_inter_dim, fmt)]


def embed_head_specs(cfg) -> list[TensorSpec]:
    """Embedding, head and final norm (both versions)."""
    d = cfg.dim
    return [TensorSpec("embed.weight", (cfg.vocab_size, d), BF16),
            TensorSpec("head.weight", (cfg.vocab_size, d), BF16),
            TensorSpec("norm.weight", (d,), BF16)]


def global_specs(cfg: ModelConfig) -> list[TensorSpec]:
    hc, d = cfg.hc_mult, cfg.dim
    return embed_head_specs(cfg) + [
        TensorSpec("hc_head_fn", (hc, hc * d), F32),
        TensorSpec("hc_head_base", (hc,), F32),
        TensorSpec("hc_head_scale", (1,), F32),
    ]


def all_specs(cfg: ModelConfig) -> list[TensorSpec]:
    out = global_specs(cfg)
    for i in range(cfg.n_layers):
        out += layer_specs(cfg, i)
    return out


def count_params(cfg: ModelConfig) -> int:
    """Logical parameter count (quantised weights counted per element; tid2eid excluded)."""
    return sum(t.numel for t in all_specs(cfg) if t.fmt != I64)
