"""What the configs of both DeepSeek versions share (config.py: V4's ModelConfig; v41/config.py:
V41Config): the error type, the derived surface tools read (`to_dict`, `config_hash`,
`differences`, `replace`, `from_file`), reading a config file, the HF RoPE-scaling block and
the checks every version makes. The fields themselves are each version's."""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path


class ConfigError(ValueError):
    """A configuration value is missing, malformed or inconsistent."""


# Fields every version requires as positive ints.
POSITIVE_INT = ("vocab_size", "dim", "n_layers", "n_heads", "head_dim", "rope_head_dim",
                "q_lora_rank", "o_groups", "o_lora_rank", "window_size", "n_routed_experts",
                "n_activated_experts", "moe_inter_dim", "index_n_heads", "index_head_dim",
                "index_topk", "hc_mult", "hc_sinkhorn_iters", "max_seq_len")


# The fields both versions declare, once. A version's dataclass lists these two blocks as its
# bases around its own fields -- `class ModelConfig(SharedTail, HashLayers, SharedHead)` --
# and dataclasses order fields from the last base to the first: head, the version's own, tail
# (V4's field order is unchanged, so its manifests and to_dict() read as before).
@dataclass(frozen=True)
class SharedHead:
    vocab_size: int
    dim: int
    n_layers: int                               # main (backbone) layers; MTP / draft layers apart
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    compress_ratios: tuple[int, ...]            # one per main layer (MTP / draft entries dropped)
    rope_theta: float
    compress_rope_theta: float
    rope_factor: float
    original_seq_len: int                       # 0 disables YaRN
    beta_fast: float
    beta_slow: float
    norm_eps: float
    n_routed_experts: int
    n_shared_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float


@dataclass(frozen=True)
class SharedTail:
    swiglu_limit: float
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    max_seq_len: int
    score_func: str = "sqrtsoftplus"
    n_mtp_layers: int = 0
    bos_token_id: int = 0
    eos_token_id: int = 1
    name: str = "custom"
    extra: dict = field(default_factory=dict, compare=False, hash=False, repr=False)


class ConfigSurface:
    """Methods of a frozen config dataclass; `_validate` is the version's validator."""

    @property
    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("extra")
        return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

    def differences(self, other) -> list[str]:
        """The fields (name aside) in which two configs differ: another architecture."""
        a, b = self.to_dict(), other.to_dict()
        return [k for k in a if k != "name" and a[k] != b.get(k)]

    def config_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]

    def replace(self, **changes):
        return type(self)._validate(dataclasses.replace(self, **changes))

    @classmethod
    def from_file(cls, path):
        d, name = read_json(path)
        return cls.from_dict(d, name=name)


def read_json(path) -> tuple[dict, str]:
    """A config file's JSON object and the model name (its folder's)."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file {path} is not valid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"config file {path} is not a JSON object")
    return d, path.parent.name or "custom"


def hf_rope(kw: dict, t: dict, parameters: bool = False) -> None:
    """YaRN fields and max_seq_len from an HF text config's rope_scaling (`parameters`:
    also V4's newer transformers spelling, rope_parameters.compress)."""
    rs = t.get("rope_scaling") or ((t.get("rope_parameters") or {}).get("compress") if parameters
                                   else None) or {}
    kw["rope_factor"] = rs.get("factor", 1.0)
    kw["original_seq_len"] = rs.get("original_max_position_embeddings", 0)
    kw["beta_fast"] = rs.get("beta_fast", 32)
    kw["beta_slow"] = rs.get("beta_slow", 1)
    kw["max_seq_len"] = t.get("max_position_embeddings", 4096)


def missing_fields(cls, kw: dict) -> list[str]:
    """Required fields of the config class that `kw` lacks."""
    names = {f.name for f in dataclasses.fields(cls)} - {"extra", "name"}
    return sorted(n for n in names if n not in kw
                  and cls.__dataclass_fields__[n].default is dataclasses.MISSING)


def positive_int_errors(c) -> list[str]:
    return [f"{f} must be a positive int, got {getattr(c, f)!r}" for f in POSITIVE_INT
            if not isinstance(getattr(c, f), int) or isinstance(getattr(c, f), bool)
            or getattr(c, f) <= 0]


def common_checks(c) -> list[tuple[bool, str]]:
    """(ok, message) checks both versions make."""
    return [
        (len(c.compress_ratios) == c.n_layers,
         f"compress_ratios has {len(c.compress_ratios)} entries for n_layers={c.n_layers}"),
        (c.n_activated_experts <= c.n_routed_experts,
         f"n_activated_experts ({c.n_activated_experts}) > n_routed_experts ({c.n_routed_experts})"),
        (c.n_shared_experts in (0, 1), f"n_shared_experts must be 0 or 1, got {c.n_shared_experts}"),
        (c.norm_eps > 0 and c.hc_eps > 0, f"norm_eps ({c.norm_eps}) and hc_eps ({c.hc_eps}) must be > 0"),
        (c.rope_factor >= 1, f"rope_factor must be >= 1, got {c.rope_factor}"),
        (c.original_seq_len >= 0, f"original_seq_len must be >= 0, got {c.original_seq_len}"),
        (c.swiglu_limit >= 0, f"swiglu_limit must be >= 0, got {c.swiglu_limit}"),
        (0 <= c.bos_token_id < c.vocab_size and 0 <= c.eos_token_id < c.vocab_size,
         f"bos/eos token ids must be in [0, vocab_size={c.vocab_size})"),
    ]
