"""DeepSeek-V4 and V4.1 chat encoding, by DeepSeek's own library `deepseek-recipe` (PyPI,
MIT; the renderer SGLang 0.5.23 uses), not a re-implementation. A request's conversation,
tools, thinking intent and reasoning effort go through the library's Chat-Completions
converter and its V4 or V4.1 encoding (docs/research/engine-integration.md §3.1, §3.3;
docs/v41-architecture.md §7).

`generation` picks the encoding. V4 has two checkpoint generations (docs/research/dsv4-architecture.md §3.2):
`0731` (the library's tiers: low = no preamble, high / xhigh = "Absolute maximum", max =
"Beyond maximum"; effort absent with thinking on = high) and `original` (the first V4
checkpoints' encoder: only max emits a preamble, the "Absolute maximum" one; absent or
high emit nothing; other tiers are not defined there). `v41` is DeepSeek-V4.1's encoding
(the library's `DeepseekV41Encoding`): spaced DSML tags, a `<｜System｜>` token, and a
numeric "Reasoning Effort: N (range 1-100, ...)" line (low / high / max = 50 / 75 / 100).
Thinking not given = on (the library's default, as DeepSeek's API)."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

GENERATIONS = ("0731", "original", "v41")
VERSIONS = ("v4", "v41")                # chat versions: the model whose encoding renders
MODEL = "DeepSeek-V4-Pro"               # the library's V4 encoding, as SGLang selects it
MODEL_V41 = "DeepSeek-V4.1-Flash"       # the library's V4.1 encoding
V41_EFFORT = re.compile(r"Reasoning Effort: (\d+) \(range 1-100, ")
ABSOLUTE_MAXIMUM = "Reasoning Effort: Absolute maximum with no shortcuts permitted."
BEYOND_MAXIMUM = "Reasoning Effort: Beyond maximum"
GEN_THINK = "<｜Assistant｜><think>"
GEN_CHAT = "<｜Assistant｜></think>"
# original-generation request effort -> the library tier that renders the same text
_ORIGINAL = {None: "low", "high": "low", "max": "high", "none": "none"}


class ChatEncodingError(ValueError):
    """A conversation or option the reference encoder refuses (its message says why)."""


@dataclass(frozen=True)
class ChatRequest:
    messages: list
    tools: list | None = None
    thinking: bool | None = None            # None: not specified (DeepSeek's default: on)
    effort: str | None = None               # reasoning_effort as sent


@dataclass
class Rendered:
    text: str
    thinking: bool                          # the generation header opens a <think> block
    preamble: str                           # "", "absolute-maximum" or "beyond-maximum"
    effort: str | None = None               # the library's resolved tier
    notes: list[str] = field(default_factory=list)
    dsml: str = "v4"                        # DSML dialect the answer's tool calls are read in


def encoding_for(chat_version: str, generation: str = "0731") -> str:
    """The `generation` render() takes for a chat version and a V4 checkpoint generation:
    V4's generation as given, or 'v41' (V4.1 has one encoding)."""
    if chat_version not in VERSIONS:
        raise ChatEncodingError(f"chat version must be one of {', '.join(VERSIONS)}, got {chat_version!r}")
    if chat_version == "v4":
        return generation
    if generation == "original":
        raise ChatEncodingError("generation 'original' is a DeepSeek-V4 checkpoint generation; "
                                "DeepSeek-V4.1 has one encoding (drop --generation)")
    return "v41"


def preamble_of(text: str) -> str:
    """Which reasoning-effort preamble a rendered prompt carries ('effort-N': V4.1's
    numeric line)."""
    if ABSOLUTE_MAXIMUM in text:
        return "absolute-maximum"
    if BEYOND_MAXIMUM in text:
        return "beyond-maximum"
    m = V41_EFFORT.search(text)
    return f"effort-{m.group(1)}" if m else ""


def thinking_of(text: str) -> bool | None:
    """Whether the prompt ends in the thinking generation header (None: no header)."""
    if text.endswith(GEN_THINK):
        return True
    if text.endswith(GEN_CHAT):
        return False
    return None


def request_state(body: dict) -> tuple[bool | None, str | None]:
    """(thinking, effort) a Chat-Completions body asks for: `thinking: {type}`, else
    chat_template_kwargs.thinking / enable_thinking; reasoning_effort, else the kwargs'."""
    kw = body.get("chat_template_kwargs") or {}
    if not isinstance(kw, dict):
        raise ChatEncodingError("chat_template_kwargs must be an object")
    th = body.get("thinking")
    if isinstance(th, dict) and th.get("type") in ("enabled", "disabled"):
        thinking = th["type"] == "enabled"
    else:
        thinking = kw.get("thinking", kw.get("enable_thinking"))
        thinking = None if thinking is None else bool(thinking)
    effort = body.get("reasoning_effort", kw.get("reasoning_effort"))
    _check_effort(effort)
    return thinking, effort


def _check_effort(effort) -> None:
    if effort is not None and not isinstance(effort, str):
        raise ChatEncodingError(
            f"reasoning_effort must be a string (a named tier), got {effort!r}: DeepSeek's V4.1 "
            "encoding.py also takes an integer 1-100, but deepseek-recipe, the reference "
            "renderer here, renders named tiers only (V4.1: low = 50, high = 75, max = 100)")


def render(req: ChatRequest, generation: str = "0731", add_generation_prompt: bool = True) -> Rendered:
    """The prompt DeepSeek's encoder renders for the request."""
    try:
        from deepseek_recipe import (ChatCompletionRequest, ConversionError, ConversionOptions,
                                     DeepseekV4Encoding, DeepseekV41Encoding)
    except ImportError as e:                               # pragma: no cover - a dependency
        raise ChatEncodingError(f"deepseek-recipe is not installed ({e}); pip install deepseek-recipe") from None
    if generation not in GENERATIONS:
        raise ChatEncodingError(f"generation must be one of {', '.join(GENERATIONS)}, got {generation!r}")
    _check_effort(req.effort)
    effort = req.effort
    if generation == "original":
        if effort not in _ORIGINAL:
            raise ChatEncodingError(f"reasoning_effort {effort!r} is not defined for the original V4 "
                                    "checkpoints' encoder (absent, none, high or max)")
        effort = "low" if effort == "none" and req.thinking else _ORIGINAL[effort]
    v41 = generation == "v41"
    body = {"model": MODEL_V41 if v41 else MODEL, "messages": req.messages}
    if req.tools:
        body["tools"] = req.tools
    if req.thinking is not None:
        body["thinking"] = {"type": "enabled" if req.thinking else "disabled"}
    if effort is not None:
        body["reasoning_effort"] = effort
    try:
        conv = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
        text = (DeepseekV41Encoding() if v41 else DeepseekV4Encoding()).render_conversation(conv).prompt
    except (ConversionError, ValueError, TypeError, KeyError) as e:
        raise ChatEncodingError(f"the reference encoder refused the conversation: {e}") from None
    thinking = bool(conv.thinking_mode)
    if not add_generation_prompt:
        for head in (GEN_THINK, GEN_CHAT):
            if text.endswith(head):
                text = text[: -len(head)]
                break
    tier = conv.reasoning_effort
    if generation == "original":                           # report the original encoder's tiers
        tier = ("max" if preamble_of(text) else "high") if thinking else None
    return Rendered(text, thinking, preamble_of(text), tier, dsml="v41" if v41 else "v4")
