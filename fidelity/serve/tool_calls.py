"""Tool calls read out of generated text, in the DSML dialect the model writes: V4's
`<｜DSML｜tool_calls>` block of `<｜DSML｜invoke name="…">` / `<｜DSML｜parameter name="…"
string="true|false">…</｜DSML｜parameter>` elements, or V4.1's, the same with a space after
`｜DSML｜` and the block named `calls` (docs/v41-architecture.md §7). Each dialect's parser
reads only its own tags, as engines' parsers do, so a V4 parser finds no call in V4.1 output
(the `v4_dsml_parser` toggle). Arguments are rebuilt as DeepSeek's encoder writes them:
string values JSON-quoted, other values as written."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

DSML = "｜DSML｜"


@dataclass(frozen=True)
class Dialect:
    name: str
    space: str                  # between ｜DSML｜ and the tag name
    block: str                  # the calls block's tag name

    def tag(self, name: str) -> str:
        return f"<{DSML}{self.space}{name}"

    def end(self, name: str) -> str:
        return f"</{DSML}{self.space}{name}>"

    @property
    def opening(self) -> str:
        return self.tag(self.block) + ">"


DIALECTS = {"v4": Dialect("v4", "", "tool_calls"), "v41": Dialect("v41", " ", "calls")}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str              # a JSON object, as DeepSeek's encoder spells it

    def openai(self, index: int | None = None) -> dict:
        d = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
             "function": {"name": self.name, "arguments": self.arguments}}
        return d if index is None else {"index": index, **d}


def dialect(name: str) -> Dialect:
    try:
        return DIALECTS[name]
    except KeyError:
        raise ValueError(f"DSML dialect must be one of {', '.join(DIALECTS)}, got {name!r}") from None


def _patterns(d: Dialect):
    q = re.escape
    invoke = re.compile(q(d.tag("invoke")) + r' name="([^"]*)">(.*?)' + q(d.end("invoke")), re.S)
    param = re.compile(q(d.tag("parameter")) + r' name="([^"]*)" string="(true|false)">(.*?)'
                       + q(d.end("parameter")), re.S)
    return invoke, param


def parse(text: str, dialect_name: str) -> tuple[str, list[ToolCall]]:
    """(content, calls): the text before the dialect's calls block (trailing newlines
    dropped) and every complete invoke in the block (to its end tag, or to the end of a
    truncated answer). Without the dialect's block: (text, [])."""
    d = dialect(dialect_name)
    at = text.find(d.opening)
    if at < 0:
        return text, []
    body = text[at + len(d.opening):]
    close = body.find(d.end(d.block))
    body = body if close < 0 else body[:close]
    invoke, param = _patterns(d)
    calls = []
    for name, inner in invoke.findall(body):
        args = [f"{json.dumps(k, ensure_ascii=False)}: "
                f"{json.dumps(v, ensure_ascii=False) if s == 'true' else v}"
                for k, s, v in param.findall(inner)]
        calls.append(ToolCall(name, "{" + ", ".join(args) + "}"))
    if not calls:
        return text, []
    return text[:at].rstrip("\n"), calls


def dialect_in(text: str | None) -> str | None:
    """Which dialect's calls block a text holds (None: neither): what chat-check reads in
    a response whose tool calls were left in its content."""
    for name, d in DIALECTS.items():
        if text and d.opening in text:
            return name
    return None


class CallStream:
    """Streamed content with tool calls held back: text is released until the dialect's
    calls block starts (a possible start of it, and trailing newlines, wait for the next
    piece); from the block on everything is kept and parsed at the end."""

    def __init__(self, dialect_name: str):
        self.d = dialect(dialect_name)
        self.text, self.sent, self.inside = "", 0, False

    def push(self, piece: str) -> str:
        self.text += piece
        if self.inside:
            return ""
        at = self.text.find(self.d.opening)
        if at >= 0:
            self.inside, safe = True, at
        else:
            safe = len(self.text)
            op = self.d.opening
            for k in range(min(len(op) - 1, safe), 0, -1):
                if self.text.endswith(op[:k]):
                    safe -= k
                    break
        safe = len(self.text[:safe].rstrip("\n"))
        return self._release(safe)

    def finish(self) -> tuple[str, list[ToolCall]]:
        """(the content still held back, the calls)."""
        content, calls = parse(self.text, self.d.name)
        return self._release(len(content)) if calls else self._release(len(self.text)), calls

    def _release(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:upto], upto
        return out
