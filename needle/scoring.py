"""Deterministic scoring with a failure taxonomy, so that a token-budget or server
problem is never counted as lost recall.

Outcomes, checked in this order:
  server_error  no usable response after retries (HTTP error, timeout, bad JSON, drop)
  correct       every expected value appears in `content` (case-insensitive, whole value)
  partial       some but not all values (multivalue, multiquery): recall is the found
                fraction, RULER's string-match score
  wrong         content names a distractor or another value of the expected type (the
                model committed to a wrong answer, even if it was then cut off)
  truncated     no value, and generation stopped at max_tokens (finish_reason "length"):
                a budget problem, e.g. reasoning that used the whole budget
  empty         no content
  refused       content declines or says the value is not there
  other         anything else
Recall counts correct as 1 and partial as the found fraction; only `correct`, `partial`,
`wrong`, `refused`, `other` and `empty` are recall trials -- `truncated` and `server_error`
are reported beside recall, never inside it."""
from __future__ import annotations

import re
from dataclasses import dataclass

OUTCOMES = ("correct", "partial", "wrong", "refused", "other", "empty", "truncated", "server_error")
SCORED = ("correct", "partial", "wrong", "refused", "other", "empty")   # count toward recall
_REFUSAL = re.compile(
    r"\b(i can(?:no|')t|i am unable|i'm unable|unable to|sorry|not (?:mentioned|provided|"
    r"found|present|given|specified)|no (?:special )?magic|does not (?:contain|mention)|"
    r"doesn't (?:contain|mention)|there is no|cannot (?:find|determine))\b", re.I)
_TYPE_RE = {
    "number": re.compile(r"(?<![0-9])[0-9]{4,}(?![0-9])"),       # any long number
    "uuid": re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", re.I),
    "word": re.compile(r"\b[a-z]+-[a-z]+\b", re.I),
}


@dataclass
class Score:
    outcome: str
    found: int
    expected: int

    @property
    def recall(self) -> float | None:
        if self.outcome not in SCORED:
            return None
        return self.found / self.expected if self.expected else 0.0


def contains_value(text: str, value: str) -> bool:
    """Case-insensitive whole-value match: the value is not glued to more letters or
    digits on either side (so 1234567 does not match inside 12345678)."""
    pat = r"(?<![0-9A-Za-z])" + re.escape(value) + r"(?![0-9A-Za-z])"
    return re.search(pat, text or "", re.I) is not None


def score(expected: list[str], content: str | None, finish_reason: str | None,
          error: str | None = None, distractors=(), value_type: str | None = None,
          key: str | list[str] | None = None) -> Score:
    """`key`: the haystack's keys (one or all, queried and distractor), which have a word
    value's shape: echoing one is not a value."""
    n = len(expected)
    if error is not None:
        return Score("server_error", 0, n)
    text = content or ""
    found = sum(contains_value(text, v) for v in expected)
    if found == n and n:
        return Score("correct", found, n)
    if found:
        return Score("partial", found, n)
    bare = text
    for k in sorted([key] if isinstance(key, str) else key or (), key=len, reverse=True):
        bare = re.sub(re.escape(k), " ", bare, flags=re.I)
    if any(contains_value(text, d) for d in distractors) or (
            value_type in _TYPE_RE and _TYPE_RE[value_type].search(bare)):
        return Score("wrong", 0, n)
    if finish_reason == "length":
        return Score("truncated", 0, n)
    if not text.strip():
        return Score("empty", 0, n)
    if _REFUSAL.search(text):
        return Score("refused", 0, n)
    return Score("other", 0, n)


# DeepSeek-V4's special tokens as a reply's text shows them when a server detokenizes them:
# BOS is token 0, what argmax over a NaN logits row returns (vllm#41834 traced BOS in long
# generations to four NaN paths); the others are a template or stop handling gone wrong.
# Both `content` and `reasoning_content` are read: the reporter's warning was that a scan of
# content alone misses most of them. Spelled here, not imported from reference_model.tokenizer
# (whose package loads torch, which the HTTP path never needs); a test holds them equal.
BOS_TEXT = "<｜begin▁of▁sentence｜>"
SPECIAL_TEXTS = (BOS_TEXT, "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>")
REPLY_FIELDS = ("response", "reasoning_content")        # the row's names for content and reasoning


def leaked_specials(res: dict) -> dict[str, list[str]]:
    """{field: special tokens in it, in order of appearance} over a reply's content and
    reasoning_content; empty when the reply has none."""
    out = {}
    for f in REPLY_FIELDS:
        text = res.get(f) or ""
        found = sorted(((m.start(), s) for s in SPECIAL_TEXTS for m in re.finditer(re.escape(s), text)))
        if found:
            out[f] = [s for _, s in found]
    return out
