"""transformers' DeepSeek-V4.1 port (huggingface/transformers PR #48721, closed, not
merged) loaded from its readable source and filled with our weights, for the outside
parity check of bench/v41_hf_parity.py.

The port is NOT part of this project and is not copied into it: `--hf-source DIR` names a
directory the user fills with the PR's two files,

    configuration_deepseek_v41.py
    modular_deepseek_v41.py          (src/transformers/models/deepseek_v41/ @ 0a2080b4)

`load_port` makes them importable against the installed transformers with one shim: it
registers DIR as the package `transformers.models.deepseek_v41` (an empty package module
whose `__path__` is DIR), so the modular file's relative imports (`from ...cache_utils`,
`from ..deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding`,
`from .configuration_deepseek_v41 import ...`) resolve to the installed transformers. The
files themselves are not edited. A modular file is ordinary Python that imports from its
sibling models, so with transformers >= the version whose `deepseek_v4` it imports
(5.24.0 here) nothing else is needed.

`build_hf_model` builds our V41Config in HF's `DeepseekV41TextConfig` and loads our weights
into `DeepseekV41ForCausalLM` by a name map written here (bf16, with the fp32 tensors HF
keeps fp32: mHC, sinks, gate biases); `hf_run` runs a prefill and decode steps with the
port's DynamicCache. HF-side bridges (on the port, never on the golden): `Tensor.topk`
picks the lowest index among equal values while HF runs (the indexer and candidate-block
top-k use the method form; scores `sum_h w_h relu(q_h.k)` are exactly 0 for whole rows of
pairs, so ties are common and CPU topk's order is unspecified; our golden documents
lowest-index-first). Engram's hash state is bound to our shipped tiny tokenizer (HF's
`bind_tokenizer`). `engram.embed.scale` (HF's table scale, unused when the table is a
float tensor) is set to ones. `fp32_rope_tables` optionally gives the port fp32 RoPE
tables."""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from reference_model.v41.config import V41Config  # noqa: E402
from reference_model.v41.weights import EngramTable  # noqa: E402

PKG = "transformers.models.deepseek_v41"
FILES = ("configuration_deepseek_v41.py", "modular_deepseek_v41.py")
# fp32 tensors of the port (its `_keep_in_fp32_modules_strict`; also fp32 in our checkpoint)
_FP32 = ("hc_attn_fn", "hc_attn_base", "hc_attn_scale", "hc_ffn_fn", "hc_ffn_base",
         "hc_ffn_scale", "attn_sink", "gate.bias", "gate.bias_vl")


# ---- loading the port from its source -----------------------------------------------------
def source_problem(src) -> str | None:
    """Why `src` cannot be used (None if it holds both files)."""
    if not src:
        return "no directory given"
    d = Path(src)
    missing = [f for f in FILES if not (d / f).is_file()]
    return f"{d} lacks {', '.join(missing)}" if missing else None


def load_port(src):
    """(configuration module, modular module) of the port in `src`, importable as
    `transformers.models.deepseek_v41` (shim: a package module whose __path__ is src)."""
    why = source_problem(src)
    if why:
        raise FileNotFoundError(why)
    import transformers
    import transformers.models  # noqa: F401
    from transformers.utils import logging as hf_logging

    d = str(Path(src).resolve())
    pkg = sys.modules.get(PKG)
    if pkg is None or list(getattr(pkg, "__path__", [])) != [d]:
        for k in [k for k in sys.modules if k == PKG or k.startswith(PKG + ".")]:
            del sys.modules[k]
        spec = importlib.util.spec_from_loader(PKG, loader=None, is_package=True)
        pkg = importlib.util.module_from_spec(spec)
        pkg.__path__ = [d]
        sys.modules[PKG] = pkg
    # auto_docstring logs an [ERROR] line per undocumented argument at import: noise here
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.CRITICAL)
    try:
        cfg_mod = importlib.import_module(PKG + ".configuration_deepseek_v41")
        mod = importlib.import_module(PKG + ".modular_deepseek_v41")
    finally:
        hf_logging.set_verbosity(level)
    return cfg_mod, mod, transformers.__version__


def hf_text_config(cfg_mod, cfg: V41Config):
    """Our V41Config in the port's `DeepseekV41TextConfig` (eager attention)."""
    rope_scaling = None
    if cfg.original_seq_len:
        rope_scaling = {"rope_type": "yarn", "factor": float(cfg.rope_factor),
                        "beta_fast": float(cfg.beta_fast), "beta_slow": float(cfg.beta_slow),
                        "original_max_position_embeddings": cfg.original_seq_len}
    c = cfg_mod.DeepseekV41TextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.dim, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=1, head_dim=cfg.head_dim,
        q_lora_rank=cfg.q_lora_rank, qk_rope_head_dim=cfg.rope_head_dim,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        rope_scaling=rope_scaling, max_position_embeddings=cfg.max_seq_len,
        sliding_window=cfg.window_size, compress_ratios=list(cfg.compress_ratios),
        kv_source_layer_ids=list(cfg.kv_source_layers),
        index_source_layer_ids=list(cfg.index_source_layers),
        candidate_source_layer_id=cfg.candidate_source_layer,
        candidate_topk_blocks=cfg.candidate_topk_blocks,
        candidate_block_size=cfg.candidate_block_size, index_n_heads=cfg.index_n_heads,
        index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, moe_intermediate_size=cfg.moe_inter_dim,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=cfg.n_shared_experts,
        num_experts_per_tok=cfg.n_activated_experts, scoring_func=cfg.score_func,
        gate_temp=cfg.gate_temp, norm_topk_prob=True, routed_scaling_factor=cfg.route_scale,
        swiglu_limit=cfg.swiglu_limit, hc_mult=cfg.hc_mult,
        hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        engram_layer_ids=list(cfg.engram_layer_ids),
        engram_vocab_size=cfg.engram_vocab_size,
        engram_num_embeddings=list(cfg.engram_num_embeddings),
        engram_max_ngram_size=cfg.engram_max_ngram_size, engram_n_heads=cfg.engram_n_heads,
        engram_head_dim=cfg.engram_head_dim, engram_pad_id=cfg.engram_pad_id,
        engram_compressed_vocab_size=cfg.engram_compressed_vocab_size,
        num_nextn_predict_layers=0, rms_norm_eps=cfg.norm_eps,
        bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id,
        tie_word_embeddings=False)
    c._attn_implementation = "eager"
    return c


# ---- the name map (written here; our names are DeepSeek-native, see v41/specs.py) ----------
_GLOBAL = {"embed.weight": "model.embed.weight", "norm.weight": "model.norm.weight",
           "head.weight": "lm_head.weight"}


def hf_name(name: str, layer: int | None) -> str:
    """Our tensor name -> the port's parameter name. The port keeps DeepSeek's names inside
    a layer (attn.wq_a, attn.compressor.wkv, attn.indexer.wk, ffn.experts.{e}.w1,
    engram.embed, hc_attn_fn, ...), so a layer tensor maps to `model.layers.{i}.<name>`."""
    if layer is None:
        return _GLOBAL[name]
    return f"model.layers.{layer}.{name}"


def hf_state_dict(cfg: V41Config, w) -> dict:
    out = {}
    for k, v in w.global_weights().items():
        out[hf_name(k, None)] = v
    for i in range(cfg.n_layers):
        for k, v in w.layer_weights(i).items():
            if isinstance(v, EngramTable):          # the table as the float values it holds
                out[hf_name(k, i)] = v.dequant()
                out[hf_name(k, i)[: -len("weight")] + "scale"] = torch.ones(
                    v.shape[0], v.shape[1] // 32)   # port's scale: unused for a float table
            else:
                out[hf_name(k, i)] = v
    return out


def build_hf_model(mod, cfg_mod, cfg: V41Config, w, dtype=torch.bfloat16):
    """The port's DeepseekV41ForCausalLM holding exactly our weights (bf16; the fp32
    tensors fp32). Raises on any unfilled parameter / persistent buffer or unused tensor."""
    from transformers import PreTrainedTokenizerFast
    from reference_model.tokenizer import DEFAULT_PATH

    from transformers.utils import logging as hf_logging

    torch.manual_seed(0)                       # construction initialises; all overwritten
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity(hf_logging.CRITICAL)   # docstring / rope-factor notices
    try:
        model = mod.DeepseekV41ForCausalLM(hf_text_config(cfg_mod, cfg)).eval()
    finally:
        hf_logging.set_verbosity(level)
    for name, p in model.named_parameters():
        p.data = p.data.to(torch.float32 if name.endswith(_FP32) else dtype)
    sd = hf_state_dict(cfg, w)
    target = model.state_dict()
    missing, unexpected = sorted(set(target) - set(sd)), sorted(set(sd) - set(target))
    if missing or unexpected:
        raise KeyError(f"state-dict mismatch: unfilled {missing[:8]} ({len(missing)}), "
                       f"unexpected {unexpected[:8]} ({len(unexpected)})")
    bad = [k for k in sd if tuple(sd[k].shape) != tuple(target[k].shape)]
    if bad:
        raise ValueError("shape mismatch: " + ", ".join(
            f"{k} ours {tuple(sd[k].shape)} vs hf {tuple(target[k].shape)}" for k in bad[:8]))
    model.load_state_dict(sd, strict=True)     # copies into each parameter's dtype
    for mname, m in model.named_modules():     # RoPE amplitude must be 1 (no YaRN mscale)
        for lt in getattr(m, "layer_types", []) if "Rotary" in type(m).__name__ else []:
            s = getattr(m, f"{lt}_attention_scaling", 1.0)
            if s != 1.0:
                raise ValueError(f"{mname}: RoPE '{lt}' has amplitude {s}")
    if cfg.engram_layer_ids:
        model.model.bind_tokenizer(PreTrainedTokenizerFast(tokenizer_file=str(DEFAULT_PATH)))
    return model


def fp32_rope_tables(model):
    """Bridge (port side, optional): the port's rotary modules (V4's
    `DeepseekV4RotaryEmbedding`, reused) return cos/sin in the dtype of their input, bf16
    here, so every RoPE rotation of the port uses bf16-rounded tables; DeepSeek's reference
    and our golden use fp32 tables (complex64 `freqs_cis`). Wrapping each rotary module to
    see an fp32 input gives fp32 tables; the rotation itself already runs in fp32. No toggle
    of ours reads the bf16 tables (doc §9 has no such entry)."""
    for m in model.modules():
        if "RotaryEmbedding" in type(m).__name__ and not getattr(m, "_fp32_tables", False):
            orig = m.forward

            def forward(x, position_ids, layer_type=None, _orig=orig):
                return _orig(x.float(), position_ids, layer_type=layer_type)

            m.forward = forward
            m._fp32_tables = True
    return model


@contextlib.contextmanager
def lowest_index_topk_ties():
    """`Tensor.topk` as a stable descending sort (lowest index first among equals) while
    the port runs; `torch.topk` (function form) is untouched."""
    orig = torch.Tensor.topk

    def topk(self, k, dim=-1, largest=True, sorted=True):
        v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))

    torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.Tensor.topk = orig


def port_cache(model):
    """The DynamicCache the port's forward would build with `DynamicCache(config=...)`.
    Shim: the installed transformers' `get_layer_types_and_kwargs` passes `config` to the
    cache layers of V4's layer types only, not to the port's 'shared_compressed_attention'
    (`DeepseekV41CSACache(config)`), so that call raises a TypeError; we build the same
    layers from the config's `layer_types` ourselves (sliding layers as the dispatch does)."""
    from transformers.cache_utils import (DYNAMIC_LAYER_TYPE_MAPPING, Cache, DynamicCache,
                                          DynamicSlidingWindowLayer)
    c = model.config
    layers = [DYNAMIC_LAYER_TYPE_MAPPING[t](config=c) if t == "shared_compressed_attention"
              else DynamicSlidingWindowLayer(sliding_window=c.sliding_window)
              for t in c.layer_types]
    cache = DynamicCache.__new__(DynamicCache)
    Cache.__init__(cache, layers=layers)
    return cache


@torch.no_grad()
def hf_run(model, toks: torch.Tensor, n_prefill: int):
    """(prefill logits [n_prefill, V], decode logits [steps, V]) of the port, fp32."""
    with lowest_index_topk_ties():
        out = model(input_ids=toks[:n_prefill].view(1, -1), past_key_values=port_cache(model),
                    use_cache=True)
        pre, cache, dec = out.logits[0].float(), out.past_key_values, []
        for j in range(n_prefill, toks.numel()):
            out = model(input_ids=toks[j:j + 1].view(1, 1), past_key_values=cache,
                        use_cache=True)
            cache = out.past_key_values
            dec.append(out.logits[0, -1].float())
    return pre, (torch.stack(dec) if dec else pre[:0])
