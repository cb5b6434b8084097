"""mlx-vlm's in-process twin: what its arithmetic is when no bug is in it -- DeepSeek's
model without the QAT simulation (the exact profile), selecting by HISA where its config
turns it on, scored by the same route (fidelity.servers.mlx_vlm reads it for `fidelity kld`
and `fidelity engines`; the history and `explain` judge each release against it)."""
from __future__ import annotations

# mlx-vlm skips DeepSeek's QAT simulation and selects by HISA past index_keep x index_block entries:
# its twin is the exact profile with the hisa toggle as its config sets it, read by the same route
PROFILE = "exact"
SCHEDULES = {"decode": "@decode_from(1)", "prefill": "", "nocache": ""}


def twin(route: str | None, props: dict | None = None) -> str:
    """The in-process twin of the harness on `route`: the exact profile with mlx-vlm's HISA when
    its config has it on (index_block > 0), scored the same way (position by position for
    decode, in the same chunks for chunked:N and generate)."""
    from .convert import hisa_toggle            # lazy: convert loads torch and safetensors
    toggles = hisa_toggle((props or {}).get("hisa") or {})
    route = route or "decode"
    if route.startswith("chunked:"):
        return f"{PROFILE}:{toggles}@chunked({route[8:]})"
    if route == "generate":
        return f"{PROFILE}:{toggles}@chunked(2048)"
    return f"{PROFILE}:{toggles}{SCHEDULES.get(route, '')}"
