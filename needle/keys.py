"""Needle keys and values. Keys are adjective-noun pairs; distractor keys are either drawn
at random or, `near`, near-duplicates of the queried key (one word swapped, or one
spelling edit): the hard case for a sparse-attention indexer, where entries that look
alike compete for the last top-k slots (RULER's niah_multikey_3 fell first to an indexer
RoPE bug, sglang PR #13439). Every draw comes from the trial's seeded `random.Random`."""
from __future__ import annotations

import random
import uuid
from dataclasses import dataclass

from .words import ADJECTIVES, NOUNS

VOWELS = "aeiou"


@dataclass
class Needles:
    """What a haystack hides: (key, value, queried) per needle, in drawing order."""
    queried: list[str]                     # queried keys, in the question's order
    needles: list[tuple[str, str, bool]]
    distractor_keys: list[str]
    distractors: list[str]                 # values under the distractor keys


def value(kind: str, rng: random.Random) -> str:
    if kind == "number":
        return str(rng.randint(1_000_000, 9_999_999))
    if kind == "word":
        return rng.choice(ADJECTIVES) + "-" + rng.choice(NOUNS)
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_key(rng: random.Random) -> str:
    return rng.choice(ADJECTIVES) + "-" + rng.choice(NOUNS)


def overlaps(a: str, b: str) -> bool:
    """Equal, or one inside the other: the prompt and string scoring could not tell them apart."""
    return a in b or b in a


def _edits(word: str) -> list[str]:
    """One-letter variants that read like spellings of `word`: a vowel changed (harbor ->
    harber), a vowel inserted beside a vowel (harbor -> harbour), an inner consonant
    doubled (harbor -> harrbor), two inner letters swapped (harbor -> hrabor)."""
    out = []
    for i, ch in enumerate(word):
        if ch in VOWELS:
            out += [word[:i] + v + word[i + 1:] for v in VOWELS if v != ch]
            out += [word[:i + 1] + v + word[i + 1:] for v in VOWELS]
        elif 0 < i < len(word) - 1:
            out.append(word[:i] + ch + word[i:])
        if 0 < i < len(word) - 2 and word[i] != word[i + 1]:
            out.append(word[:i] + word[i + 1] + word[i] + word[i + 2:])
    return sorted(set(out) - {word})


def near_candidates(key: str) -> list[list[str]]:
    """Near-duplicates of `key` by family, hardest first: a spelling edit of the noun, the
    same noun with another adjective, the same adjective with another noun, a spelling edit
    of the adjective. None overlaps `key` (so a plural `key`+s is never one)."""
    adj, noun = key.split("-")
    fams = [[f"{adj}-{n}" for n in _edits(noun)],
            [f"{a}-{noun}" for a in ADJECTIVES if a != adj],
            [f"{adj}-{n}" for n in NOUNS if n != noun],
            [f"{a}-{noun}" for a in _edits(adj)]]
    return [[k for k in fam if not overlaps(k, key)] for fam in fams]


def near_keys(key: str, n: int, rng: random.Random) -> list[str]:
    """n distinct near-duplicates of `key`, one family after another (so three distractors
    are a spelling edit, a shared noun and a shared adjective), each drawn at random."""
    fams = [rng.sample(f, len(f)) for f in near_candidates(key)]
    out: list[str] = []
    i = 0
    while len(out) < n:
        fam = fams[i % len(fams)]
        while fam and fam[-1] in out:
            fam.pop()
        if fam:
            out.append(fam.pop())
        elif not any(fams):
            raise ValueError(f"no more near-duplicates of {key!r}")
        i += 1
    return out


def shaped_value(kind: str, like: str, rng: random.Random, taken: set[str]) -> str:
    """A new value of `like`'s shape (type and length): numbers and UUIDs always have one
    length; words are redrawn until the length matches (then any length, after 1000 draws)."""
    for attempt in range(2000):
        v = value(kind, rng)
        if v not in taken and (len(v) == len(like) or attempt >= 1000):
            return v
    raise ValueError(f"no new {kind} value")


def draw(kind: str, vtype: str, n_keys: int, n_values: int, n_queries: int, distractors: str,
         rng: random.Random) -> Needles:
    """The needles of one trial. single / multikey / multivalue with random distractors keep
    their original draw order (so their prompts are unchanged); near distractors and
    multiquery have their own."""
    if kind == "multiquery":
        return _draw_multiquery(vtype, n_keys, n_queries, rng)
    if kind == "multikey" and distractors == "near":
        return _draw_near(vtype, n_keys, rng)
    n_k = n_keys if kind == "multikey" else 1
    keys: list[str] = []
    while len(keys) < n_k:
        k = random_key(rng)
        if k not in keys:
            keys.append(k)
    n_v = n_values if kind == "multivalue" else 1
    values: list[str] = []
    while len(values) < n_v + n_k - 1:
        v = value(vtype, rng)
        if v not in values and v not in keys:
            values.append(v)
    needles = [(keys[0], v, True) for v in values[:n_v]]
    needles += [(k, v, False) for k, v in zip(keys[1:], values[n_v:])]
    return Needles([keys[0]], needles, keys[1:], values[n_v:])


def _draw_near(vtype: str, n_keys: int, rng: random.Random) -> Needles:
    key = random_key(rng)
    others = near_keys(key, n_keys - 1, rng)
    taken = {key, *others}
    expected = value(vtype, rng)
    while expected in taken:
        expected = value(vtype, rng)
    taken.add(expected)
    vals: list[str] = []
    for _ in others:
        vals.append(shaped_value(vtype, expected, rng, taken))
        taken.add(vals[-1])
    return Needles([key], [(key, expected, True)] + [(k, v, False) for k, v in zip(others, vals)],
                   others, vals)


def _draw_multiquery(vtype: str, n_keys: int, n_queries: int, rng: random.Random) -> Needles:
    """n_keys needles with distinct keys, none inside another (the question lists the
    queried ones side by side); the first n_queries are asked for."""
    keys: list[str] = []
    while len(keys) < n_keys:
        k = random_key(rng)
        if not any(overlaps(k, o) for o in keys):
            keys.append(k)
    vals: list[str] = []
    while len(vals) < n_keys:
        v = value(vtype, rng)
        if v not in vals and v not in keys:
            vals.append(v)
    needles = [(k, v, i < n_queries) for i, (k, v) in enumerate(zip(keys, vals))]
    return Needles(keys[:n_queries], needles, keys[n_queries:], vals[n_queries:])
