"""Which chat encoding a deployment should be checked against when the user does not say:
DeepSeek-V4.1 if the server names a V4.1 model (its architecture where it reports one, as
`fidelity serve` does; else a model path / id such as `deepseek-ai/DeepSeek-V4.1-Flash`),
else V4. Checking a V4.1 deployment against
V4's encoding would report every case as differing, so the choice and its evidence are
printed and recorded in the report."""
from __future__ import annotations

import re

from reference_model.v41.markers import V41_ARCHITECTURES

_V41_NAME = re.compile(r"v4[._-]?1(?![0-9])", re.I)        # V4.1, v4_1, V41; not V4.10 / V410
PATH_KEYS = ("model_path", "root", "served_model_name", "model")


def served_chat_version(info: dict | None) -> tuple[str, str]:
    """('v41' | 'v4', why) from an Endpoint's `info` (/v1/models ids, /get_model_info,
    /get_server_info)."""
    info = info or {}
    mi, si = info.get("model_info") or {}, info.get("server_info") or {}
    arch = mi.get("architecture") if isinstance(mi, dict) else None
    if isinstance(arch, str) and arch.startswith("Deepseek"):     # what the server loaded decides
        return ("v41" if arch in V41_ARCHITECTURES else "v4"), f"architecture {arch}"
    names = [("model id", m) for m in info.get("models") or []]
    for src, d in (("model_info", mi), ("server_info", si)):
        if isinstance(d, dict):
            names += [(f"{src}.{k}", d[k]) for k in PATH_KEYS if isinstance(d.get(k), str)]
    for where, name in names:
        if isinstance(name, str) and _V41_NAME.search(name):
            return "v41", f"{where} {name!r}"
    return "v4", "no DeepSeek-V4.1 name served"
