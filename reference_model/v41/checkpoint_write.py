"""Write a V4.1 model (any V41Config, e.g. tiny_v41 with random weights) as a sharded
DeepSeek-native checkpoint: FP8 e4m3 with 32x32 E8M0 block scales, FP4 experts as in V4,
Engram tables as e4m3 rows with E8M0 per 32 channels, the root config.json in the release's
composite form (`text_config` + `quantization_config`). V4's layer-wise writer does the
sharding, index and atomic publish; this module supplies the V4.1 table and encodings."""
from __future__ import annotations

from pathlib import Path

import torch

from ..checkpoint_format import natural_key
from ..checkpoint_write import CheckpointWriter, _input_problems as v4_input_problems
from ..checkpoint_write import encode as v4_encode, encode_fp8
from .checkpoint_format import disk_entries
from .config import _KEYS, V41Config
from .specs import ENGRAM_TABLE, FP8_32, TensorSpec, global_specs, layer_specs
from .weights import EngramTable, encode_rows


def hf_config_dict(cfg: V41Config) -> dict:
    """The root config.json as DeepSeek ships V4.1 (doc §2): text fields under
    `text_config`, quantisation and the image token at the root. V41Config.from_dict reads
    it back to an equal config."""
    t = {"model_type": "deepseek_v41_text"}
    for ours, (hf, _) in _KEYS.items():
        if ours != "image_token_id":
            v = getattr(cfg, ours)
            t[hf] = list(v) if isinstance(v, tuple) else v
    t.update({
        "compress_ratios": list(cfg.compress_ratios) + list(cfg.draft_ratios),
        "num_key_value_heads": 1, "max_position_embeddings": cfg.max_seq_len,
        "rope_scaling": {"rope_type": "yarn", "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.original_seq_len,
                         "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow},
        "engram_pad_token_id": cfg.engram_pad_id, "topk_method": "noaux_tc",
        "norm_topk_prob": True, "tie_word_embeddings": False,
    })
    t.update({k: v for k, v in cfg.extra.items() if k.startswith("dspark_")})
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
            "text_config": t, "image_token_id": cfg.image_token_id, "torch_dtype": "bfloat16",
            "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "weight_block_size": [cfg.weight_block_size] * 2,
                                    "scale_fmt": "ue8m0", "expert_dtype": "fp4"}}


def encode(spec: TensorSpec, t, block: int = 32) -> dict[str, torch.Tensor]:
    """In-memory tensor (or EngramTable) -> its safetensors entries (CPU, contiguous)."""
    if spec.fmt == ENGRAM_TABLE:
        tab = t if isinstance(t, EngramTable) else encode_rows(t.detach().cpu())
        w_e, s_e = disk_entries(spec)
        return {w_e.name: tab.codes.cpu().contiguous(), s_e.name: tab.scale.cpu().contiguous()}
    if spec.fmt == FP8_32:
        q, s = encode_fp8(t.detach().cpu(), block)
        w_e, s_e = disk_entries(spec, block)
        return {w_e.name: q.contiguous(), s_e.name: s.contiguous()}
    return v4_encode(spec, t)


class V41CheckpointWriter(CheckpointWriter):
    """V4's writer with the V4.1 tensor table, encodings and config.json."""

    def _specs(self, i: int | None = None):
        return global_specs(self.cfg) if i is None else layer_specs(self.cfg, i)

    def _input_problems(self, spec, t):
        if spec.fmt == ENGRAM_TABLE and isinstance(t, EngramTable):
            ok = tuple(t.shape) == tuple(spec.shape)
            return [] if ok else [f"wrong shape: {spec.name}: expected {list(spec.shape)}, "
                                  f"got {list(t.shape)}"]
        return v4_input_problems(spec, t)

    def _encode(self, spec, t):
        return encode(spec, t, self.cfg.weight_block_size)

    def _config_dict(self):
        return hf_config_dict(self.cfg)


def save_checkpoint(weights, out_dir, max_shard_bytes: int = 4 << 30,
                    overwrite: bool = False) -> Path:
    """Write a V4.1 weight source (V41Weights) as a DeepSeek-native checkpoint, one layer at
    a time; unknown tensor names are problems, raised together."""
    cfg = weights.cfg
    w = V41CheckpointWriter(out_dir, cfg, max_shard_bytes, overwrite)
    try:
        names = set(getattr(weights, "tensors", {}))
        known = {s.name for s in global_specs(cfg)}
        for i in range(cfg.n_layers):
            known |= {s.name for s in layer_specs(cfg, i)}
        w.problems += [f"unexpected tensor: {k}" for k in sorted(names - known, key=natural_key)]
        w.write_globals(weights.global_weights())
        for i in range(cfg.n_layers):
            w.write_layer(i, dict(weights.layer_weights(i)))
        return w.close()
    except BaseException:
        w.abort()
        raise


__all__ = ["V41CheckpointWriter", "encode", "hf_config_dict", "save_checkpoint"]
