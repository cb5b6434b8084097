"""The request matrix `fidelity chat-check` sends: every combination of system prompt,
tools (DSML), thinking (absent / on / off via chat_template_kwargs.thinking) and
reasoning_effort (absent, none, low, medium, high, max, xhigh); multi-turn conversations
with earlier reasoning, with and without tools (the drop-thinking rule and its
exception); a tool call and its result (docs/research/engine-integration.md §3.1, §3.3)."""
from __future__ import annotations

from dataclasses import dataclass, field

EFFORTS = (None, "none", "low", "medium", "high", "max", "xhigh")
THINKING = (None, True, False)
SYSTEM = {"role": "system", "content": "You are a careful assistant. Answer briefly."}
USER = {"role": "user", "content": "What is the weather like in Paris today?"}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                      "unit": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}]
TOOL_CALL = {"role": "assistant", "content": "", "reasoning_content": "I need the weather tool.",
             "tool_calls": [{"id": "call_1", "type": "function",
                             "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 14, "sky": "cloudy"}'}
EARLIER = [{"role": "user", "content": "Name a river in France."},
           {"role": "assistant", "content": "The Seine.", "reasoning_content": "Paris sits on the Seine."},
           {"role": "user", "content": "And one in Germany?"}]


@dataclass
class Case:
    id: str
    messages: list
    tools: list | None = None
    thinking: bool | None = None          # as sent in chat_template_kwargs.thinking (None: not sent)
    effort: str | None = None             # reasoning_effort as sent (None: not sent)
    kind: str = "matrix"                  # matrix | multi-turn | tool-round-trip
    tags: dict = field(default_factory=dict)

    def body(self) -> dict:
        """The Chat-Completions fields of this case."""
        b = {"messages": self.messages}
        if self.tools:
            b["tools"] = self.tools
        if self.thinking is not None:
            b["chat_template_kwargs"] = {"thinking": self.thinking}
        if self.effort is not None:
            b["reasoning_effort"] = self.effort
        return b


def _label(v, absent="absent"):
    return absent if v is None else ("on" if v is True else "off" if v is False else v)


def all_cases() -> list[Case]:
    out = []
    for system in (False, True):
        for tools in (False, True):
            for thinking in THINKING:
                for effort in EFFORTS:
                    cid = (f"{'sys' if system else 'nosys'}-{'tools' if tools else 'notools'}-"
                           f"think={_label(thinking)}-effort={_label(effort)}")
                    out.append(Case(cid, ([SYSTEM] if system else []) + [USER], TOOLS if tools else None,
                                    thinking, effort, "matrix", {"system": system, "tools": tools}))
    for tools in (False, True):
        for thinking in THINKING:
            out.append(Case(f"multi-turn-{'tools' if tools else 'notools'}-think={_label(thinking)}",
                            list(EARLIER), TOOLS if tools else None, thinking, None, "multi-turn",
                            {"system": False, "tools": tools}))
    for thinking in THINKING:
        out.append(Case(f"tool-round-trip-think={_label(thinking)}", [USER, TOOL_CALL, TOOL_RESULT], TOOLS,
                        thinking, None, "tool-round-trip", {"system": False, "tools": True}))
    return out
