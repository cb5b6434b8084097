"""The DeepSeek-V4.1 tensor table (docs/v41-architecture.md §6), generated from a V41Config:
every backbone tensor's DeepSeek-native name, logical shape and on-disk format. One source
of truth for random init, the V4.1 checkpoint reader/writer, validation and plan-memory.

Formats differ from V4's where V4.1 differs: FP8 weights carry 32x32 block scales (`FP8_32`,
a format of its own so no V4 code path reads them with its 128 grid), and the Engram tables
are FP8 rows with one E8M0 scale per 32 channels (`ENGRAM_TABLE`, gathered row by row, never
dequantised whole). Routed experts are V4's packed FP4 unchanged."""
from __future__ import annotations

from ..specs import BF16, F32, FP4, TensorSpec, attention_block_specs, embed_head_specs, expert_specs
from .config import V41Config

FP8_32 = "fp8-32"              # F8_E4M3 [out,in] + `.scale` F8_E8M0 [ceil(out/32), ceil(in/32)]
ENGRAM_TABLE = "engram-table"  # F8_E4M3 [rows, head_dim] + `.scale` F8_E8M0 [rows, head_dim/32]
FORMATS = (FP8_32, FP4, ENGRAM_TABLE, BF16, F32)
QUANTISED = (FP8_32, FP4)      # dequantised to bf16 when a layer is used
# Draft (DSpark `mtp.*`), vision tower and image-marker tensors: present in the release,
# outside the text logits the golden compares (doc §2, §6); recognised and skipped.
SKIP_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")


def is_skipped(name: str) -> bool:
    return name.startswith(SKIP_PREFIXES)


def _linear(name, out, inp, fmt=FP8_32):
    return TensorSpec(name + ".weight", (out, inp), fmt)


def layer_specs(cfg: V41Config, i: int) -> list[TensorSpec]:
    p = f"layers.{i}."
    d = cfg.dim
    s = attention_block_specs(cfg, i, FP8_32)
    s += compressor_specs(cfg, i) + indexer_specs(cfg, i)
    if i in cfg.engram_layer_ids:
        s += engram_specs(cfg, i)
    f = p + "ffn."
    s += [_linear(f + "gate", cfg.n_routed_experts, d, BF16),
          TensorSpec(f + "gate.bias", (cfg.n_routed_experts,), F32),
          TensorSpec(f + "gate.bias_vl", (cfg.n_routed_experts,), F32)]   # image tokens only
    if cfg.n_shared_experts:
        s += expert_specs(f + "shared_experts.", cfg, FP8_32)
    for e in range(cfg.n_routed_experts):
        s += expert_specs(f + f"experts.{e}.", cfg, FP4)
    return s


def compressor_specs(cfg: V41Config, i: int) -> list[TensorSpec]:
    """KV sources only: bf16 wkv (+ wgate for ratio 2: the softmax gate; ratio 1 is a plain
    projection) and the compressor norm. No `ape` (no overlap), unlike V4."""
    if i not in cfg.kv_source_layers:
        return []
    c = f"layers.{i}.attn.compressor."
    s = [_linear(c + "wkv", cfg.head_dim, cfg.dim, BF16)]
    if cfg.compress_ratios[i] == 2:
        s.append(_linear(c + "wgate", cfg.head_dim, cfg.dim, BF16))
    s.append(TensorSpec(c + "norm.weight", (cfg.head_dim,), BF16))
    return s


def indexer_specs(cfg: V41Config, i: int) -> list[TensorSpec]:
    """KV sources own the index-key projection (k_norm(wk(latent))); index sources own the
    query side. No indexer compressor (V4's), no Hadamard."""
    ix = f"layers.{i}.attn.indexer."
    s = []
    if i in cfg.kv_source_layers:
        s += [_linear(ix + "wk", cfg.index_head_dim, cfg.head_dim, BF16),
              TensorSpec(ix + "k_norm.weight", (cfg.index_head_dim,), BF16)]
    if i in cfg.index_source_layers:
        s += [_linear(ix + "wq_b", cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
              _linear(ix + "weights_proj", cfg.index_n_heads, cfg.dim, BF16)]
    return s


def engram_rows(cfg: V41Config, i: int) -> int:
    return cfg.engram_num_embeddings[cfg.engram_layer_ids.index(i)]


def engram_specs(cfg: V41Config, i: int) -> list[TensorSpec]:
    """The hashed table, its key/value projection wkv: (N-1)·heads·head_dim -> (hc+1)·dim
    (one key per stream + one shared value), and the q/k gate weights [hc, dim]."""
    e = f"layers.{i}.engram."
    cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
    return [TensorSpec(e + "embed.weight", (engram_rows(cfg, i), cfg.engram_head_dim), ENGRAM_TABLE),
            _linear(e + "wkv", (cfg.hc_mult + 1) * cfg.dim, cols * cfg.engram_head_dim),
            TensorSpec(e + "q_weight", (cfg.hc_mult, cfg.dim), BF16),
            TensorSpec(e + "k_weight", (cfg.hc_mult, cfg.dim), BF16)]


def global_specs(cfg: V41Config) -> list[TensorSpec]:
    """Embedding, final norm, head: no `hc_head_*` (the head collapses with the last FFN's
    pre-mix, doc §5.6)."""
    return embed_head_specs(cfg)


def all_specs(cfg: V41Config) -> list[TensorSpec]:
    out = global_specs(cfg)
    for i in range(cfg.n_layers):
        out += layer_specs(cfg, i)
    return out


def count_params(cfg: V41Config) -> int:
    """Logical parameter count of the backbone (draft, vision not included)."""
    return sum(t.numel for t in all_specs(cfg))
