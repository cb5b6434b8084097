"""Model configuration for DeepSeek-V4(-Flash): one dataclass, read from either of
DeepSeek's two config dialects (HF `config.json`, `inference/config.json` = `ModelArgs`),
validated field by field so a bad checkpoint config names the bad field."""
from __future__ import annotations

from dataclasses import dataclass

from .config_base import (ConfigError, ConfigSurface, SharedHead, SharedTail, common_checks, hf_rope,
                          missing_fields, positive_int_errors)
from .v41.markers import declared_v41, v41_markers


@dataclass(frozen=True)
class HashLayers:
    n_hash_layers: int                          # V4's first layers route by token id


@dataclass(frozen=True)
class ModelConfig(SharedTail, HashLayers, SharedHead, ConfigSurface):
    """DeepSeek-V4: the shared fields (config_base.SharedHead / SharedTail) and its hash-routed
    layers."""

    # ---- derived ---------------------------------------------------------------------
    def layer_kind(self, i: int) -> str:
        """'swa' (window only), 'csa' (ratio 4 + indexer) or 'hca' (other ratio, dense)."""
        r = self.compress_ratios[i]
        return "swa" if r == 0 else ("csa" if r == 4 else "hca")

    def is_hash_layer(self, i: int) -> bool:
        return i < self.n_hash_layers

    def indexer_layers(self) -> list[int]:
        """Layers that run an indexer (its top-k is what captures and needle report): CSA."""
        return [i for i, r in enumerate(self.compress_ratios) if r == 4]

    def schedule(self) -> list[dict]:
        return [
            {"layer": i, "kind": self.layer_kind(i), "ratio": self.compress_ratios[i],
             "routing": "hash" if self.is_hash_layer(i) else "score",
             "rope_theta": self.rope_theta if self.compress_ratios[i] == 0 else self.compress_rope_theta,
             "yarn": self.compress_ratios[i] != 0 and self.original_seq_len > 0}
            for i in range(self.n_layers)
        ]

    # ---- readers ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "ModelConfig":
        """Accept HF `config.json` keys, `ModelArgs` keys, or our own field names."""
        _refuse_v41(d)
        if "hidden_size" in d or "num_hidden_layers" in d:
            return from_hf_dict(d, name)
        if "dim" in d or "n_layers" in d:
            return from_model_args_dict(d, name)
        raise ConfigError("config has neither HF keys (hidden_size, num_hidden_layers) "
                          "nor ModelArgs keys (dim, n_layers)")


def _refuse_v41(d) -> None:
    """A DeepSeek-V4.1 config (model_type, or V4.1-only fields such as kv_source_layer_ids,
    engram_layer_ids, ratio 1) must not be misread as V4: point to V4.1 support instead."""
    if not isinstance(d, dict):
        return
    marks = v41_markers(d)
    if not marks:
        return
    mt = d.get("model_type")
    if not declared_v41(d) and mt is not None:
        raise ConfigError(f"model_type says {mt!r} but the fields are DeepSeek-V4.1's "
                          f"({', '.join(marks)}): a V4.1 config mislabelled as V4? Fix "
                          "model_type and load it with reference_model.v41.config.V41Config")
    raise ConfigError(f"this is a DeepSeek-V4.1 config ({', '.join(marks)}), which the V4 "
                      "loader does not read; load it with reference_model.v41.config.V41Config "
                      "(or v41.config.any_config_from_file for either version)")


# ---- key maps: our field <- (HF key, ModelArgs key) ------------------------------------
_KEYS = {
    "vocab_size": ("vocab_size", "vocab_size"),
    "dim": ("hidden_size", "dim"),
    "n_layers": ("num_hidden_layers", "n_layers"),
    "n_heads": ("num_attention_heads", "n_heads"),
    "head_dim": ("head_dim", "head_dim"),
    "rope_head_dim": ("qk_rope_head_dim", "rope_head_dim"),
    "q_lora_rank": ("q_lora_rank", "q_lora_rank"),
    "o_groups": ("o_groups", "o_groups"),
    "o_lora_rank": ("o_lora_rank", "o_lora_rank"),
    "window_size": ("sliding_window", "window_size"),
    "rope_theta": ("rope_theta", "rope_theta"),
    "compress_rope_theta": ("compress_rope_theta", "compress_rope_theta"),
    "norm_eps": ("rms_norm_eps", "norm_eps"),
    "n_routed_experts": ("n_routed_experts", "n_routed_experts"),
    "n_shared_experts": ("n_shared_experts", "n_shared_experts"),
    "n_activated_experts": ("num_experts_per_tok", "n_activated_experts"),
    "moe_inter_dim": ("moe_intermediate_size", "moe_inter_dim"),
    "route_scale": ("routed_scaling_factor", "route_scale"),
    "n_hash_layers": ("num_hash_layers", "n_hash_layers"),
    "swiglu_limit": ("swiglu_limit", "swiglu_limit"),
    "index_n_heads": ("index_n_heads", "index_n_heads"),
    "index_head_dim": ("index_head_dim", "index_head_dim"),
    "index_topk": ("index_topk", "index_topk"),
    "hc_mult": ("hc_mult", "hc_mult"),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
    "hc_eps": ("hc_eps", "hc_eps"),
    "score_func": ("scoring_func", "score_func"),
    "n_mtp_layers": ("num_nextn_predict_layers", "n_mtp_layers"),
    "bos_token_id": ("bos_token_id", "bos_token_id"),
    "eos_token_id": ("eos_token_id", "eos_token_id"),
}

# `ModelArgs` defaults of DeepSeek's reference (fields absent from inference/config.json).
_MODEL_ARGS_DEFAULTS = {
    "max_seq_len": 4096, "n_mtp_layers": 1, "score_func": "softmax", "n_hash_layers": 0,
    "rope_factor": 40, "original_seq_len": 0, "beta_fast": 32, "beta_slow": 1,
    "norm_eps": 1e-6, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20, "hc_mult": 4,
    "n_shared_experts": 1, "swiglu_limit": 0.0, "bos_token_id": 0, "eos_token_id": 1,
}


def _main_layer_ratios(ratios, n_layers: int, where: str) -> tuple[int, ...]:
    if not isinstance(ratios, (list, tuple)) or not all(isinstance(r, int) for r in ratios):
        raise ConfigError(f"{where}: compress_ratios must be a list of ints, got {ratios!r}")
    if len(ratios) < n_layers:
        raise ConfigError(f"{where}: compress_ratios has {len(ratios)} entries, fewer than "
                          f"n_layers={n_layers}")
    return tuple(ratios[:n_layers])   # trailing entries belong to MTP / DSpark stages


def from_hf_dict(d: dict, name: str = "custom") -> ModelConfig:
    kw = {}
    for ours, (hf, _) in _KEYS.items():
        if hf in d:
            kw[ours] = d[hf]
    if "layer_types" in d and "compress_ratios" not in d:
        inv = {"sliding_attention": 0, "compressed_sparse_attention": 4,
               "heavily_compressed_attention": 128}
        rates = d.get("compress_rates") or {}
        inv.update({k: v for k, v in rates.items()})
        d = {**d, "compress_ratios": [inv.get(t, -1) for t in d["layer_types"]]}
    if "num_hash_layers" not in d and "mlp_layer_types" in d:
        kw["n_hash_layers"] = sum(t == "hash_moe" for t in d["mlp_layer_types"])
    if "compress_ratios" not in d:
        raise ConfigError("config.json: missing field compress_ratios (or layer_types)")
    kw["compress_ratios"] = _main_layer_ratios(d["compress_ratios"], d.get("num_hidden_layers", 0),
                                               "config.json")
    hf_rope(kw, d, parameters=True)
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    kw.setdefault("n_mtp_layers", 0)
    return _build(kw, "config.json", name, d)


def from_model_args_dict(d: dict, name: str = "custom") -> ModelConfig:
    kw = {}
    for ours, (_, ma) in _KEYS.items():
        if ma in d:
            kw[ours] = d[ma]
    for k in ("rope_factor", "original_seq_len", "beta_fast", "beta_slow", "max_seq_len"):
        if k in d:
            kw[k] = d[k]
    for k, v in _MODEL_ARGS_DEFAULTS.items():
        kw.setdefault(k, v)
    if "compress_ratios" not in d:
        raise ConfigError("inference/config.json: missing field compress_ratios")
    kw["compress_ratios"] = _main_layer_ratios(d["compress_ratios"], d.get("n_layers", 0),
                                               "inference/config.json")
    return _build(kw, "inference/config.json", name, d)


def _build(kw: dict, where: str, name: str, raw: dict) -> ModelConfig:
    missing = missing_fields(ModelConfig, kw)
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    return validate(ModelConfig(name=name, extra={"source": where}, **kw))


# ---- validation ------------------------------------------------------------------------
def validate(c: ModelConfig) -> ModelConfig:
    errs = positive_int_errors(c)
    if errs:
        raise ConfigError("invalid config: " + "; ".join(errs))
    checks = [
        (c.rope_head_dim % 2 == 0 and c.rope_head_dim < c.head_dim,
         f"rope_head_dim ({c.rope_head_dim}) must be even and smaller than head_dim ({c.head_dim})"),
        (c.index_head_dim & (c.index_head_dim - 1) == 0,
         f"index_head_dim ({c.index_head_dim}) must be a power of two (Hadamard)"),
        (c.rope_head_dim < c.index_head_dim,
         f"rope_head_dim ({c.rope_head_dim}) must be smaller than index_head_dim ({c.index_head_dim})"),
        (c.index_head_dim % 32 == 0, f"index_head_dim ({c.index_head_dim}) must be a multiple of 32 (FP4 blocks)"),
        (c.nope_head_dim % 64 == 0, f"head_dim - rope_head_dim ({c.nope_head_dim}) must be a multiple of 64 (FP8 KV blocks)"),
        ((c.n_heads * c.head_dim) % c.o_groups == 0 and c.n_heads % c.o_groups == 0,
         f"n_heads ({c.n_heads}) must be divisible by o_groups ({c.o_groups})"),
        (all(r == 0 or r >= 2 for r in c.compress_ratios),
         f"compress_ratios entries must be 0 or >= 2, got {list(c.compress_ratios)}"),
        (0 <= c.n_hash_layers <= c.n_layers, f"n_hash_layers ({c.n_hash_layers}) out of range 0..{c.n_layers}"),
        (c.score_func in ("sqrtsoftplus", "softmax", "sigmoid"),
         f"score_func must be sqrtsoftplus, softmax or sigmoid, got {c.score_func!r}"),
    ] + common_checks(c)
    errs = [msg for ok, msg in checks if not ok]
    if errs:
        raise ConfigError("invalid config: " + "; ".join(errs))
    return c


ModelConfig._validate = staticmethod(validate)


# ---- presets ---------------------------------------------------------------------------
def flash() -> ModelConfig:
    """DeepSeek-V4-Flash, docs/research/dsv4-architecture.md §2 (43 main layers; MTP not modelled)."""
    return validate(ModelConfig(
        name="flash", vocab_size=129280, dim=4096, n_layers=43, n_heads=64, head_dim=512,
        rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024, window_size=128,
        compress_ratios=tuple([0, 0] + [4, 128] * 20 + [4]), rope_theta=10000.0,
        compress_rope_theta=160000.0, rope_factor=16.0, original_seq_len=65536,
        beta_fast=32.0, beta_slow=1.0, norm_eps=1e-6, n_routed_experts=256, n_shared_experts=1,
        n_activated_experts=6, moe_inter_dim=2048, route_scale=1.5, n_hash_layers=3,
        swiglu_limit=10.0, index_n_heads=64, index_head_dim=128, index_topk=512, hc_mult=4,
        hc_sinkhorn_iters=20, hc_eps=1e-6, max_seq_len=1048576, n_mtp_layers=1))


def tiny() -> ModelConfig:
    """A few-million-parameter model with every V4 feature: window-only, CSA and HCA layers,
    hash-routed and scored MoE, hc_mult 4, and index_topk (16) far below the number of
    compressed entries at test lengths (256 at 1K tokens) so the indexer really selects."""
    return validate(ModelConfig(
        name="tiny", vocab_size=512, dim=256, n_layers=5, n_heads=4, head_dim=128,
        rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, window_size=32,
        compress_ratios=(0, 4, 128, 4, 128), rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0, norm_eps=1e-6,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=128,
        route_scale=1.5, n_hash_layers=2, swiglu_limit=10.0, index_n_heads=4,
        index_head_dim=128, index_topk=16, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        max_seq_len=131072))


PRESETS = {"flash": flash, "tiny": tiny}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown preset {name!r}; valid: {', '.join(PRESETS)}") from None
