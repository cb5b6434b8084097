"""Incremental detokenization for streaming: text is released only when it can no longer
change, so a byte-level token that ends inside a UTF-8 character, or text that may be the
start of a stop string, is held back until the next token decides it."""
from __future__ import annotations


def cut_stop(text: str, stop) -> str:
    """Text up to the first stop string (the stop string itself is not returned)."""
    cut = min((text.find(s) for s in stop if s in text), default=-1)
    return text if cut < 0 else text[:cut]


class TextStream:
    def __init__(self, decode, stop: list[str] = ()):
        self.decode, self.stop = decode, list(stop)
        self.ids: list[int] = []
        self.sent = 0                   # characters already released
        self.stopped = False

    def _text(self) -> str:
        text = self.decode(self.ids)
        out = cut_stop(text, self.stop)
        self.stopped = len(out) < len(text) or any(s in text for s in self.stop)
        return out

    def push(self, token: int) -> str:
        """Add a token; the text that became final."""
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self._text()
        if self.stopped:
            return self._release(len(text), text)
        safe = len(text)
        if text.endswith("\ufffd"):                     # incomplete UTF-8 sequence
            safe = len(text.rstrip("\ufffd"))
        for s in self.stop:                             # a possible stop-string prefix
            for k in range(min(len(s) - 1, safe), 0, -1):
                if text[:safe].endswith(s[:k]):
                    safe -= k
                    break
        return self._release(safe, text)

    def finish(self) -> str:
        """Whatever is still held back, at the end of generation."""
        text = self._text() if self.ids else ""
        return self._release(len(text), text)

    def _release(self, upto: int, text: str) -> str:
        if upto <= self.sent:
            return ""
        out, self.sent = text[self.sent:upto], upto
        return out
