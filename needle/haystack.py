"""Haystacks after RULER (docs/research/tooling-anchors.md §4b): needle kinds single / multikey (distractor
needles with other keys, random or near-duplicates of the queried key: needle/keys.py) /
multivalue (one key, several values) / multiquery (several keys, all asked for at once),
values as 7-digit numbers, words or UUIDs, filler from the shipped corpus (`essay`) or
RULER's repeated noise sentences (`noise`). The needle goes at the sentence boundary
nearest the requested depth (multiquery: the queried needles at the boundaries nearest
it, one per boundary), and the prompt -- as the model sees it, chat encoding included --
is sized to the exact token count in the target tokenizer by searching over filler words
(then characters of the next word) with whatever `Counter` the runner provides."""
from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field
from typing import Protocol

from reference_model.tokenizer import BOS, CORPUS_PATH, render_chat

from . import keys as K

KINDS = ("single", "multikey", "multivalue", "multiquery")
DISTRACTORS = ("random", "near")
VALUE_TYPES = ("number", "word", "uuid")
FILLERS = ("essay", "noise")
MODES = ("chat", "completion")
TYPE_NAMES = {"number": ("number", "numbers"), "word": ("word", "words"), "uuid": ("uuid", "uuids")}
NOISE = ("The grass is green. The sky is blue. The sun is yellow. Here we go. "
         "There and back again.")


class HaystackError(ValueError):
    """A spec or length that cannot be built."""


@dataclass(frozen=True)
class Template:
    """RULER's wording; `{type}`/`{types}` are the value type's names."""
    header: str = ("Some special magic {types} are hidden within the following text. "
                   "Make sure to memorize them. I will quiz you about the {types} afterwards.\n")
    needle: str = "One of the special magic {types} for {key} is: {value}."
    question: str = "\nWhat is the special magic {type} for {key} mentioned in the provided text?"
    question_multi: str = ("\nWhat are all the special magic {types} for {key} mentioned in "
                           "the provided text?")
    answer_prefix: str = " The special magic {type} for {key} mentioned in the provided text is"
    answer_prefix_multi: str = (" The special magic {types} for {key} mentioned in the provided "
                                "text are")


@dataclass(frozen=True)
class HaystackSpec:
    kind: str = "single"
    value_type: str = "number"
    filler: str = "essay"
    n_keys: int = 4                 # multikey: the queried key + n_keys-1 distractors; multiquery: needles
    n_values: int = 4               # multivalue: values for the one key
    template: Template = field(default_factory=Template)
    n_queries: int = 4              # multiquery: keys asked for (of n_keys)
    distractors: str = "random"     # multikey: "random" keys or "near" duplicates of the queried key

    def __post_init__(self):
        for name, val, ok in (("kind", self.kind, KINDS), ("value_type", self.value_type, VALUE_TYPES),
                              ("filler", self.filler, FILLERS), ("distractors", self.distractors, DISTRACTORS)):
            if val not in ok:
                raise HaystackError(f"{name} must be one of {', '.join(ok)}, got {val!r}")
        if self.n_keys < 2 or self.n_values < 2:
            raise HaystackError("n_keys and n_values must be >= 2")
        if self.distractors == "near" and self.kind != "multikey":
            raise HaystackError(f"near distractors are for kind multikey, not {self.kind}")
        if self.kind == "multiquery" and not 2 <= self.n_queries <= self.n_keys:
            raise HaystackError(f"multiquery needs 2 <= n_queries <= n_keys (n_keys={self.n_keys}), "
                                f"got n_queries={self.n_queries}")

    def to_dict(self) -> dict:
        """The settings that shape a trial. Options a kind does not use are left out, so
        the trial ids (and results files) of the earlier kinds are unchanged."""
        d = asdict(self)
        if self.kind != "multiquery":
            del d["n_queries"]
        if self.distractors == "random":
            del d["distractors"]
        return d


@dataclass(frozen=True)
class PromptFormat:
    """How the user text becomes what the model sees: DeepSeek-V4 chat encoding, or a raw
    completion prompt (BOS + text + RULER's answer prefix)."""
    mode: str = "chat"
    thinking: bool = False
    reasoning_effort: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise HaystackError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")

    def wrap(self, user: str, answer_prefix: str = "") -> tuple[str, int]:
        """(full text, offset of `user` in it)."""
        if self.mode == "completion":
            return BOS + user + answer_prefix, len(BOS)
        text = render_chat([{"role": "user", "content": user}], self.thinking, self.reasoning_effort)
        before = render_chat([{"role": "user", "content": "\x00"}], self.thinking,
                             self.reasoning_effort).index("\x00")
        return text, before

    def to_dict(self) -> dict:
        return asdict(self)


class Counter(Protocol):
    """Token count of a prompt in the target tokenizer. `exact` is False when the count
    is an estimate (calibrated from usage.prompt_tokens)."""
    exact: bool
    source: str

    def count(self, prompt: "Prompt") -> int: ...


@dataclass
class Prompt:
    user: str                       # user message content (chat) / text before the answer prefix
    text: str                       # full prompt as the model sees it (our DeepSeek-V4 rendering)
    answer_prefix: str
    fmt: PromptFormat
    key: str
    expected: list[str]
    distractors: list[str]
    value_spans: list[tuple[int, int]]   # char spans of the expected values in `text`
    depth_chars: float              # first queried needle's start / context length (chars)
    keys: list[str] = field(default_factory=list)             # queried keys
    needle_depths: list[float] = field(default_factory=list)  # every queried needle's, text order
    distractor_keys: list[str] = field(default_factory=list)
    n_tokens: int = -1
    target_tokens: int = -1
    exact: bool = False
    count_source: str = ""

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest()

    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.user}]


# ---- filler -------------------------------------------------------------------------------
_SENT = re.compile(r"(?<=[.!?])\s+")


def _sentences(filler: str) -> list[str]:
    if filler == "noise":
        return _SENT.split(NOISE)
    text = " ".join(CORPUS_PATH.read_text(encoding="utf-8").split())
    return [s for s in _SENT.split(text) if s]


class FillerWords:
    """An endless word stream: the filler's sentences in order from a seeded start,
    cycling. Words ending a sentence keep their full stop."""

    def __init__(self, filler: str, rng: random.Random):
        self.sents = _sentences(filler)
        self.start = rng.randrange(len(self.sents))
        self.words: list[str] = []
        self._next = self.start

    def upto(self, n: int) -> list[str]:
        while len(self.words) < n:
            self.words += self.sents[self._next % len(self.sents)].split()
            self._next += 1
        return self.words[:n]


def _ends_sentence(w: str) -> bool:
    return w[-1] in ".!?"


# ---- building -----------------------------------------------------------------------------
def query_text(keys: list[str]) -> str:
    """RULER's list of queried keys: "a", "a, and b", "a, b, and c"."""
    return keys[0] if len(keys) == 1 else ", ".join(keys[:-1]) + ", and " + keys[-1]


def _bounds(words: list[str]) -> tuple[list[int], list[int], int]:
    """Sentence boundaries (word indices), their char positions in the bare context, and
    its length."""
    bounds, pos, at = [0], [0], 0
    for i, wd in enumerate(words):
        at += len(wd) + (1 if i else 0)
        if _ends_sentence(wd):
            bounds.append(i + 1)
            pos.append(at)
    return bounds, pos, max(at, 1)


class _Builder:
    def __init__(self, spec: HaystackSpec, fmt: PromptFormat, depth: float, seed: int):
        if not 0 <= depth <= 100:
            raise HaystackError(f"depth must be in [0, 100], got {depth}")
        self.spec, self.fmt, self.depth = spec, fmt, depth / 100.0
        rng = random.Random(seed)
        drawn = K.draw(spec.kind, spec.value_type, spec.n_keys, spec.n_values, spec.n_queries,
                       spec.distractors, rng)
        self.keys, self.distractor_keys = drawn.queried, drawn.distractor_keys
        self.key, self.distractors = query_text(self.keys), drawn.distractors
        tn, tns = TYPE_NAMES[spec.value_type]
        t = spec.template
        self.needles = [(t.needle.format(type=tn, types=tns, key=k, value=v), v, q, a)
                        for (k, v, q), a in zip(drawn.needles, self._anchors(drawn.needles, rng))]
        multi = spec.kind in ("multivalue", "multiquery")
        self.header = t.header.format(type=tn, types=tns)
        self.question = (t.question_multi if multi else t.question).format(type=tn, types=tns, key=self.key)
        self.answer_prefix = ((t.answer_prefix_multi if multi else t.answer_prefix)
                              .format(type=tn, types=tns, key=self.key)
                              if fmt.mode == "completion" else "")
        self.expected = [v for _, v, q, _ in self.needles if q]
        self.words = FillerWords(spec.filler, rng)

    def _anchors(self, needles, rng: random.Random) -> list:
        """Where each needle goes: an int r is the r-th sentence boundary nearest the depth,
        a float a fraction of the context. The first queried needle goes at the depth and the
        others at seeded fractions; multiquery puts its queried needles at the boundaries
        nearest the depth, one each, in a seeded order (unqueried ones at seeded fractions)."""
        if self.spec.kind != "multiquery":
            return [0 if i == 0 else rng.random() for i in range(len(needles))]
        ranks = rng.sample(range(self.spec.n_queries), self.spec.n_queries)
        return [ranks.pop() if q else rng.random() for _, _, q in needles]

    def _slots(self, bounds: list[int], pos: list[int], total: int) -> dict[int, list]:
        """Needles per boundary word index."""
        by_dist = sorted(range(len(bounds)), key=lambda j: (abs(pos[j] - self.depth * total), j))

        def nearest(frac):
            return min(range(len(bounds)), key=lambda j: (abs(pos[j] - frac * total), j))

        slots: dict[int, list] = {}
        for n in self.needles:
            a = n[3]
            j = by_dist[min(a, len(by_dist) - 1)] if isinstance(a, int) else nearest(a)
            slots.setdefault(bounds[j], []).append(n)
        return slots

    def render(self, w: int, c: int = 0, stop: bool = True, pad: int = 0) -> Prompt:
        """w filler words plus c characters of the next one; `stop` closes an unfinished
        last sentence with a full stop (without it the context ends mid-sentence); `pad`
        trailing spaces end the context (the last resort of the length search)."""
        words = list(self.words.upto(w + 1))
        tail = words[w][:c] if c else None
        words = words[:w] + ([tail] if tail else [])
        if stop and words and not _ends_sentence(words[-1]):
            words[-1] = words[-1] + "."
        slots = self._slots(*_bounds(words))
        pieces: list[tuple[str, str | None, bool]] = []       # (text, value, queried)
        for i in range(len(words) + 1):
            for text, v, q, _ in slots.get(i, []):
                pieces.append((text, v, q))
            if i < len(words):
                pieces.append((words[i], None, False))
        context = " ".join(p[0] for p in pieces) + " " * pad
        user = self.header + context + self.question
        full, off = self.fmt.wrap(user, self.answer_prefix)
        spans, depths, cur = [], [], off + len(self.header)
        for text, v, q in pieces:
            if v is not None and q:
                s = cur + text.rindex(v)
                spans.append((s, s + len(v)))
                depths.append(round((cur - off - len(self.header)) / max(len(context), 1), 6))
            cur += len(text) + 1
        return Prompt(user=user, text=full, answer_prefix=self.answer_prefix, fmt=self.fmt,
                      key=self.key, expected=list(self.expected),
                      distractors=list(self.distractors), value_spans=spans,
                      depth_chars=depths[0] if depths else 0.0, keys=list(self.keys),
                      needle_depths=depths, distractor_keys=list(self.distractor_keys))


def value_token_positions(offsets, value_spans) -> list[int]:
    """Indices of the tokens (char offsets [a, b)) that overlap a needle value's char span."""
    return [j for j, (a, b) in enumerate(offsets) if any(a < e and b > s for s, e in value_spans)]


def needle_entries(needle_tokens, pos: int, ratio: int = 4) -> list[int]:
    """Compressed entries holding a needle token and visible to the query at `pos`: entry j
    pools tokens rj..rj+r-1 and, at V4's ratio 4 (overlapping), in half its channels the
    previous group too; V4.1's ratio-2 and ratio-1 entries are disjoint."""
    own = {t // ratio for t in needle_tokens}
    held = own | {j + 1 for j in own} if ratio == 4 else own
    return sorted(j for j in held if j < (pos + 1) // ratio)


def largest_fit(f, target: int, hint: dict) -> int:
    """Largest w with f(w) <= target, for f non-decreasing. Each f is a /tokenize request
    over HTTP, so the search guesses from a line (`hint`: tokens per word and the count
    with no filler, carried from one prompt to the next, then refitted on the counts seen)
    and bisects only when a guess fails to halve the bracket: about 3 counts per prompt
    where doubling then bisecting took about 12. f(0) is counted only when needed (the
    first prompt, or when no filler fits)."""
    seen: dict[int, int] = {}

    def at(w: int) -> int:
        if w not in seen:
            seen[w] = f(w)
        return seen[w]

    rate = hint.get("per_word", 1.5)
    base = hint["base"] if "base" in hint else at(0)
    lo, hi, halve = 0, None, False
    while hi is None or hi - lo > 1:
        if halve:
            w = (lo + hi) // 2
        else:
            if lo in seen and hi in seen and seen[hi] > seen[lo]:
                r = (seen[hi] - seen[lo]) / (hi - lo)
            else:
                r = rate
            aw, af = ((lo, seen[lo]) if lo in seen else (hi, seen[hi]) if hi is not None
                      else (0, base))
            w = aw + int((target - af) // r)               # the line's largest fit
            w = max(w, lo + 1) if hi is None else min(max(w, lo + 1), hi - 1)
        width = None if hi is None else hi - lo
        v = at(w)
        if v <= target and w > target:        # a word adds at least one token: f(w) >= w
            raise HaystackError(f"the token counter says {w} filler words make {v} tokens: it is not "
                                "counting the text (a tokenize route that ignores the body it was sent?)")
        if v <= target:
            lo = w
            if v == target:                   # a word adds at least one token: w is the largest
                break
        else:
            hi = w
        halve = width is not None and (hi - lo) * 2 > width
    ws = sorted(seen)
    if len(ws) > 1 and ws[-1] - ws[0] >= 16 and seen[ws[-1]] > seen[ws[0]]:
        hint["per_word"] = (seen[ws[-1]] - seen[ws[0]]) / (ws[-1] - ws[0])
    if lo in seen:
        hint["base"] = seen[lo] - hint.get("per_word", rate) * lo
    return lo


def build_prompt(spec: HaystackSpec, fmt: PromptFormat, counter: Counter, target_tokens: int,
                 depth: float, seed: int, hint: dict | None = None) -> Prompt:
    """The prompt with `target_tokens` tokens exactly (by `counter`), needle at `depth` %.
    Search: largest word count w with count <= target (`largest_fit`, starting from the
    tokens-per-word rate in `hint`, which carries it from one prompt to the next), then
    characters of the next word for w and its neighbours, with and without a closing full
    stop, then the same with one or two trailing spaces; if nothing hits, the closest
    prompt below target (exact=False)."""
    hint = {} if hint is None else hint
    b = _Builder(spec, fmt, depth, seed)
    memo: dict[tuple, tuple[int, Prompt]] = {}

    def f(w: int, c: int = 0, stop: bool = True, pad: int = 0) -> int:
        if (w, c, stop, pad) not in memo:
            p = b.render(w, c, stop, pad)
            memo[(w, c, stop, pad)] = (counter.count(p), p)
        return memo[(w, c, stop, pad)][0]

    def done(key, exact):
        n, p = memo[key]
        p.n_tokens, p.target_tokens = n, target_tokens
        p.exact, p.count_source = exact and counter.exact, counter.source
        return p

    def too_short():
        return HaystackError(f"{target_tokens} tokens is below this template's minimum "
                             f"({f(0)} tokens with no filler)")

    if "base" not in hint and f(0) > target_tokens:          # the first prompt counts f(0)
        raise too_short()
    w = largest_fit(f, target_tokens, hint)
    if w == 0 and f(0) > target_tokens:
        raise too_short()
    if f(w) == target_tokens:
        return done((w, 0, True, 0), True)
    for pad in (0, 1, 2):
        for stop in (True, False):
            for ww in (w, w - 1, w + 1, w - 2, w + 2, w - 3, w + 3):
                if ww < 0:
                    continue
                for c in range(0, len(b.words.upto(ww + 1)[ww])):
                    if f(ww, c, stop, pad) == target_tokens:
                        return done((ww, c, stop, pad), True)
    best = max((k for k in memo if memo[k][0] <= target_tokens), key=lambda k: memo[k][0])
    return done(best, False)


def trial_seed(*parts) -> int:
    """A stable 63-bit seed from any JSON-able parts."""
    h = hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


class LocalCounter:
    """Counts with an in-process tokenizer (exact)."""
    exact = True

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.source = f"tokenizer:{tokenizer.fingerprint}"

    def count(self, prompt: Prompt) -> int:
        return self.tok.count(prompt.text)


def probe_prompts(spec: HaystackSpec, fmt: PromptFormat, seed: int = 0,
                  words: int = 800) -> tuple[Prompt, Prompt]:
    """A prompt with no filler and one with `words` filler words (for calibration)."""
    b = _Builder(spec, fmt, 50, seed)
    return b.render(0), b.render(words)
