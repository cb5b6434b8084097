"""DeepSeek-V4.1 config (docs/v41-architecture.md §2, §3, §10, §11): both dialects, the
presets, the layer layout, the Engram constants against independent derivations, and named
errors for bad input; V4's loader refuses V4.1 configs by name."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import sympy

from reference_model.config import ConfigError, ModelConfig, flash
from reference_model.v41.config import (V41Config, any_config_from_file, from_dict, tiny_v41,
                                        v41_flash)
from reference_model.v41.engram import (RELEASE_MULTIPLIERS, bucket_primes, compressed_token_map,
                                        engram_layout, hash_multipliers, is_prime)
from reference_model.v41.specs import ENGRAM_TABLE, all_specs, count_params

# doc §2: the released root config.json (composite: text fields under text_config)
HF_V41_FLASH = {
    "architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic",
                            "weight_block_size": [32, 32], "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "vision_config": {"num_hidden_layers": 32, "hidden_size": 1024, "patch_size": 14},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120,
        "num_hidden_layers": 40, "num_nextn_predict_layers": 3, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
        "o_groups": 8, "o_lora_rank": 1024, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "max_position_embeddings": 1048576, "rms_norm_eps": 1e-20, "n_routed_experts": 384,
        "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 2304,
        "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "topk_method": "noaux_tc", "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_vocab_size": 16000000, "engram_max_ngram_size": 4, "engram_n_heads": 8,
        "engram_head_dim": 256, "engram_compressed_vocab_size": 99092, "engram_pad_token_id": 2,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
        "bos_token_id": 0, "eos_token_id": 1,
    },
}

# inference/config.json (REF ModelArgs names, doc §2 table)
MODEL_ARGS_V41_FLASH = {
    "vocab_size": 129280, "dim": 5120, "n_layers": 40, "n_mtp_layers": 3, "n_heads": 64,
    "head_dim": 512, "rope_head_dim": 64, "q_lora_rank": 1280, "o_groups": 8, "o_lora_rank": 1024,
    "window_size": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layers": [2, 8, 14, 20], "index_source_layers": [2, 8, 14, 20, 24, 28, 32, 36],
    "candidate_source_layer": 20, "candidate_topk_blocks": 2048, "candidate_block_size": 8,
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "rope_theta": 10000,
    "compress_rope_theta": 160000, "rope_factor": 16, "beta_fast": 32, "beta_slow": 1,
    "original_seq_len": 65536, "norm_eps": 1e-20, "n_routed_experts": 384, "n_shared_experts": 1,
    "n_activated_experts": 6, "moe_inter_dim": 2304, "score_func": "sqrtsoftplus",
    "route_scale": 1.5, "swiglu_limit": 10.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
    "engram_vocab_size": 16000000, "engram_max_ngram_size": 4, "engram_n_heads": 8,
    "engram_head_dim": 256, "engram_compressed_vocab_size": 99092, "engram_pad_id": 2,
    "image_token_id": 129264,
}

_SAME = [f for f in V41Config.__dataclass_fields__ if f not in ("name", "extra", "max_seq_len")]


def _hf(**text):
    d = copy.deepcopy(HF_V41_FLASH)
    d["text_config"].update(text)
    return d


def _err(d) -> str:
    with pytest.raises(ConfigError) as ei:
        from_dict(d)
    return str(ei.value)


# ---- dialects and presets -------------------------------------------------------------------
def test_root_config_json_equals_v41_flash_preset():
    c, f = from_dict(HF_V41_FLASH), v41_flash()
    for name in _SAME + ["max_seq_len"]:
        assert getattr(c, name) == getattr(f, name), name
    assert c.extra["dspark_target_layer_ids"] == [37, 38, 39]
    assert c.draft_ratios == (0, 0, 0) and c.n_mtp_layers == 3


def test_model_args_config_equals_preset_except_runtime_max_seq_len():
    c, f = from_dict(MODEL_ARGS_V41_FLASH), v41_flash()
    for name in _SAME:
        assert getattr(c, name) == getattr(f, name), name
    assert c.max_seq_len == 4096          # ModelArgs' runtime default, as in V4


def test_flat_text_config_and_file_reader(tmp_path):
    flat = dict(HF_V41_FLASH["text_config"])            # model_type deepseek_v41_text
    # image_token_id lives at the root of the composite file, not in text_config
    assert from_dict(flat).differences(v41_flash()) == ["image_token_id"]
    p = tmp_path / "V41" / "config.json"
    p.parent.mkdir()
    p.write_text(json.dumps(HF_V41_FLASH))
    c = any_config_from_file(p)
    assert isinstance(c, V41Config) and c.name == "V41"
    assert V41Config.from_file(p).config_hash() == c.config_hash()


def test_v41_flash_layer_layout_doc_section_3():
    c = v41_flash()
    modes = {i: c.layer_mode(i) for i in range(40)}
    assert [i for i, m in modes.items() if m == "full"] == [2, 8, 14, 20]
    assert [i for i, m in modes.items() if m == "reindex"] == [24, 28, 32, 36]
    assert modes[0] == modes[1] == "window"
    assert [c.kv_source(i) for i in (3, 7, 9, 19, 21, 39)] == [2, 2, 8, 14, 20, 20]
    assert [c.index_source(i) for i in (23, 25, 27, 29, 39)] == [20, 24, 24, 28, 36]
    assert [i for i in range(40) if c.uses_candidates(i)] == [24, 28, 32, 36]
    sched = c.schedule()
    assert sched[14]["engram"] and sched[1]["engram"] and not sched[2]["engram"]
    assert sched[0]["rope_theta"] == 10000 and not sched[0]["yarn"]
    assert sched[20]["rope_theta"] == 160000 and sched[20]["yarn"]


def test_tiny_v41_exercises_every_mechanism_doc_section_10():
    c = tiny_v41()
    assert set(c.compress_ratios) == {0, 1, 2}
    assert [c.layer_mode(i) for i in range(10)] == [
        "window", "window", "full", "reuse", "full", "reuse", "full", "reuse", "reindex", "reuse"]
    assert c.engram_layer_ids == (1, 4) and 4 in c.kv_source_layers
    assert c.candidate_source_layer == 6 and c.uses_candidates(8)
    # candidates: pool 4 blocks x 4 >= index_topk, so doc §9 D9's readings agree
    assert c.candidate_topk_blocks * c.candidate_block_size >= c.index_topk
    assert c.window_size < 64 and c.index_topk < 18
    # the second test config: 3 draft layers accepted and ignored
    d = json.loads(json.dumps(c.to_dict()))
    d.update(n_mtp_layers=3, compress_ratios=d["compress_ratios"] + [0, 0, 0], model_type="deepseek_v41")
    d.pop("draft_ratios")
    c3 = from_dict(d)
    assert c3.compress_ratios == c.compress_ratios and c3.draft_ratios == (0, 0, 0)


def test_parameter_count_ties_out_with_the_card():
    """552 B backbone + 196 B Engram = 748 B (doc §6, NOTE's card figures)."""
    c = v41_flash()
    eng = sum(s.numel for s in all_specs(c) if s.fmt == ENGRAM_TABLE)
    assert abs(eng / 1e9 - 196.6) < 0.05
    assert abs((count_params(c) - eng) / 1e9 - 552) < 0.5
    assert abs(count_params(c) / 1e9 - 748) < 1


# ---- Engram constants against independent derivations --------------------------------------
def test_is_prime_against_sympy():
    for n in list(range(0, 2000)) + list(range(16_000_000, 16_000_600)) + [2 ** 61 - 1, 2 ** 61 + 1]:
        assert is_prime(n) == sympy.isprime(n), n


def _sympy_primes(layers, N, heads, start):
    seen, out = set(), []
    for _ in layers:
        per = []
        for _n in range(2, N + 1):
            cur, hs = start - 1, []
            for _h in range(heads):
                cur = sympy.nextprime(cur)
                while cur in seen:
                    cur = sympy.nextprime(cur)
                seen.add(cur)
                hs.append(cur)
            per.append(tuple(hs))
        out.append(tuple(per))
    return tuple(out)


@pytest.mark.parametrize("cfg", [v41_flash, tiny_v41])
def test_bucket_primes_and_rows_match_sympy_and_config(cfg):
    c = cfg()
    L = engram_layout(c)
    assert L.primes == _sympy_primes(c.engram_layer_ids, 4, c.engram_n_heads, c.engram_vocab_size)
    assert L.rows == c.engram_num_embeddings
    assert all(L.offsets[k][0] == 0 and L.offsets[k][-1] + L.flat_primes(k)[-1] == L.rows[k]
               for k in range(2))


def test_tiny_primes_by_hand():
    assert bucket_primes((1, 4), 4, 2, 64) == (((67, 71), (73, 79), (83, 89)),
                                               ((97, 101), (103, 107), (109, 113)))


def test_multipliers_release_constants_and_numpy():
    """The carried release constants are what numpy derives (doc §5.2), and the tiny ones
    are the doc's §10 values; all odd, all below 2^63 / C."""
    for (C, N, layer), want in RELEASE_MULTIPLIERS.items():
        bound = max(1, (2 ** 63 - 1) // C // 2)
        v = np.random.default_rng(10007 * layer).integers(0, bound, size=N, dtype=np.int64)
        assert tuple(int(2 * x + 1) for x in v) == want
    assert hash_multipliers(1, 4, 430) == (17659599212592171, 1115332562415403, 8286781045276659,
                                           17050123821923315)
    assert hash_multipliers(4, 4, 430) == (18956580431069025, 1160941598022907, 16973181638442043,
                                           4368082047024809)
    for m in hash_multipliers(1, 4, 430) + RELEASE_MULTIPLIERS[(99092, 4, 14)]:
        assert m % 2 == 1


def test_compressed_vocabulary_of_the_tiny_tokenizer():
    """430 keys from the shipped 512-token tokenizer (doc §10); pad (eos, id 1) -> 1."""
    from tokenizers import Tokenizer
    from reference_model.tokenizer import DEFAULT_PATH
    tmap, C = compressed_token_map(Tokenizer.from_file(str(DEFAULT_PATH)))
    assert C == tiny_v41().engram_compressed_vocab_size == 430
    assert len(tmap) == 512 and tmap[1] == 1 and max(tmap) == C - 1


# ---- bad input: named errors --------------------------------------------------------------
@pytest.mark.parametrize("bad", [4, 3, 128, -1])
def test_ratio_outside_0_1_2_is_named(bad):
    r = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
    r[7] = bad
    assert f"compress_ratios[7] = {bad}: DeepSeek-V4.1 supports 0, 1, 2" in _err(_hf(compress_ratios=r))


def test_draft_ratio_must_be_zero():
    r = [0, 0] + [2] * 18 + [1] * 20 + [0, 2, 0]
    assert "compress_ratios[41] = 2: draft (DSpark) layers must have ratio 0" in _err(_hf(compress_ratios=r))


@pytest.mark.parametrize("missing", ["engram_num_embeddings", "engram_vocab_size",
                                     "engram_max_ngram_size", "engram_n_heads", "engram_head_dim",
                                     "engram_compressed_vocab_size", "engram_pad_token_id"])
def test_missing_engram_constants_are_named(missing):
    d = _hf()
    del d["text_config"][missing]
    msg = _err(d)
    assert "Engram constant(s) missing" in msg and missing in msg


def test_missing_engram_constants_all_listed_at_once():
    d = _hf()
    for k in ("engram_vocab_size", "engram_n_heads"):
        del d["text_config"][k]
    msg = _err(d)
    assert "engram_vocab_size" in msg and "engram_n_heads" in msg


def test_engram_rows_that_do_not_tie_out_are_named():
    msg = _err(_hf(engram_num_embeddings=[384006168, 384016681]))
    assert "Engram layer 14: primes sum to 384016682, config engram_num_embeddings says 384016681" in msg
    assert "engram_num_embeddings has 1 entries for 2 Engram layers" in _err(
        _hf(engram_num_embeddings=[384006168]))


def test_pad_key_dialects_d10():
    d = _hf()
    d["text_config"]["engram_pad_id"] = d["text_config"].pop("engram_pad_token_id")
    assert from_dict(d).engram_pad_id == 2
    d["text_config"]["engram_pad_token_id"] = 3
    assert "engram_pad_token_id (3) and engram_pad_id (2) disagree" in _err(d)


@pytest.mark.parametrize("text, needle", [
    ({"kv_source_layer_ids": [1, 8, 14, 20]}, "kv_source_layer_ids has layer 1, whose compress ratio is 0"),
    ({"kv_source_layer_ids": [8, 14, 20]}, "layer 2 (ratio 2) has no KV source at or before it"),
    ({"kv_source_layer_ids": [2, 8, 14]}, "layer 20 has ratio 1 but reads KV source layer 14 of ratio 2"),
    ({"index_source_layer_ids": [8, 14, 20, 24]}, "KV source layer 2 is not an index source"),
    ({"candidate_source_layer_id": 22}, "candidate_source_layer_id 22 is not an index source"),
    ({"index_source_layer_ids": [2, 8, 14, 20, 44]}, "index_source_layer_ids has layer 44, outside the backbone 0..39"),
    ({"kv_source_layer_ids": [8, 2, 14, 20]}, "kv_source_layer_ids [8, 2, 14, 20] must be strictly increasing"),
])
def test_inconsistent_sources_are_named(text, needle):
    assert needle in _err(_hf(**text))


def test_extra_index_source_of_the_right_ratio_is_accepted():
    """A reindex layer with ratio 2 inside a ratio-2 source's span is consistent."""
    c = from_dict(_hf(index_source_layer_ids=[2, 8, 14, 15, 20, 24, 28, 32, 36]))
    assert c.layer_mode(15) == "reindex" and c.index_source(16) == 15 and c.kv_source(16) == 14


def test_128_block_quantisation_is_refused():
    d = _hf()
    d["quantization_config"]["weight_block_size"] = [128, 128]
    assert "weight_block_size is [128, 128]; DeepSeek-V4.1 uses [32, 32]" in _err(d)


def test_v4_file_labelled_v41_is_named():
    from test_config import HF_FLASH
    d = dict(HF_FLASH, model_type="deepseek_v41", architectures=["DeepseekV41ForCausalLM"])
    msg = _err(d)
    assert "config says DeepSeek-V4.1 but its fields are DeepSeek-V4's" in msg
    assert "compress_ratios has 4 and 128" in msg and "num_hash_layers=3" in msg


def test_v4_config_is_not_read_as_v41():
    from test_config import HF_FLASH
    assert "not a DeepSeek-V4.1 config" in _err(HF_FLASH)
    from reference_model.v41.config import any_config_from_dict
    assert isinstance(any_config_from_dict(HF_FLASH), ModelConfig)


# ---- V4's loader refuses V4.1 -----------------------------------------------------------------
@pytest.mark.parametrize("d", [HF_V41_FLASH, HF_V41_FLASH["text_config"], MODEL_ARGS_V41_FLASH])
def test_v4_loader_refuses_v41_configs_by_name(d):
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d)
    msg = str(ei.value)
    assert "DeepSeek-V4.1 config" in msg and "reference_model.v41" in msg


def test_v41_config_labelled_v4_is_named_by_the_v4_loader():
    d = dict(HF_V41_FLASH["text_config"], model_type="deepseek_v4")
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d)
    assert "model_type says 'deepseek_v4' but the fields are DeepSeek-V4.1's" in str(ei.value)
    assert "kv_source_layer_ids" in str(ei.value)
    # and the V4.1 loader does not take an explicitly V4-labelled file either
    assert "not a DeepSeek-V4.1 config" in _err(d)


def test_v4_configs_still_load():
    from test_config import HF_FLASH, MODEL_ARGS_FLASH
    assert ModelConfig.from_dict(HF_FLASH).differences(flash()) == []
    assert isinstance(ModelConfig.from_dict(MODEL_ARGS_FLASH), ModelConfig)
