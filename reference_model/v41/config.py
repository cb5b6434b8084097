"""DeepSeek-V4.1 configuration (docs/v41-architecture.md §2, §3, §10, §11): one dataclass read
from either config dialect (the root HF `config.json` with its `text_config`, or
`inference/config.json` = REF `ModelArgs`), validated so bad input names what is wrong:
a compress ratio other than 0/1/2, missing Engram constants, sources that do not fit the
layer layout, a V4 file labelled V4.1.

Field names follow ModelArgs (as V4's ModelConfig does); the surface V4 tools use
(`schedule`, `to_dict`, `config_hash`, `layer_kind`, `replace`, ...) is kept, so inspect and
plan-memory read a V41Config like a ModelConfig. `version = "v4.1"` tells them apart."""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig
from ..config_base import ConfigError, ConfigSurface, SharedHead, SharedTail, hf_rope, missing_fields, read_json
from .config_checks import RATIOS, WEIGHT_BLOCK, validate
from .markers import V41_ONLY_KEYS, declared_v41, text_part, v41_markers


@dataclass(frozen=True)
class V41Own:
    """What only V4.1 has: KV / index sources, candidate blocks, Engram."""
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    candidate_source_layer: int                # < 0 disables candidate blocks
    candidate_topk_blocks: int
    candidate_block_size: int
    engram_layer_ids: tuple[int, ...]
    engram_num_embeddings: tuple[int, ...]
    engram_vocab_size: int
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_compressed_vocab_size: int
    engram_pad_id: int


@dataclass(frozen=True)
class V41Defaults:
    gate_temp: float = 1.0
    image_token_id: int = -1                   # -1: no image token (text-only config)
    weight_block_size: int = WEIGHT_BLOCK
    draft_ratios: tuple[int, ...] = ()         # compress_ratios entries of the draft layers


@dataclass(frozen=True)
class V41Config(V41Defaults, SharedTail, V41Own, SharedHead, ConfigSurface):
    """DeepSeek-V4.1: the shared fields (config_base.SharedHead / SharedTail; n_layers counts the
    backbone, the draft layers are not modelled), its own (V41Own) and their defaults."""

    version = "v4.1"                           # class attribute (reference_model.v41.is_v41)
    n_hash_layers = 0                          # V4.1 has no hash-routed layers (doc §5.5)

    # ---- derived ---------------------------------------------------------------------
    def is_hash_layer(self, i: int) -> bool:
        return False

    def kv_source(self, i: int) -> int | None:
        """The KV source whose compressed cache layer i reads: the latest at or before it."""
        if not self.compress_ratios[i]:
            return None
        return max((s for s in self.kv_source_layers if s <= i), default=None)

    def index_source(self, i: int) -> int | None:
        """The index source whose top-k layer i uses: the latest at or before it."""
        if not self.compress_ratios[i]:
            return None
        return max((s for s in self.index_source_layers if s <= i), default=None)

    def indexer_layers(self) -> list[int]:
        """Layers that run an indexer (its top-k is what captures and needle report): the
        index sources; the layers after them reuse their picks."""
        return [i for i in range(self.n_layers) if self.index_source(i) == i]

    def uses_candidates(self, i: int) -> bool:
        """Index sources after the candidate source restrict their top-k to its blocks."""
        return 0 <= self.candidate_source_layer < i and i in self.index_source_layers

    def layer_mode(self, i: int) -> str:
        """'window' (ratio 0), 'full' (owns the compressed KV and index keys), 'reindex'
        (own indexer on a source's keys) or 'reuse' (reads both)."""
        if not self.compress_ratios[i]:
            return "window"
        if i in self.kv_source_layers:
            return "full"
        return "reindex" if i in self.index_source_layers else "reuse"

    def layer_kind(self, i: int) -> str:
        """Kind label for tables: 'swa', or ratio + mode, e.g. 'c2-full', 'c1-reuse'."""
        r = self.compress_ratios[i]
        return "swa" if r == 0 else f"c{r}-{self.layer_mode(i)}"

    def schedule(self) -> list[dict]:
        return [
            {"layer": i, "kind": self.layer_kind(i), "ratio": r, "routing": "score",
             "rope_theta": self.rope_theta if r == 0 else self.compress_rope_theta,
             "yarn": r != 0 and self.original_seq_len > 0,
             "kv_source": self.kv_source(i), "index_source": self.index_source(i),
             "candidates": self.uses_candidates(i), "engram": i in self.engram_layer_ids}
            for i, r in enumerate(self.compress_ratios)
        ]

    # ---- readers ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict, name: str = "custom") -> "V41Config":
        return from_dict(d, name)



# ---- detection (the markers live in .markers so V4's config can read them) -----------
def is_v41_dict(d: dict) -> bool:
    """V4.1 by model_type / architectures, or (unlabelled) by V4.1-only fields."""
    if declared_v41(d):
        return True
    mt = text_part(d).get("model_type") or d.get("model_type")
    return mt is None and bool(v41_markers(d))


def _v4_signatures(t: dict, root: dict) -> list[str]:
    """What marks a config dict as DeepSeek-V4 rather than V4.1."""
    out = []
    ratios = t.get("compress_ratios")
    if isinstance(ratios, list):
        bad = sorted({r for r in ratios if r in (4, 128)})
        if bad:
            out.append(f"compress_ratios has {' and '.join(map(str, bad))}")
    for k in ("num_hash_layers", "n_hash_layers"):
        if t.get(k):
            out.append(f"{k}={t[k]}")
    if not any(k in t for k in ("kv_source_layer_ids", "kv_source_layers")):
        out.append("no kv_source_layer_ids")
    qc = root.get("quantization_config") or t.get("quantization_config")
    if isinstance(qc, dict) and list(qc.get("weight_block_size") or []) == [128, 128]:
        out.append("weight_block_size [128, 128]")
    return out


# ---- key maps: our field <- (HF text_config key, ModelArgs key) --------------------------
_KEYS = {
    "vocab_size": ("vocab_size", "vocab_size"),
    "dim": ("hidden_size", "dim"),
    "n_layers": ("num_hidden_layers", "n_layers"),
    "n_mtp_layers": ("num_nextn_predict_layers", "n_mtp_layers"),
    "n_heads": ("num_attention_heads", "n_heads"),
    "head_dim": ("head_dim", "head_dim"),
    "rope_head_dim": ("qk_rope_head_dim", "rope_head_dim"),
    "q_lora_rank": ("q_lora_rank", "q_lora_rank"),
    "o_groups": ("o_groups", "o_groups"),
    "o_lora_rank": ("o_lora_rank", "o_lora_rank"),
    "window_size": ("sliding_window", "window_size"),
    "kv_source_layers": ("kv_source_layer_ids", "kv_source_layers"),
    "index_source_layers": ("index_source_layer_ids", "index_source_layers"),
    "candidate_source_layer": ("candidate_source_layer_id", "candidate_source_layer"),
    "candidate_topk_blocks": ("candidate_topk_blocks", "candidate_topk_blocks"),
    "candidate_block_size": ("candidate_block_size", "candidate_block_size"),
    "index_n_heads": ("index_n_heads", "index_n_heads"),
    "index_head_dim": ("index_head_dim", "index_head_dim"),
    "index_topk": ("index_topk", "index_topk"),
    "rope_theta": ("rope_theta", "rope_theta"),
    "compress_rope_theta": ("compress_rope_theta", "compress_rope_theta"),
    "norm_eps": ("rms_norm_eps", "norm_eps"),
    "n_routed_experts": ("n_routed_experts", "n_routed_experts"),
    "n_shared_experts": ("n_shared_experts", "n_shared_experts"),
    "n_activated_experts": ("num_experts_per_tok", "n_activated_experts"),
    "moe_inter_dim": ("moe_intermediate_size", "moe_inter_dim"),
    "route_scale": ("routed_scaling_factor", "route_scale"),
    "score_func": ("scoring_func", "score_func"),
    "gate_temp": ("gate_temp", "gate_temp"),
    "swiglu_limit": ("swiglu_limit", "swiglu_limit"),
    "hc_mult": ("hc_mult", "hc_mult"),
    "hc_sinkhorn_iters": ("hc_sinkhorn_iters", "hc_sinkhorn_iters"),
    "hc_eps": ("hc_eps", "hc_eps"),
    "engram_layer_ids": ("engram_layer_ids", "engram_layer_ids"),
    "engram_num_embeddings": ("engram_num_embeddings", "engram_num_embeddings"),
    "engram_vocab_size": ("engram_vocab_size", "engram_vocab_size"),
    "engram_max_ngram_size": ("engram_max_ngram_size", "engram_max_ngram_size"),
    "engram_n_heads": ("engram_n_heads", "engram_n_heads"),
    "engram_head_dim": ("engram_head_dim", "engram_head_dim"),
    "engram_compressed_vocab_size": ("engram_compressed_vocab_size", "engram_compressed_vocab_size"),
    "image_token_id": ("image_token_id", "image_token_id"),
    "bos_token_id": ("bos_token_id", "bos_token_id"),
    "eos_token_id": ("eos_token_id", "eos_token_id"),
}
ENGRAM_KEYS = ("engram_num_embeddings", "engram_vocab_size", "engram_max_ngram_size",
               "engram_n_heads", "engram_head_dim", "engram_compressed_vocab_size")
PAD_KEYS = ("engram_pad_token_id", "engram_pad_id")          # doc §9 D10: both names in use
_TUPLES = ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
           "engram_num_embeddings", "draft_ratios")
# REF ModelArgs defaults the doc names (fields absent from inference/config.json)
_MODEL_ARGS_DEFAULTS = {"max_seq_len": 4096, "norm_eps": 1e-20, "gate_temp": 1.0, "hc_mult": 4,
                        "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "n_mtp_layers": 0,
                        "score_func": "sqrtsoftplus", "bos_token_id": 0, "eos_token_id": 1}


def from_dict(d: dict, name: str = "custom") -> V41Config:
    """A V4.1 config from the root HF config.json (text fields under `text_config`), a flat
    HF text config, or inference/config.json (ModelArgs keys)."""
    if not isinstance(d, dict):
        raise ConfigError(f"config is not a JSON object: {type(d).__name__}")
    t = text_part(d)
    hf = "hidden_size" in t or "num_hidden_layers" in t
    where = "config.json" if hf else "inference/config.json"
    if not hf and "dim" not in t and "n_layers" not in t:
        raise ConfigError("config has neither HF keys (hidden_size, num_hidden_layers) nor "
                          "ModelArgs keys (dim, n_layers)")
    if not is_v41_dict(d):
        mt = t.get("model_type") or d.get("model_type")
        raise ConfigError(f"{where}: not a DeepSeek-V4.1 config (model_type {mt!r}, none of "
                          f"{', '.join(V41_ONLY_KEYS[::2])}); load DeepSeek-V4 configs with "
                          "reference_model.config.ModelConfig")
    v4 = _v4_signatures(t, d)
    if declared_v41(d) and len(v4) >= 2:
        raise ConfigError(f"{where}: config says DeepSeek-V4.1 but its fields are DeepSeek-V4's "
                          f"({'; '.join(v4)}): a V4 config mislabelled as V4.1?")
    col = 0 if hf else 1
    kw = {ours: t[keys[col]] for ours, keys in _KEYS.items() if keys[col] in t}
    if hf:
        if "image_token_id" in d and "image_token_id" not in kw:
            kw["image_token_id"] = d["image_token_id"]
        hf_rope(kw, t)
        kw.setdefault("n_mtp_layers", 0)
        kw.setdefault("norm_eps", 1e-20)
    else:
        for k in ("rope_factor", "original_seq_len", "beta_fast", "beta_slow", "max_seq_len"):
            if k in t:
                kw[k] = t[k]
        for k, v in _MODEL_ARGS_DEFAULTS.items():
            kw.setdefault(k, v)
    kw["weight_block_size"] = _block_size(d, t, where)
    _pad(kw, t, d, where)
    _ratios(kw, t, where)
    kw.setdefault("candidate_source_layer", -1)
    kw.setdefault("candidate_topk_blocks", 0)
    kw.setdefault("candidate_block_size", 1)
    if isinstance(kw.get("eos_token_id"), list):
        kw["eos_token_id"] = kw["eos_token_id"][0]
    kw.setdefault("engram_layer_ids", ())
    _engram_defaults(kw, where)
    for k in _TUPLES:
        if k in kw:
            v = kw[k]
            if not isinstance(v, (list, tuple)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                raise ConfigError(f"{where}: {k} must be a list of ints, got {v!r}")
            kw[k] = tuple(v)
    missing = missing_fields(V41Config, kw)
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}")
    extra = {"source": where}
    extra.update({k: v for k, v in t.items() if k.startswith("dspark_")})
    return validate(V41Config(name=name, extra=extra, **kw))


def _block_size(root: dict, t: dict, where: str) -> int:
    qc = root.get("quantization_config") or t.get("quantization_config")
    if qc is None:
        return WEIGHT_BLOCK                    # inference/config.json: hard-coded in REF
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}: quantization_config is not an object: {qc!r}")
    bs = qc.get("weight_block_size", [WEIGHT_BLOCK, WEIGHT_BLOCK])
    if list(bs) != [WEIGHT_BLOCK, WEIGHT_BLOCK]:
        raise ConfigError(f"{where}: quantization_config.weight_block_size is {list(bs)}; "
                          f"DeepSeek-V4.1 uses [32, 32] (128x128 is DeepSeek-V4's)")
    return WEIGHT_BLOCK


def _pad(kw: dict, t: dict, root: dict, where: str) -> None:
    """D10: the pad id is `engram_pad_token_id` (root config, vLLM, ATOM) or `engram_pad_id`
    (REF ModelArgs, transformers); either is accepted, both must agree."""
    vals = {k: t[k] for k in PAD_KEYS if k in t}
    vals.update({k: root[k] for k in PAD_KEYS if k in root and k not in vals})
    if len(set(vals.values())) > 1:
        raise ConfigError(f"{where}: engram_pad_token_id ({vals['engram_pad_token_id']}) and "
                          f"engram_pad_id ({vals['engram_pad_id']}) disagree")
    if vals:
        kw["engram_pad_id"] = next(iter(vals.values()))


def _ratios(kw: dict, t: dict, where: str) -> None:
    """Backbone ratios (each in 0/1/2) and draft ratios (each 0), named by index."""
    ratios = t.get("compress_ratios")
    if ratios is None:
        raise ConfigError(f"{where}: missing field compress_ratios")
    if not isinstance(ratios, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios):
        raise ConfigError(f"{where}: compress_ratios must be a list of ints, got {ratios!r}")
    n = kw.get("n_layers")
    if not isinstance(n, int) or n <= 0:
        raise ConfigError(f"{where}: n_layers must be a positive int, got {n!r}")
    if len(ratios) < n:
        raise ConfigError(f"{where}: compress_ratios has {len(ratios)} entries, fewer than "
                          f"the {n} backbone layers")
    for i, r in enumerate(ratios):
        if i < n and r not in RATIOS:
            raise ConfigError(f"{where}: compress_ratios[{i}] = {r}: DeepSeek-V4.1 supports "
                              "0, 1, 2")
        if i >= n and r != 0:
            raise ConfigError(f"{where}: compress_ratios[{i}] = {r}: draft (DSpark) layers "
                              "must have ratio 0")
    kw["compress_ratios"] = tuple(ratios[:n])
    kw["draft_ratios"] = tuple(ratios[n:])


def _engram_defaults(kw: dict, where: str) -> None:
    """Engram constants are required (and named when missing) once a layer has Engram;
    without Engram layers they default to empty/zero."""
    if kw["engram_layer_ids"]:
        missing = [k for k in ENGRAM_KEYS if k not in kw]
        if "engram_pad_id" not in kw:
            missing.append("engram_pad_token_id (or engram_pad_id)")
        if missing:
            raise ConfigError(f"{where}: engram_layer_ids is {list(kw['engram_layer_ids'])} but "
                              f"Engram constant(s) missing: {', '.join(missing)}")
        return
    for k, v in {"engram_num_embeddings": (), "engram_vocab_size": 0, "engram_max_ngram_size": 0,
                 "engram_n_heads": 0, "engram_head_dim": 0, "engram_compressed_vocab_size": 0,
                 "engram_pad_id": 0}.items():
        kw.setdefault(k, v)


V41Config._validate = staticmethod(validate)


# ---- presets ---------------------------------------------------------------------------
def v41_flash() -> V41Config:
    """DeepSeek-V4.1-Flash from its published config (doc §2): 40 backbone layers, 3 draft
    (DSpark) layers not modelled."""
    return validate(V41Config(
        name="v41-flash", vocab_size=129280, dim=5120, n_layers=40, n_heads=64, head_dim=512,
        rope_head_dim=64, q_lora_rank=1280, o_groups=8, o_lora_rank=1024, window_size=128,
        compress_ratios=tuple([0, 0] + [2] * 18 + [1] * 20), kv_source_layers=(2, 8, 14, 20),
        index_source_layers=(2, 8, 14, 20, 24, 28, 32, 36), candidate_source_layer=20,
        candidate_topk_blocks=2048, candidate_block_size=8, index_n_heads=32,
        index_head_dim=128, index_topk=512, rope_theta=10000.0, compress_rope_theta=160000.0,
        rope_factor=16.0, original_seq_len=65536, beta_fast=32.0, beta_slow=1.0, norm_eps=1e-20,
        n_routed_experts=384, n_shared_experts=1, n_activated_experts=6, moe_inter_dim=2304,
        route_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        max_seq_len=1048576, engram_layer_ids=(1, 14),
        engram_num_embeddings=(384006168, 384016682), engram_vocab_size=16_000_000,
        engram_max_ngram_size=4, engram_n_heads=8, engram_head_dim=256,
        engram_compressed_vocab_size=99092, engram_pad_id=2, image_token_id=129264,
        n_mtp_layers=3, draft_ratios=(0, 0, 0),
        extra={"dspark_block_size": 5, "dspark_noise_token_id": 128799,
               "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
               "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3}))


def tiny_v41() -> V41Config:
    """Doc §10: every V4.1 mechanism at test lengths on CPU: window-only layers 0-1 (Engram
    at 1), ratio-2 sources 2 and 4 (Engram at 4) with reuse 3 and 5, the ratio-1 source and
    candidate source 6 with reuse 7, reindex 8 inside 6's candidates, reuse 9 of 8."""
    return validate(V41Config(
        name="tiny-v41", vocab_size=512, dim=256, n_layers=10, n_heads=4, head_dim=128,
        rope_head_dim=64, q_lora_rank=128, o_groups=2, o_lora_rank=64, window_size=16,
        compress_ratios=(0, 0, 2, 2, 2, 2, 1, 1, 1, 1), kv_source_layers=(2, 4, 6),
        index_source_layers=(2, 4, 6, 8), candidate_source_layer=6, candidate_topk_blocks=4,
        candidate_block_size=4, index_n_heads=4, index_head_dim=128, index_topk=8,
        rope_theta=10000.0, compress_rope_theta=160000.0, rope_factor=16.0,
        original_seq_len=65536, beta_fast=32.0, beta_slow=1.0, norm_eps=1e-20,
        n_routed_experts=8, n_shared_experts=1, n_activated_experts=2, moe_inter_dim=64,
        route_scale=1.5, swiglu_limit=10.0, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        max_seq_len=131072, engram_layer_ids=(1, 4), engram_num_embeddings=(462, 630),
        engram_vocab_size=64, engram_max_ngram_size=4, engram_n_heads=2, engram_head_dim=32,
        engram_compressed_vocab_size=430, engram_pad_id=1))


PRESETS = {"v41-flash": v41_flash, "tiny-v41": tiny_v41}


def preset(name: str) -> V41Config:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown V4.1 preset {name!r}; valid: {', '.join(PRESETS)}") from None


# ---- either version ---------------------------------------------------------------------
def any_config_from_dict(d: dict, name: str = "custom"):
    """V41Config for a V4.1 config dict, V4's ModelConfig otherwise."""
    if isinstance(d, dict) and is_v41_dict(d):
        return from_dict(d, name)
    return ModelConfig.from_dict(d, name)


def any_config_from_file(path):
    """Read a config.json of either version (ConfigError names what is wrong)."""
    d, name = read_json(path)
    return any_config_from_dict(d, name)
