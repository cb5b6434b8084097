"""ModelConfig: both DeepSeek config dialects, presets, validation messages."""
import json

import pytest

from reference_model.config import ConfigError, ModelConfig, flash, preset, tiny
from reference_model.specs import count_params
from reference_model.weights import meta_weights
from reference_model import Model, Numerics

# docs/research/dsv4-architecture.md §2, HF config.json of DeepSeek-V4-Flash (keys as shipped)
HF_FLASH = {
    "vocab_size": 129280, "hidden_size": 4096, "num_hidden_layers": 43, "num_nextn_predict_layers": 1,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
    "q_lora_rank": 1024, "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "rope_theta": 10000,
    "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-6, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus", "routed_scaling_factor": 1.5, "topk_method": "noaux_tc",
    "norm_topk_prob": True, "num_hash_layers": 3, "swiglu_limit": 10.0, "index_n_heads": 64,
    "index_head_dim": 128, "index_topk": 512, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

# inference/config.json (ModelArgs keys); absent keys take ModelArgs defaults
MODEL_ARGS_FLASH = {
    "vocab_size": 129280, "dim": 4096, "moe_inter_dim": 2048, "n_layers": 43, "n_hash_layers": 3,
    "n_heads": 64, "n_routed_experts": 256, "n_shared_experts": 1, "n_activated_experts": 6,
    "score_func": "sqrtsoftplus", "route_scale": 1.5, "swiglu_limit": 10.0, "q_lora_rank": 1024,
    "head_dim": 512, "rope_head_dim": 64, "o_groups": 8, "o_lora_rank": 1024, "window_size": 128,
    "original_seq_len": 65536, "rope_theta": 10000, "rope_factor": 16, "beta_fast": 32,
    "beta_slow": 1, "index_n_heads": 64, "index_head_dim": 128, "index_topk": 512, "hc_mult": 4,
    "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "dtype": "fp8", "scale_fmt": "ue8m0",
    "expert_dtype": "fp4", "compress_rope_theta": 160000,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
}

_SAME = [f for f in ModelConfig.__dataclass_fields__ if f not in ("name", "extra", "max_seq_len",
                                                                   "n_mtp_layers")]


def test_hf_config_equals_flash_preset():
    c = ModelConfig.from_dict(HF_FLASH)
    f = flash()
    for name in _SAME + ["max_seq_len"]:
        assert getattr(c, name) == getattr(f, name), name


def test_model_args_config_equals_flash_preset_except_reference_defaults():
    c = ModelConfig.from_dict(MODEL_ARGS_FLASH)
    f = flash()
    for name in _SAME:
        assert getattr(c, name) == getattr(f, name), name
    assert c.max_seq_len == 4096        # ModelArgs default: must be raised for long prompts


def test_from_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(HF_FLASH))
    assert ModelConfig.from_file(p).compress_ratios == flash().compress_ratios
    with pytest.raises(ConfigError, match="not valid JSON"):
        (tmp_path / "bad.json").write_text("{")
        ModelConfig.from_file(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="not found"):
        ModelConfig.from_file(tmp_path / "missing.json")


def test_flash_schedule_matches_research():
    c = flash()
    assert c.n_layers == 43 and len(c.compress_ratios) == 43
    assert c.compress_ratios == tuple([0, 0] + [4, 128] * 20 + [4])
    kinds = [s["kind"] for s in c.schedule()]
    assert kinds[:2] == ["swa", "swa"]
    assert [i for i, k in enumerate(kinds) if k == "csa"] == list(range(2, 43, 2))
    assert [i for i, k in enumerate(kinds) if k == "hca"] == list(range(3, 42, 2))
    assert [s["routing"] for s in c.schedule()][:4] == ["hash", "hash", "hash", "score"]
    sch = c.schedule()
    assert sch[0]["rope_theta"] == 10000 and not sch[0]["yarn"]
    assert sch[2]["rope_theta"] == 160000 and sch[2]["yarn"]


def test_flash_builds_on_meta_with_284b_parameters():
    w = meta_weights(flash())
    model = Model(w, Numerics())
    n = sum(t.numel() for k, t in w.tensors.items() if not k.endswith("tid2eid"))
    assert n == count_params(flash())
    assert abs(n - 284e9) / 284e9 < 0.01
    assert model.cfg.n_layers == 43
    assert all(t.device.type == "meta" for t in w.tensors.values())


def test_tiny_keeps_every_feature():
    c = tiny()
    kinds = {c.layer_kind(i) for i in range(c.n_layers)}
    assert kinds == {"swa", "csa", "hca"}
    assert 0 < c.n_hash_layers < c.n_layers
    assert c.hc_mult == 4
    assert c.index_topk < 1024 // 4            # the indexer selects at test lengths
    assert 1e6 < count_params(c) < 2e7


@pytest.mark.parametrize("change,needle", [
    ({"dim": 0}, "dim must be a positive int"),
    ({"index_head_dim": 96}, "index_head_dim"),
    ({"compress_ratios": (0, 4)}, "compress_ratios has 2 entries"),
    ({"n_activated_experts": 99}, "n_activated_experts"),
    ({"score_func": "relu"}, "score_func"),
    ({"rope_head_dim": 63}, "rope_head_dim"),
])
def test_invalid_config_names_the_field(change, needle):
    with pytest.raises(ConfigError, match=needle):
        tiny().replace(**change)


def test_missing_and_unknown_fields():
    d = dict(HF_FLASH)
    del d["index_topk"]
    with pytest.raises(ConfigError, match="missing field.*index_topk"):
        ModelConfig.from_dict(d)
    d = dict(HF_FLASH)
    del d["compress_ratios"]
    with pytest.raises(ConfigError, match="compress_ratios"):
        ModelConfig.from_dict(d)
    with pytest.raises(ConfigError, match="neither HF keys"):
        ModelConfig.from_dict({"foo": 1})
    with pytest.raises(ConfigError, match="unknown preset"):
        preset("nope")
