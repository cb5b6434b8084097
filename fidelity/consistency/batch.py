"""The batch / concurrency family: does a prompt get the same answer alone and in company?

Per probe prompt (an exact-length needle haystack): scored alone (prompt logprobs and a
greedy continuation through kld's dialects -- engines skip their prefix cache for prompt
logprobs, so repeats are not cache hits); alone again (the floor: what "the same" means
on this engine); then, for each concurrency k, `repeats` times while k filler requests of
mixed lengths are being decoded (streamed; the probe is sent once each has produced its
first token; their prompts are random ids, so they share no prefix with it).
Kernels an engine picks by the batch's token count (split-K, tile sizes) show here: "needle
in a batch" (vLLM's batch-invariance test), asked of the deployment itself."""
from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fidelity.scores.dialects import PromptScores, Request
from fidelity.design.prompts import prompt_seed

from .client import LiveArm
from .compare import compare_scores
from .family import Cost, Family
from .serial import known_list, known_rows
from .store import ProbeStore

FAMILY = "batch"
FILLER_LENGTHS = (16, 32, 64, 128)
FILLER_EXTRA = 16         # fillers generate this many tokens more than the probe: still decoding beside it


@dataclass(frozen=True)
class BatchPlan:
    length: int = 200              # probe prompt tokens
    probes: int = 1
    concurrency: tuple[int, ...] = (1, 8, 32)
    repeats: int = 2               # per probe and k
    steps: int = 8                 # greedy tokens scored after the prompt
    k: int = 5                     # top-k per position
    seed: int = 0


def _scores_row(s: PromptScores) -> dict:
    return {"known": known_rows(s.known), "ladder": known_rows(s.ladder), "ladder_tokens": s.ladder_tokens}


def _scores(row: dict, ids: list[int]) -> PromptScores:
    known = known_list(row["known"])
    return PromptScores(ids, known, [None] * len(ids), [None] * len(ids), row["ladder_tokens"],
                        known_list(row["ladder"]))


class BatchFamily(Family):
    name = FAMILY
    SALT = 2

    def __init__(self, arm: LiveArm, store: ProbeStore, tokenizer, cfg, plan: BatchPlan, reference=None):
        super().__init__(arm, store, tokenizer, cfg, plan, reference)
        self.request = Request(k=plan.k, steps=plan.steps, model=None)

    @staticmethod
    def key_prefix(arm: str, p: BatchPlan) -> str:
        """What a stored probe's key starts with: the family, the arm and the plan."""
        return f"{FAMILY}|{arm}|L{p.length}|s{p.seed}|n{p.steps}|k{p.k}|"

    def cost(self) -> Cost:
        p, n, steps = self.plan, self.plan.length, self.plan.steps
        probes = p.probes * (2 + p.repeats * len(p.concurrency))            # alone, again, in company
        fillers = p.probes * p.repeats * sum(p.concurrency)
        filler_tokens = p.probes * p.repeats * sum(FILLER_LENGTHS[i % len(FILLER_LENGTHS)]
                                                   for k in p.concurrency for i in range(k))
        return Cost(probes + fillers, probes * n + filler_tokens, probes * steps + fillers * (steps + FILLER_EXTRA))

    def _score(self, ids: list[int]) -> PromptScores:
        return self.arm.score(ids, self.request)

    def _fillers(self, n: int, salt: int) -> list[list[int]]:
        rng = random.Random(prompt_seed(self.plan.seed, self.plan.length, salt, 3))
        return [[rng.randrange(2, self.cfg.vocab_size) for _ in range(FILLER_LENGTHS[i % len(FILLER_LENGTHS)])]
                for i in range(n)]

    def _in_company(self, ids: list[int], k: int, salt: int) -> PromptScores:
        """The probe scored while k fillers are being decoded: each filler is streamed and
        the probe is sent once every filler's first token has arrived; fillers generate
        more tokens than the probe, so they are still decoding beside it."""
        fillers = self._fillers(k, salt)
        started = [threading.Event() for _ in fillers]
        with ThreadPoolExecutor(k) as ex:
            futs = [ex.submit(self.arm.filler, f, self.plan.steps + FILLER_EXTRA, e)
                    for f, e in zip(fillers, started)]
            for e in started:
                e.wait(self.arm.ep.policy.timeout)
            got = self._score(ids)
            for f in futs:
                f.result()
        return got

    def run(self, progress=lambda m: None) -> None:
        plan = self.plan
        for probe in range(plan.probes):
            ids = self.probe_ids(probe)
            ref = self._reference(probe, ids)
            self._measure(probe, "alone-again", ref, lambda: self._score(ids))
            for j, k in enumerate(plan.concurrency, 1):      # a line per level: a probe takes minutes
                for r in range(plan.repeats):
                    self._measure(probe, f"batch@{k}", ref, lambda k=k, r=r: self._in_company(ids, k, 1000 * k + r),
                                  repeat=r, k=k)
                progress(f"{self.arm.name}: batch probe {probe + 1}/{plan.probes}: {k} in flight done "
                         f"({j}/{len(plan.concurrency)} levels)")

    def _reference(self, probe: int, ids: list[int]) -> PromptScores:
        key = self._key(probe, "alone")
        if not self.store.has(key):
            self.store.add({"key": key, "family": FAMILY, "arm": self.arm.name, "probe": probe,
                            "condition": "alone", "requests": 1, "reference": _scores_row(self._score(ids))})
        row = next(r for r in self.store.rows if r["key"] == key)
        return _scores(row["reference"], ids)

    def _measure(self, probe, condition, ref: PromptScores, ask, repeat: int = 0, k: int = 0) -> None:
        key = self._key(probe, f"{condition}#{repeat}")
        if self.store.has(key):
            return
        got = ask()
        self.store.add({"key": key, "family": FAMILY, "arm": self.arm.name, "probe": probe,
                        "condition": condition, "class": "floor" if k == 0 else "concurrency",
                        "requests": 1 + k,
                        "shared": k or None, "repeat": repeat, "cached": None,
                        "tokens": got.ladder_tokens, **compare_scores(ref, got)})
