"""The long-generation family: where along its own long output does the engine leave
what the reference would do, and does the output misbehave (loops, thinking until the
cap, special tokens in the text, early EOS)?

Per probe (a chat task, thinking on) the engine generates up to `max_tokens` with top-k
logprobs per token, greedily and once sampled at `temperature`. The reference computed
here (`--inprocess`) then scores the engine's own sequence teacher-forced, in one
prefill: before each generated token, KL(reference || engine) on what the engine
reported, and the rank of the engine's token under the reference. Drift is judged like a
chunk boundary: each later stretch of the generation against its first `floor_tokens`
tokens (the arm's own numerics at the start), so a kernel that differs evenly is not
flagged and state that goes bad a few hundred steps in is, with the step where the
rolling KL first leaves the start's range. Long outputs corrupting while short ones
never do is sglang #33397's report."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fidelity.kld.bounds import Known, compare

from .client import Reply
from .family import Cost, Family

FAMILY = "longgen"
ROWS = 256                        # reference logits rows handled at a time (never [n, vocab] whole)
LEAKS = ("<think>", "</think>", "｜DSML｜")


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
    floor_tokens: int = 128       # the start of each generation: the floor of the later stretches
    k: int = 5
    ignore_eos: bool = False      # force the length (a model that answers and stops early)
    seed: int = 0
    rolling: int = 32             # tokens in the rolling mean that dates where drift starts

    def modes(self) -> list[tuple[str, float]]:
        """(name, temperature) of the runs per probe: greedy, and sampled unless T is 0."""
        return [("greedy", 0.0)] + ([("sampled", self.temperature)] if self.temperature > 0 else [])


def stretches(n: int, floor: int) -> list[tuple[int, int]]:
    """[floor, 2 floor), [2 floor, 4 floor), ... up to n: the later parts of a generation."""
    out, a = [], floor
    while a < n:
        out.append((a, min(2 * a, n)))
        a *= 2
    return out


def teacher_forced(model, prompt: list[int], reply: Reply) -> tuple[list[float], list[int]]:
    """Per generated token: KL(reference || engine's reported distribution) and the rank of
    the engine's token under the reference (1 = its top choice), from one prefill of the
    prompt and the engine's tokens, ROWS logits rows at a time."""
    ids = torch.tensor(prompt + reply.tokens[:-1])
    with torch.no_grad():
        H, _ = model.extend(ids, None, "hidden")       # the head runs ROWS positions at a time
    start = len(prompt) - 1
    kl, rank = [], []
    for a in range(0, len(reply.tokens), ROWS):
        with torch.no_grad():
            logits = model.head(H[start + a:start + a + ROWS])
        lp = torch.log_softmax(logits.double(), -1).numpy()
        for j, row in enumerate(lp):
            t = a + j
            ref = Known(np.arange(len(row)), row)
            kl.append(compare(ref, reply.dists[t], None)["kl_lb"])
            rank.append(1 + int((row > row[reply.tokens[t]]).sum()))
    return kl, rank


def _loop(tokens: list[int], tail: int = 256, n: int = 8) -> bool:
    """A looping tail: under 30% of its n-grams distinct."""
    t = tokens[-tail:]
    grams = [tuple(t[i:i + n]) for i in range(len(t) - n + 1)]
    return len(grams) >= 32 and len(set(grams)) / len(grams) < 0.3


def rolling_mean(x, window: int) -> np.ndarray:
    """r[i] = mean of x[i:i+window] (len(x) - window + 1 values)."""
    return np.convolve(np.asarray(x, float), np.ones(window) / window, "valid")


def drift_start(kl: list[float], floor: int, window: int, jump: float) -> int | None:
    """Where drift starts: in the first stretch of `window` tokens after the floor whose mean
    KL exceeds `jump` x the largest such mean within the floor (any KL at all where the floor
    is exact), the first token above that level."""
    x = np.asarray(kl, float)
    if len(x) < floor + window:
        return None
    roll = rolling_mean(x, window)
    base = roll[:floor - window + 1].max() if floor >= window else x[:floor].max()
    level = jump * base
    over = np.nonzero(roll[floor:] > level)[0]
    if not len(over):
        return None
    i = floor + int(over[0])
    return i + int(np.argmax(x[i:i + window] > level))


class LongGenFamily(Family):
    name = FAMILY
    NEEDS_REFERENCE = "scores the engine's output with a reference computed here"

    @staticmethod
    def key_prefix(arm: str, p: LongGenPlan) -> str:
        return (f"{FAMILY}|{arm}|t{int(p.thinking)}|T{p.temperature}|s{p.seed}|n{p.max_tokens}|"
                f"f{p.floor_tokens}|k{p.k}|e{int(p.ignore_eos)}|")

    def _prompt(self, probe: int) -> list[int]:
        return self.tok.encode(self.tok.render_chat([{"role": "user", "content": TASKS[probe % len(TASKS)]}],
                                                    thinking=self.plan.thinking).text)

    def cost(self) -> Cost:
        runs, gen = len(self.plan.modes()), self.plan.max_tokens
        prompts = sum(len(self._prompt(p)) for p in range(self.plan.probes))
        return Cost(self.plan.probes * runs, runs * prompts, self.plan.probes * runs * gen,
                    runs * (prompts + self.plan.probes * gen))

    def run(self, progress=lambda m: None) -> None:
        self._need_reference()
        plan = self.plan
        for probe in range(plan.probes):
            ids = self._prompt(probe)
            for mode, temperature in plan.modes():
                if self.store.has(self._key(probe, f"{mode}:behaviour")):
                    continue
                reply = self.arm.generate(ids, plan.max_tokens, plan.k, ignore_eos=plan.ignore_eos,
                                          temperature=temperature, seed=plan.seed + probe)
                kl, rank = teacher_forced(self.reference.model, ids, reply) if reply.tokens else ([], [])
                for row in self._rows(probe, mode, kl):
                    if not self.store.has(row["key"]):
                        self.store.add(row)
                self.store.add(self._behaviour(probe, mode, len(ids), reply, kl, rank))
                progress(f"{self.arm.name}: long generation {probe + 1}/{plan.probes} ({mode}) done "
                         f"({len(reply.tokens)} tokens)")

    def _rows(self, probe: int, mode: str, kl: list[float]) -> list[dict]:
        f = self.plan.floor_tokens
        parts = [(f"{mode}:start", "floor", 0, min(f, len(kl)))] + [
            (f"{mode}:steps@{a}", "generation", a, b) for a, b in stretches(len(kl), f)]
        return [{"key": self._key(probe, cond), "family": FAMILY, "arm": self.arm.name, "probe": probe,
                 "condition": cond, "class": cls, "shared": a, "cached": None, "tokens": [],
                 "bitwise": all(x == 0 for x in kl[a:b]), "kl_window": kl[a:b], "first_diff": None,
                 "kl_first": kl[a], "kl_max": max(kl[a:b]), "same_top1_first": None}
                for cond, cls, a, b in parts if b > a]

    def _behaviour(self, probe: int, mode: str, prompt_tokens: int, reply: Reply, kl: list[float],
                   rank: list[int]) -> dict:
        from .judge import JUMP
        tok = self.tok
        closed = tok.end_think_id in reply.tokens
        # the reasoning ends at </think>: the content after it must carry no special tags
        content = tok.decode(reply.tokens[reply.tokens.index(tok.end_think_id) + 1:] if closed else
                             ([] if self.plan.thinking else reply.tokens), skip_special_tokens=False)
        return {"key": self._key(probe, f"{mode}:behaviour"), "family": FAMILY, "arm": self.arm.name,
                "probe": probe, "condition": f"{mode}:behaviour", "mode": mode, "prompt_tokens": prompt_tokens,
                "requests": 1,
                "tokens": reply.tokens, "finish": reply.finish,
                "length": len(reply.tokens), "loop": _loop(reply.tokens),
                "thinking_until_cap": bool(self.plan.thinking and not closed
                                           and len(reply.tokens) >= self.plan.max_tokens),
                "leaks": [t for t in LEAKS if t in content],
                "early_eos": bool(not self.plan.ignore_eos and len(reply.tokens) < 16),
                "drift_start": drift_start(kl, self.plan.floor_tokens, self.plan.rolling, JUMP),
                "kl": kl, "rank": rank}
