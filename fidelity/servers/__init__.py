"""One module per engine, behind one registry: what fidelity knows about SGLang, vLLM,
llama.cpp, mlx-vlm, plain OpenAI-compatible servers and `fidelity serve` -- detection, scoring and
generation requests and their parsers, tokenize route, launch recipe and toggle-to-setting
mapping, twin. Commands ask the registry (`get(name)`, `detect(found)`) and call methods;
they do not branch on an engine's name.

A new engine: one module here with a `Server` subclass registered below, its settings in
kernel_toggles/engine_profiles.json when its toggles map through profiles, and a wire
fixture in tests/ (docs/architecture.md, "A new engine"; tests/test_servers.py keeps both
true)."""
from __future__ import annotations

from .base import Found, Generation, Reply, Server
from .fidelity_serve import FidelityServe
from .llamacpp import LlamaCpp
from .mlx_vlm import MlxVlm
from .openai import OpenAI
from .sglang import SGLang
from .vllm import VLLM

# detection order: the first whose `claims` holds (OpenAI last: it claims everything)
REGISTRY: dict[str, Server] = {s.name: s for s in (SGLang(), VLLM(), LlamaCpp(), MlxVlm(), FidelityServe(), OpenAI())}
DIALECTS = tuple(n for n, s in REGISTRY.items() if s.wire)


def get(name: str) -> Server:
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown engine {name!r} (one of {', '.join(REGISTRY)})") from None


def find(name: str | None) -> Server | None:
    """The engine module of `name`, or None for a kind no module stands for (an engines
    TOML's `external` or `inprocess`, an endpoint whose dialect is not known yet)."""
    return REGISTRY.get(name) if name else None


def detect(found: Found) -> str:
    """The dialect a server answered discovery in."""
    return next(n for n in DIALECTS if REGISTRY[n].claims(found))


def served_as(ep) -> Server:
    """The engine behind an endpoint: `fidelity serve` when its /get_server_info says so,
    llama.cpp when /props answered as llama-server, else the dialect it is read in."""
    if REGISTRY["fidelity"].twin_of_endpoint(ep) is not None:
        return REGISTRY["fidelity"]
    if getattr(ep, "llama_server", False):
        return REGISTRY["llamacpp"]
    return REGISTRY.get(ep.dialect) or REGISTRY["openai"]


def props_summary(props) -> dict | None:
    """What a report keeps of a /props answer, by the engine whose shape it has."""
    return next((got for s in REGISTRY.values() if (got := s.props_summary(props)) is not None), None)


def launchable() -> tuple[str, ...]:
    """The engine kinds an engines TOML can launch."""
    return tuple(n for n, s in REGISTRY.items() if type(s).command is not Server.command)


__all__ = ["Found", "Generation", "Reply", "Server", "REGISTRY", "DIALECTS", "get", "find", "detect", "served_as", "props_summary", "launchable"]
