"""llama-server's launch flags, read as what they are to the toolkit: the ones that change
its numerics map to toggles of its in-process twin (the `exact` profile -- llama.cpp does
not simulate the reference's QAT -- with LLAMA_CPU, docs/real-engines.md), the others are
serving conditions or resources. Both directions: an engines arm's toggles become flags
(what cannot be set is refused, naming it), and an arm's own flags become the toggles
attribution credits.

Modelled (CPU backend, b11434): the routed experts' Q8_0 activations, the router's float32
softplus and the bf16 input of the GEMMs whose GGUF weights are BF16 (always on: no flag
turns them off), the cache type `-ctk` (f16 default, q8_0; llama.cpp's V4 caches use the
K type for every row, so `-ctv` follows it) and the attention rotation of a quantised cache
(LLAMA_ATTN_ROT_DISABLE=1 turns it off)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kernel_toggles import ToggleSet

PROFILE = "exact"                                   # llama.cpp computes without QAT simulation
# fixed on: its CPU MoE GEMMs, its router's float32 softplus, and its BF16-weight GEMMs
# (router, compressors, weights_proj, head)
LLAMA_CPU = ("expert_act_q8_0", "router_softplus_logf", "bf16_gemm_input")
CACHE_TYPES = ("f16", "q8_0")                       # kv_cache_ggml's types
ROT_ENV = "LLAMA_ATTN_ROT_DISABLE"
_CACHE_K, _CACHE_V = ("-ctk", "--cache-type-k"), ("-ctv", "--cache-type-v")
# flags that set serving conditions or resources, not numerics (what each one is)
SERVING = {
    "-c": "context size", "--ctx-size": "context size",
    "-np": "parallel slots (batch-mates)", "--parallel": "parallel slots (batch-mates)",
    "-b": "logical batch (chunked prefill)", "--batch-size": "logical batch (chunked prefill)",
    "-ub": "physical batch (chunked prefill)", "--ubatch-size": "physical batch (chunked prefill)",
    "--swa-full": "full-size window cache (prefix reuse)", "--cache-reuse": "KV shifting for prefix reuse",
    "--ctx-checkpoints": "context checkpoints (state restore)", "-fa": "flash attention",
    "--flash-attn": "flash attention", "--no-repack": "weights not repacked (quantised GGUFs)",
    "-t": "threads", "--threads": "threads",
}


class FlagError(ValueError):
    """An arm llama-server cannot be set to, or flags that contradict each other."""


@dataclass(frozen=True)
class LlamaNumerics:
    """What llama-server's flags and env make of its numerics."""
    cache_type: str = "f16"
    rotate: bool = True
    notes: tuple[str, ...] = field(default_factory=tuple)

    def toggles(self) -> ToggleSet:
        """The in-process twin's toggles (on PROFILE)."""
        cache = "kv_cache_ggml" + ("" if self.cache_type == "f16" else
                                   f"(type={self.cache_type}{'' if self.rotate else ',rotate=false'})")
        return ToggleSet.parse(",".join((*LLAMA_CPU, cache)))

    def factors(self) -> frozenset:
        """The toggles that differ from llama-server's defaults (what attribution credits)."""
        return frozenset() if self.cache_type == "f16" else frozenset({"kv_cache_ggml"})


def _value(flags: list[str], names) -> str | None:
    """The last value given to any of `names` (`-ctk q8_0` or `--cache-type-k=q8_0`)."""
    found = None
    for i, f in enumerate(flags):
        head, eq, tail = f.partition("=")
        if head in names:
            if eq:
                found = tail
            elif i + 1 < len(flags):
                found = flags[i + 1]
            else:
                raise FlagError(f"llama-server flag {f} has no value")
    return found


def read(flags: list[str], env: dict[str, str] | None = None) -> LlamaNumerics:
    """The numerics llama-server runs with under these flags and env; a cache type no
    toggle models is a FlagError naming it, as are differing K and V types."""
    flags, env = list(flags), dict(env or {})
    k, v = _value(flags, _CACHE_K), _value(flags, _CACHE_V)
    cache = k or "f16"
    if cache not in CACHE_TYPES:
        raise FlagError(f"-ctk {cache}: kv_cache_ggml models f16 and q8_0 only (llama.cpp's DeepSeek-V4 "
                        "caches store every row in the K type)")
    if v is not None and v != cache:
        raise FlagError(f"-ctk {cache} with -ctv {v}: llama.cpp's DeepSeek-V4 caches use the K type for "
                        "every row (K = V); give the same type to both")
    rotate = env.get(ROT_ENV, "0").strip() in ("", "0")
    seen = [f.partition("=")[0] for f in flags if f.startswith("-")]
    notes = tuple(f"{f}: {SERVING[f]} (launch setting, no numerics toggle)" for f in dict.fromkeys(seen)
                  if f in SERVING)
    return LlamaNumerics(cache, rotate, notes)


def twin(flags: list[str], env: dict[str, str] | None = None) -> str:
    """The spelling of llama-server's in-process twin under these flags and env."""
    return f"{PROFILE}:{read(flags, env).toggles()}"


# llama-server's scores are read teacher-forced, every position after the first computed by
# its decode path (one new token on a cached prefix: fidelity.servers.llamacpp), where an
# f16 cache takes ggml's one-query attention; its twin is scored the same way
SCORED_ON = "decode_from(1)"


def scored_twin(flags: list[str], env: dict[str, str] | None = None) -> str:
    """twin(flags, env) read as llama-server's scores are: position by position (SCORED_ON)."""
    return f"{twin(flags, env)}@{SCORED_ON}"


def only_numerics(flags: list[str], env: dict[str, str] | None = None) -> bool:
    """Whether these flags and env set nothing but the cache type and its rotation."""
    rest, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        head, eq, _ = f.partition("=")
        if head in (*_CACHE_K, *_CACHE_V):
            skip = not eq
            continue
        rest.append(f)
    return not rest and set(env or {}) <= {ROT_ENV}


def launch_of(toggles: ToggleSet) -> tuple[list[str], dict[str, str]]:
    """Flags and env that make llama-server compute `toggles` (its twin's spelling); a
    toggle it has no setting for, or a twin without LLAMA_CPU, is a FlagError naming it."""
    other = [n for n in toggles.names if n not in (*LLAMA_CPU, "kv_cache_ggml")]
    fixed = ", ".join(LLAMA_CPU)
    if other:
        raise FlagError(f"llama.cpp has no setting for {', '.join(other)} (it computes the exact profile "
                        f"with {fixed} and kv_cache_ggml; other numerics need their own GGUF or flags)")
    missing = [n for n in LLAMA_CPU if n not in toggles]
    if missing:
        raise FlagError(f"llama.cpp's CPU backend always computes {', '.join(missing)} (its routed experts "
                        f"read Q8_0 activations, its router a float32 softplus, its BF16-weight GEMMs bf16 "
                        "activations); no setting turns it off")
    if "kv_cache_ggml" not in toggles:
        return [], {}
    kw = toggles["kv_cache_ggml"].kwargs()
    flags = [] if kw["type"] == "f16" else ["-ctk", kw["type"], "-ctv", kw["type"]]
    return flags, ({} if kw["rotate"] or kw["type"] == "f16" else {ROT_ENV: "1"})
