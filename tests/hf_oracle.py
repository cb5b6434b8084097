"""Build transformers' own `DeepseekV4ForCausalLM` from our (ModelConfig, DeepSeek-native
weights), so a test can use it as an independent oracle for the golden forward.

The name map is written here from reading the transformers modeling file (not imported
from its conversion table), and `build_hf_model` fails if any parameter or persistent
buffer of the transformers model is left unfilled, or any of our tensors is unused."""
from __future__ import annotations

import contextlib
import re

import torch

from reference_model.config import ModelConfig
from reference_model.weights import InMemoryWeights

# Our compress ratio -> transformers attention layer type.
_LAYER_TYPE = {0: "sliding_attention", 4: "compressed_sparse_attention",
               128: "heavily_compressed_attention"}


def hf_config(cfg: ModelConfig, attn_implementation: str = "eager"):
    """A `DeepseekV4Config` with our config's values. YaRN is given explicitly with
    `attention_factor=1.0` (DeepSeek's reference has no YaRN amplitude / mscale)."""
    from transformers import DeepseekV4Config

    hca = sorted({r for r in cfg.compress_ratios if r not in (0, 4)})
    if len(hca) > 1:
        raise ValueError(f"transformers supports one HCA ratio per model, got {hca}")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": hca[0] if hca else 128}
    layer_types = [_LAYER_TYPE[0] if r == 0 else _LAYER_TYPE[4] if r == 4 else _LAYER_TYPE[128]
                   for r in cfg.compress_ratios]
    rope = {"rope_type": "yarn", "factor": float(cfg.rope_factor),
            "original_max_position_embeddings": cfg.original_seq_len,
            "beta_fast": float(cfg.beta_fast), "beta_slow": float(cfg.beta_slow),
            "attention_factor": 1.0}
    if cfg.original_seq_len == 0:
        rope = {"rope_type": "default"}
    c = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, moe_intermediate_size=cfg.moe_inter_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        partial_rotary_factor=cfg.rope_head_dim / cfg.head_dim,
        num_experts_per_tok=cfg.n_activated_experts, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.score_func,
        norm_topk_prob=cfg.score_func != "softmax", routed_scaling_factor=cfg.route_scale,
        max_position_embeddings=cfg.max_seq_len, rope_theta=cfg.rope_theta,
        layer_types=layer_types, compress_rates=rates, compress_rope_theta=cfg.compress_rope_theta,
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.n_layers)],
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.window_size, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, num_nextn_predict_layers=0,
        rms_norm_eps=cfg.norm_eps, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False, rope_parameters=rope,
    )
    c._attn_implementation = attn_implementation
    return c


# (regex on our layer-local name, transformers name template relative to model.layers.{i}.)
_LAYER_MAP = [
    (r"attn_norm\.weight", "input_layernorm.weight"),
    (r"ffn_norm\.weight", "post_attention_layernorm.weight"),
    (r"hc_attn_(fn|base|scale)", r"attn_hc.\1"),
    (r"hc_ffn_(fn|base|scale)", r"ffn_hc.\1"),
    (r"attn\.attn_sink", "self_attn.sinks"),
    (r"attn\.wq_a\.weight", "self_attn.q_a_proj.weight"),
    (r"attn\.q_norm\.weight", "self_attn.q_a_norm.weight"),
    (r"attn\.wq_b\.weight", "self_attn.q_b_proj.weight"),
    (r"attn\.wkv\.weight", "self_attn.kv_proj.weight"),
    (r"attn\.kv_norm\.weight", "self_attn.kv_norm.weight"),
    (r"attn\.wo_a\.weight", "self_attn.o_a_proj.weight"),
    (r"attn\.wo_b\.weight", "self_attn.o_b_proj.weight"),
    (r"attn\.compressor\.wkv\.weight", "self_attn.compressor.kv_proj.weight"),
    (r"attn\.compressor\.wgate\.weight", "self_attn.compressor.gate_proj.weight"),
    (r"attn\.compressor\.ape", "self_attn.compressor.position_bias"),
    (r"attn\.compressor\.norm\.weight", "self_attn.compressor.kv_norm.weight"),
    (r"attn\.indexer\.wq_b\.weight", "self_attn.compressor.indexer.q_b_proj.weight"),
    (r"attn\.indexer\.weights_proj\.weight", "self_attn.compressor.indexer.scorer.weights_proj.weight"),
    (r"attn\.indexer\.compressor\.wkv\.weight", "self_attn.compressor.indexer.kv_proj.weight"),
    (r"attn\.indexer\.compressor\.wgate\.weight", "self_attn.compressor.indexer.gate_proj.weight"),
    (r"attn\.indexer\.compressor\.ape", "self_attn.compressor.indexer.position_bias"),
    (r"attn\.indexer\.compressor\.norm\.weight", "self_attn.compressor.indexer.kv_norm.weight"),
    (r"ffn\.gate\.weight", "mlp.gate.weight"),
    (r"ffn\.gate\.bias", "mlp.gate.e_score_correction_bias"),
    (r"ffn\.gate\.tid2eid", "mlp.gate.tid2eid"),
    (r"ffn\.shared_experts\.w1\.weight", "mlp.shared_experts.gate_proj.weight"),
    (r"ffn\.shared_experts\.w3\.weight", "mlp.shared_experts.up_proj.weight"),
    (r"ffn\.shared_experts\.w2\.weight", "mlp.shared_experts.down_proj.weight"),
]
_GLOBAL_MAP = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
_EXPERT = re.compile(r"ffn\.experts\.(\d+)\.(w[123])\.weight")


def _as(t: torch.Tensor, dtype) -> torch.Tensor:
    return t.clone() if t.dtype in (torch.int64, torch.int32) else t.to(dtype).clone()


def hf_state_dict(cfg: ModelConfig, weights: InMemoryWeights, dtype=torch.float32) -> dict:
    """Native tensors renamed/fused into a transformers state dict. Raises if a native
    tensor has no destination."""
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.global_weights().items():
        out[_GLOBAL_MAP[k]] = _as(v, dtype)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        lw = weights.layer_weights(i)
        experts: dict[int, dict[str, torch.Tensor]] = {}
        for name, v in lw.items():
            m = _EXPERT.fullmatch(name)
            if m:
                experts.setdefault(int(m.group(1)), {})[m.group(2)] = v
                continue
            for pat, tmpl in _LAYER_MAP:
                if re.fullmatch(pat, name):
                    out[p + re.sub(pat, tmpl, name)] = _as(v, dtype)
                    break
            else:
                raise KeyError(f"layer {i}: no transformers destination for native tensor {name!r}")
        n = cfg.n_routed_experts
        if sorted(experts) != list(range(n)):
            raise KeyError(f"layer {i}: experts {sorted(experts)} != 0..{n - 1}")
        # gate_up_proj[e] = [w1 (gate); w3 (up)] on the output axis -> [E, 2I, D]; down [E, D, I]
        out[p + "mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["w1"], experts[e]["w3"]], 0) for e in range(n)]).to(dtype)
        out[p + "mlp.experts.down_proj"] = torch.stack([experts[e]["w2"] for e in range(n)]).to(dtype)
    return out


def build_hf_model(cfg: ModelConfig, weights: InMemoryWeights, dtype=torch.float32):
    """A `DeepseekV4ForCausalLM` (eval mode, eager attention) holding exactly our weights."""
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)                      # construction initialises; all of it is overwritten
    model = DeepseekV4ForCausalLM(hf_config(cfg)).to(dtype).eval()
    sd = hf_state_dict(cfg, weights, dtype)
    target = model.state_dict()
    missing = sorted(set(target) - set(sd))
    unexpected = sorted(set(sd) - set(target))
    if missing or unexpected:
        raise KeyError(f"state-dict mismatch: unfilled {missing[:8]} ({len(missing)}), "
                       f"unexpected {unexpected[:8]} ({len(unexpected)})")
    bad = [k for k in sd if sd[k].shape != target[k].shape]
    if bad:
        raise ValueError("shape mismatch: " + ", ".join(
            f"{k} ours {tuple(sd[k].shape)} vs hf {tuple(target[k].shape)}" for k in bad[:8]))
    model.load_state_dict(sd, strict=True, assign=False)
    # Non-persistent buffers are not in the state dict: the only ones are RoPE tables,
    # recomputed from the config; check they carry no YaRN amplitude.
    for name, buf in model.named_buffers():
        if name not in target and not name.endswith("inv_freq"):
            raise KeyError(f"non-persistent buffer {name} not covered by the weight map")
    for mod in model.modules():
        if type(mod).__name__ == "DeepseekV4RotaryEmbedding":
            for lt in mod.layer_types:
                if getattr(mod, f"{lt}_attention_scaling") != 1.0:
                    raise ValueError(f"RoPE '{lt}' has amplitude {getattr(mod, f'{lt}_attention_scaling')}")
    return model


@contextlib.contextmanager
def lowest_index_topk_ties():
    """Make `Tensor.topk` pick the LOWEST index among equal values (a stable descending
    sort), for the duration of the block. In the transformers V4 file only the lightning
    indexer calls the method form (`index_scores.topk`); the MoE router calls the
    function `torch.topk`, which this does not touch. Needed because indexer scores
    `sum_h w_h * relu(q_h . k)` are EXACTLY 0 whenever every head's dot product is
    negative, so ties at the k-th place are common, and CPU `torch.topk` breaks them in
    an unspecified order while our reference documents lowest-index-first."""
    orig = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
        v, i = v.narrow(dim, 0, k), i.narrow(dim, 0, k)
        return torch.return_types.topk((v, i))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = orig


@torch.no_grad()
def hf_logits(model, tokens: torch.Tensor, stable_topk: bool = True) -> torch.Tensor:
    """Logits [S, vocab] of every position of one prompt (prefill, no cache).
    stable_topk: bridge the indexer's top-k tie-breaking (see `lowest_index_topk_ties`)."""
    ctx = lowest_index_topk_ties() if stable_topk else contextlib.nullcontext()
    with ctx:
        out = model(input_ids=tokens.view(1, -1).long(), use_cache=False)
    return out.logits[0]
