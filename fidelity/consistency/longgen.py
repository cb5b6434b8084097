"""The long-generation family: where along its own long output does the engine leave
what the reference would do, and does the output misbehave (loops, thinking until the
cap, special tokens in the text, early EOS)?

Per probe (a chat task, thinking on) the engine generates up to `max_tokens` with top-k
logprobs per token, greedily and once sampled at `temperature`. The same request is then
asked again as one prompt: the engine re-reads its own output in one prefill (prompt
logprobs), with none of the state a long decode builds. The reference computed here
(`--arm`) scores the engine's sequence teacher-forced, in one prefill: before each
generated token, KL(reference || engine) on what the engine reported while generating,
KL(reference || engine) on what it reported re-reading (the floor: its own numerics on
the same tokens at the same positions), and the rank of the engine's token under the
reference. Each stretch of the generation (`stretches`: from step 0, so a bug's onset at
step 20 is inside a judged stretch, not inside the floor) is judged against the re-read
at the same positions (judge.py): a kernel that differs from the reference as much
re-read as generated is not flagged, state that goes bad along the decode is, with the
step where it starts. Long outputs corrupting while short ones never do is sglang
#33397's report."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from fidelity.scores.bounds import Known, compare
from fidelity.scores.dialects import Request

from .client import Generation, Reply
from .family import Cost, Family, FamilyError

FAMILY = "longgen"
ROWS = 256                        # reference logits rows handled at a time (never [n, vocab] whole)
LEAKS = ("<think>", "</think>", "｜DSML｜")
ROLLING = 32                      # tokens in the rolling mean that dates where drift starts


# chat tasks that invite a long answer; rendered with thinking on (DeepSeek's encoder)
TASKS = ("Explain, step by step, how a hash table handles collisions, and compare open "
         "addressing with chaining on a worked example.",
         "Plan a three-day walking tour of an old harbour town, hour by hour, and justify each "
         "choice.",
         "Prove that there are infinitely many primes, then give two other proofs and compare them.",
         "Write a short story about a lighthouse keeper who finds a message in a bottle, then "
         "summarise it in one paragraph.")


@dataclass(frozen=True)
class LongGenPlan:
    probes: int = 2               # chat tasks (TASKS, in order)
    max_tokens: int = 2048
    thinking: bool = True
    temperature: float = 1.0      # the sampled run's (DeepSeek's recommended); 0: greedy only
    first_stretch: int = 16       # tokens in the first judged stretch (then doubling: 16, 32, 64 ...)
    k: int = 5
    ignore_eos: bool = False      # force the length (a model that answers and stops early)
    seed: int = 0

    def modes(self) -> list[tuple[str, float]]:
        """(name, temperature) of the runs per probe: greedy, and sampled unless T is 0."""
        return [("greedy", 0.0)] + ([("sampled", self.temperature)] if self.temperature > 0 else [])


def stretches(n: int, first: int) -> list[tuple[int, int]]:
    """[0, first), [first, 2 first), [2 first, 4 first), ... up to n: every part of a
    generation is judged (none is the floor), short ones early so an onset is dated."""
    out, a, b = [], 0, first
    while a < n:
        out.append((a, min(b, n)))
        a, b = b, 2 * b
    return out


class Along(NamedTuple):
    """Per generated token: KL from the reference generating it, re-reading it, and the
    rank of the engine's token under the reference."""
    kl: list[float]
    floor: list[float]
    rank: list[int]


def teacher_forced(model, prompt: list[int], reply: Reply, reread: list[Known]) -> Along:
    """Per generated token: KL(reference || what the engine reported generating it),
    KL(reference || what it reported re-reading it in one prefill), and the rank of the
    engine's token under the reference (1 = its top choice) -- from one prefill of the
    prompt and the engine's tokens, ROWS logits rows at a time."""
    ids = torch.tensor(prompt + reply.tokens[:-1])
    with torch.no_grad():
        H, _ = model.extend(ids, None, "hidden")       # the head runs ROWS positions at a time
    start = len(prompt) - 1
    kl, floor, rank = [], [], []
    for a in range(0, len(reply.tokens), ROWS):
        with torch.no_grad():
            logits = model.head(H[start + a:start + a + ROWS])
        lp = torch.log_softmax(logits.double(), -1).numpy()
        for j, row in enumerate(lp):
            t = a + j
            ref = Known(np.arange(len(row)), row)
            kl.append(compare(ref, reply.dists[t], None)["kl_lb"])
            floor.append(compare(ref, reread[t], None)["kl_lb"])
            rank.append(1 + int((row > row[reply.tokens[t]]).sum()))
    return Along(kl, floor, rank)


def reread_dists(scores, prompt: list[int], reply: Reply) -> list[Known]:
    """The engine's distribution before each generated token as it re-read prompt + reply
    in one prefill (its prompt logprobs at the positions that predict those tokens)."""
    start, n = len(prompt) - 1, len(reply.tokens)
    got = scores.known[start:start + n]
    if len(got) != n:
        raise FamilyError(f"the engine's re-read of a {n}-token generation answered {len(scores.known)} "
                          f"prompt positions for a {len(prompt) + n}-token prompt")
    return got


def _loop(tokens: list[int], tail: int = 256, n: int = 8) -> bool:
    """A looping tail: under 30% of its n-grams distinct."""
    t = tokens[-tail:]
    grams = [tuple(t[i:i + n]) for i in range(len(t) - n + 1)]
    return len(grams) >= 32 and len(set(grams)) / len(grams) < 0.3


def rolling_mean(x, window: int) -> np.ndarray:
    """r[i] = mean of x[i:i+window] (len(x) - window + 1 values)."""
    return np.convolve(np.asarray(x, float), np.ones(window) / window, "valid")


def drift_start(kl, floor, window: int, jump: float) -> int | None:
    """Where drift starts along one generation: in the first `window`-token stretch whose
    mean KL exceeds `jump` x the highest such mean of the engine's own re-read anywhere
    along the same tokens (any KL at all where the re-read is exact), the first token above
    that level. From step 0: no part of the run is taken as the floor."""
    x, f = np.asarray(kl, float), np.asarray(floor, float)
    w = min(window, len(x))
    if not w:
        return None
    level = jump * rolling_mean(f, w).max()
    over = np.nonzero(rolling_mean(x, w) > level)[0]
    if not len(over):
        return None
    i = int(over[0])
    return i + int(np.argmax(x[i:i + w] > level))


class LongGenFamily(Family):
    name = FAMILY
    NEEDS_REFERENCE = "scores the engine's output with a reference computed here"

    @staticmethod
    def key_prefix(arm: str, p: LongGenPlan) -> str:
        return (f"{FAMILY}|{arm}|t{int(p.thinking)}|T{p.temperature}|s{p.seed}|n{p.max_tokens}|"
                f"r{p.first_stretch}|k{p.k}|e{int(p.ignore_eos)}|")        # r: the re-read floor

    def _prompt(self, probe: int) -> list[int]:
        return self.tok.encode(self.tok.render_chat([{"role": "user", "content": TASKS[probe % len(TASKS)]}],
                                                    thinking=self.plan.thinking).text)

    def cost(self) -> Cost:
        """Per run and probe: the generation, then its re-read (prompt + output as one prompt,
        one ladder token); the reference here scores prompt + output once."""
        runs, gen, n = len(self.plan.modes()), self.plan.max_tokens, self.plan.probes
        prompts = sum(len(self._prompt(p)) for p in range(n))
        return Cost(2 * n * runs, runs * (2 * prompts + n * gen), n * runs * (gen + 1),
                    runs * (prompts + n * gen))

    def run(self, progress=lambda m: None) -> None:
        self._need_reference()
        plan = self.plan
        for probe in range(plan.probes):
            ids = self._prompt(probe)
            for mode, temperature in plan.modes():
                if self.store.has(self._key(probe, f"{mode}:behaviour")):
                    continue
                reply = self.arm.generate(ids, Generation(plan.max_tokens, plan.k, plan.ignore_eos,
                                                          temperature, plan.seed + probe))
                along = self._score(ids, reply)
                for row in self._rows(probe, mode, along.kl, along.floor):
                    if not self.store.has(row["key"]):
                        self.store.add(row)
                self.store.add(self._behaviour(probe, mode, len(ids), reply, along))
                progress(f"{self.arm.name}: long generation {probe + 1}/{plan.probes} ({mode}) done "
                         f"({len(reply.tokens)} tokens)")

    def _score(self, ids: list[int], reply: Reply) -> Along:
        """The generation's KL, its re-read's KL (the engine asked again, prompt + output in
        one prefill) and the ranks, against the reference here."""
        if not reply.tokens:
            return Along([], [], [])
        scores = self.arm.score(ids + reply.tokens, Request(k=self.plan.k, steps=1))
        return teacher_forced(self.reference.model, ids, reply, reread_dists(scores, ids, reply))

    def _rows(self, probe: int, mode: str, kl: list[float], floor: list[float]) -> list[dict]:
        """The re-read (`mode:floor`, the whole output) and each stretch `mode:steps@a`,
        with the generation's KL and the re-read's at the same positions."""
        if not kl:                    # an empty reply: nothing to judge along it
            return []
        parts = [(f"{mode}:floor", "floor", 0, len(kl))] + [
            (f"{mode}:steps@{a}", "generation", a, b) for a, b in stretches(len(kl), self.plan.first_stretch)]
        rows = []
        for cond, cls, a, b in parts:
            x = floor[a:b] if cls == "floor" else kl[a:b]
            rows.append({"key": self._key(probe, cond), "family": FAMILY, "arm": self.arm.name, "probe": probe,
                         "condition": cond, "class": cls, "shared": a, "cached": None, "tokens": [],
                         "bitwise": all(v == 0 for v in x), "kl_window": x, "floor_window": floor[a:b],
                         "first_diff": None, "kl_first": x[0], "kl_max": max(x), "same_top1_first": None})
        return rows

    def _behaviour(self, probe: int, mode: str, prompt_tokens: int, reply: Reply, along: Along) -> dict:
        tok = self.tok
        closed = tok.end_think_id in reply.tokens
        # the reasoning ends at </think>: the content after it must carry no special tags
        content = tok.decode(reply.tokens[reply.tokens.index(tok.end_think_id) + 1:] if closed else
                             ([] if self.plan.thinking else reply.tokens), skip_special_tokens=False)
        return {"key": self._key(probe, f"{mode}:behaviour"), "family": FAMILY, "arm": self.arm.name,
                "probe": probe, "condition": f"{mode}:behaviour", "mode": mode, "prompt_tokens": prompt_tokens,
                "requests": 2 if reply.tokens else 1,
                "tokens": reply.tokens, "finish": reply.finish,
                "length": len(reply.tokens), "loop": _loop(reply.tokens),
                "thinking_until_cap": bool(self.plan.thinking and not closed
                                           and len(reply.tokens) >= self.plan.max_tokens),
                "leaks": [t for t in LEAKS if t in content],
                "early_eos": bool(not self.plan.ignore_eos and len(reply.tokens) < 16),
                "kl": along.kl, "kl_floor": along.floor, "rank": along.rank}
