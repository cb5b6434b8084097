"""How a config dict says it is DeepSeek-V4.1 (docs/v41-architecture.md §2): its model_type
or architectures, or fields only V4.1 has. Kept apart from v41.config, which builds on V4's
config module, so V4's loader can refuse V4.1 files without importing back into itself."""
from __future__ import annotations

V41_MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")
V41_ARCHITECTURES = ("DeepseekV41ForCausalLM", "DeepseekV41ForConditionalGeneration")

# Keys only V4.1 has (either dialect).
V41_ONLY_KEYS = ("kv_source_layer_ids", "kv_source_layers", "index_source_layer_ids",
                 "index_source_layers", "candidate_source_layer_id", "candidate_source_layer",
                 "engram_layer_ids")


def text_part(d: dict) -> dict:
    """The text model's keys: `text_config` in the root HF dialect, else the dict itself."""
    tc = d.get("text_config")
    return tc if isinstance(tc, dict) else d


def declared_v41(d: dict) -> bool:
    """The file says it is V4.1: model_type or architectures (root or text_config)."""
    t = text_part(d)
    archs = d.get("architectures") or []
    return (d.get("model_type") in V41_MODEL_TYPES or t.get("model_type") in V41_MODEL_TYPES
            or any(a in V41_ARCHITECTURES for a in archs if isinstance(a, str)))


def v41_markers(d: dict) -> list[str]:
    """Why a config dict looks like DeepSeek-V4.1 (empty: it does not)."""
    t = text_part(d)
    out = []
    if declared_v41(d):
        out.append(f"model_type {t.get('model_type') or d.get('model_type')!r}"
                   if (t.get("model_type") or d.get("model_type")) in V41_MODEL_TYPES
                   else f"architectures {d.get('architectures')!r}")
    out += [k for k in V41_ONLY_KEYS if k in t]
    ratios = t.get("compress_ratios")
    if isinstance(ratios, list) and 1 in ratios:
        out.append("compress_ratios contains 1")
    return out
