"""Synthetic retrieval data: haystacks of filler text with key→value needles at random
depths and a question at the end, in exactly the text format of `needle/haystack.py`
(RULER wording, DeepSeek-V4 chat encoding), so the trained model answers the toolkit's own
needle sweeps. The answer is the value followed by EOS.

Filler comes from three sources, none downloaded: the shipped essay corpus
(`reference_model/data/corpus.txt`, as `needle --filler essay` uses it), RULER's repeated
noise sentences (`--filler noise`), and a small grammar written here (so the model sees
filler it cannot memorise). A haystack holds 1–3 needles with different keys; the question
asks for one of them, so retrieval must match the key, not just find a number. With a
`mix` (tiny-needle-v2) the haystack is instead one needle, 2–4 needles with random keys, or
2–4 needles whose other keys are near-duplicates of the queried one. With
`follow_ups`, the other keys are asked in later chat turns (DeepSeek-V4 multi-turn
encoding: answer, EOS, <｜User｜>question, <｜Assistant｜></think>answer, EOS): up to three
supervised answers per haystack for ~50 extra tokens each. The first turn is exactly the
single-question prompt of the needle sweeps."""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from needle.haystack import PromptFormat, Template, _sentences
from needle.keys import near_keys
from needle.words import ADJECTIVES, NOUNS
from reference_model.tokenizer import ASSISTANT, END_THINK, USER

# needle kinds of a `mix` (tiny-needle-v2): one needle; 2-4 needles with random keys; 2-4
# needles whose other keys are near-duplicates of the queried key (needle/keys.py, exactly
# the `--distractors near` draw of the sweeps: a spelling edit of the noun, a shared noun, a
# shared adjective, ...)
MIX_KINDS = ("single", "random", "near")


def parse_mix(text: str) -> tuple[tuple[str, float], ...]:
    """"near=0.5,random=0.2,single=0.3" -> (("near", 0.5), ...), normalised to sum 1."""
    pairs = []
    for part in text.split(","):
        k, _, v = part.partition("=")
        if k.strip() not in MIX_KINDS:
            raise ValueError(f"mix kind must be one of {', '.join(MIX_KINDS)}, got {k!r}")
        pairs.append((k.strip(), float(v)))
    tot = sum(v for _, v in pairs)
    return tuple((k, v / tot) for k, v in pairs)

# ---- a small grammar of plain sentences ------------------------------------------------
_PEOPLE = ("the baker", "a farmer", "the old carpenter", "my neighbour", "the teacher", "a child",
           "the ferryman", "her brother", "the doctor", "a traveller", "the mayor", "our guide",
           "the librarian", "a fisherman", "the gardener", "his sister", "the captain", "a painter")
_VERBS = ("carried", "painted", "found", "repaired", "sold", "counted", "watched", "cleaned",
          "borrowed", "described", "moved", "forgot", "measured", "opened", "wrapped", "followed")
_THINGS = ("a basket of apples", "the blue door", "an old map", "the wooden bench", "a letter",
           "the broken clock", "a jar of honey", "the iron gate", "a pile of books", "the red boat",
           "a heavy box", "the garden wall", "a pair of boots", "the kitchen table", "a lantern")
_PLACES = ("near the river", "behind the mill", "at the market", "in the square", "on the hill",
           "by the harbour", "under the bridge", "in the orchard", "at the station", "past the farm")
_TIMES = ("in the morning", "before noon", "after supper", "on Sunday", "last winter",
          "every spring", "at dawn", "late at night", "during the storm", "one autumn")
_ADJ = ("quiet", "busy", "cold", "bright", "narrow", "crowded", "peaceful", "muddy", "warm", "grey")
_PLACE_N = ("street", "village", "valley", "road", "field", "shore", "yard", "lane")


def grammar_sentence(rng: random.Random) -> str:
    k = rng.randrange(4)
    if k == 0:
        s = f"{rng.choice(_PEOPLE)} {rng.choice(_VERBS)} {rng.choice(_THINGS)} {rng.choice(_PLACES)}."
    elif k == 1:
        s = f"{rng.choice(_TIMES)} {rng.choice(_PEOPLE)} {rng.choice(_VERBS)} {rng.choice(_THINGS)}."
    elif k == 2:
        s = f"the {rng.choice(_PLACE_N)} was {rng.choice(_ADJ)} and {rng.choice(_ADJ)} {rng.choice(_TIMES)}."
    else:
        s = (f"{rng.choice(_PEOPLE)} said that {rng.choice(_PEOPLE)} {rng.choice(_VERBS)} "
             f"{rng.choice(_THINGS)}.")
    return s[0].upper() + s[1:]


# ---- examples ----------------------------------------------------------------------------
@dataclass
class Example:
    ids: list[int]              # prompt + answer + EOS (+ follow-up questions and answers)
    n_prompt: int               # the first answer starts at ids[n_prompt]
    value: str                  # the first answer
    value_tokens: list[int]     # positions of the first queried value's tokens in ids
    answer_spans: list[tuple[int, int]]   # [start, end) of every answer incl. its EOS


class HaystackSampler:
    """Seeded generator of training haystacks of (about) a requested token count."""

    def __init__(self, tokenizer, seed: int = 0,
                 filler_weights=(("essay", 0.5), ("grammar", 0.35), ("noise", 0.15)),
                 needle_counts=((1, 0.4), (2, 0.3), (3, 0.3)), edge_prob: float = 0.15,
                 follow_ups: bool = True, mix=None, multi_keys=(2, 4)):
        self.tok = tokenizer
        self.mix = mix                  # None: v1's needle_counts draw (unchanged stream)
        self.multi_keys = multi_keys
        self.rng = random.Random(seed)
        self.fillers = filler_weights
        self.needle_counts = needle_counts
        self.edge_prob = edge_prob
        self.follow_ups = follow_ups
        self.t = Template()
        self.fmt = PromptFormat("chat")
        self._essay = _sentences("essay")
        self._noise = _sentences("noise")
        self._ntok: dict[str, int] = {}

    def _count(self, s: str) -> int:
        if s not in self._ntok:
            self._ntok[s] = len(self.tok.encode(" " + s))
        return self._ntok[s]

    def _pick(self, pairs):
        r, acc = self.rng.random(), 0.0
        for v, p in pairs:
            acc += p
            if r < acc:
                return v
        return pairs[-1][0]

    def _filler(self, kind: str, budget: int) -> list[str]:
        out, n = [], 0
        if kind == "grammar":
            while n < budget:
                s = grammar_sentence(self.rng)
                out.append(s)
                n += len(self.tok.encode(" " + s))
            return out
        sents = self._essay if kind == "essay" else self._noise
        i = self.rng.randrange(len(sents))
        while n < budget:
            s = sents[i % len(sents)]
            out.append(s)
            n += self._count(s)
            i += 1
        return out

    def _keys(self) -> list[str]:
        """The haystack's keys, the queried one first."""
        rng = self.rng
        kind = "random" if self.mix is None else self._pick(self.mix)
        if self.mix is None:
            k = self._pick(self.needle_counts)
        else:
            k = 1 if kind == "single" else rng.randint(*self.multi_keys)
        if kind == "near":
            key = rng.choice(ADJECTIVES) + "-" + rng.choice(NOUNS)
            return [key] + near_keys(key, k - 1, rng)
        keys: list[str] = []
        while len(keys) < k:
            key = rng.choice(ADJECTIVES) + "-" + rng.choice(NOUNS)
            if key not in keys and (self.mix is None or not any(key in o or o in key for o in keys)):
                keys.append(key)
        return keys

    def example(self, target_tokens: int) -> Example:
        rng = self.rng
        keys = self._keys()
        k = len(keys)
        values: list[str] = []
        while len(values) < k:
            v = str(rng.randint(1_000_000, 9_999_999))
            if v not in values:
                values.append(v)
        needles = [self.t.needle.format(type="number", types="numbers", key=a, value=b)
                   for a, b in zip(keys, values)]
        header = self.t.header.format(type="number", types="numbers")
        question = self.t.question.format(type="number", types="numbers", key=keys[0])
        base = len(self.tok.encode(self.fmt.wrap(header + " ".join(needles) + question)[0]))
        sents = self._filler(self._pick(self.fillers), max(0, target_tokens - base - 2))
        # needle 0 (the queried one) at a random boundary, sometimes at the very ends
        n = len(sents)
        r = rng.random()
        slot0 = 0 if r < self.edge_prob / 2 else (n if r < self.edge_prob else rng.randint(0, n))
        slots = [slot0] + [rng.randint(0, n) for _ in range(k - 1)]
        pieces: list[str] = []
        for i in range(n + 1):
            pieces += [needles[j] for j in range(k) if slots[j] == i]
            if i < n:
                pieces.append(sents[i])
        context = " ".join(pieces)
        text, _ = self.fmt.wrap(header + context + question)
        ids, offsets = self.tok.encode_with_offsets(text)
        start = text.index(needles[0]) + needles[0].rindex(values[0])
        end = start + len(values[0])
        vtok = [j for j, (a, b) in enumerate(offsets) if a < end and b > start]
        n_prompt = len(ids)
        ids = ids + self.tok.encode(values[0]) + [self.tok.eos_id]
        spans = [(n_prompt, len(ids))]
        if self.follow_ups:
            order = list(range(1, k))
            rng.shuffle(order)
            for j in order:
                q = self.t.question.format(type="number", types="numbers", key=keys[j])
                turn = self.tok.encode(USER + q + ASSISTANT + END_THINK)
                ans = self.tok.encode(values[j]) + [self.tok.eos_id]
                ids = ids + turn
                spans.append((len(ids), len(ids) + len(ans)))
                ids = ids + ans
        return Example(ids, n_prompt, values[0], vtok, spans)

    def batch(self, batch_size: int, target_tokens: int, answer_kl_boost: float = 0.0):
        """tokens [B,T] (right-padded with EOS), loss weights [B,T] on the positions that
        predict the answer and EOS, index-KL weights [B,T] (1 on real positions, plus
        `answer_kl_boost` on the answer positions)."""
        exs = [self.example(target_tokens) for _ in range(batch_size)]
        T = max(len(e.ids) for e in exs)
        tokens = torch.full((batch_size, T), self.tok.eos_id, dtype=torch.long)
        lw = torch.zeros(batch_size, T)
        kw = torch.zeros(batch_size, T)
        for b, e in enumerate(exs):
            tokens[b, : len(e.ids)] = torch.tensor(e.ids)
            kw[b, : len(e.ids)] = 1.0
            for a0, a1 in e.answer_spans:                       # positions predicting answers
                lw[b, a0 - 1: a1 - 1] = 1.0
                kw[b, a0 - 1: a1 - 1] += answer_kl_boost
        return tokens, lw, kw, exs
