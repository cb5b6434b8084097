"""The speculative-decoding family: does turning speculation on change the answer?

The same requests go to the arm (speculation on) and to a baseline endpoint serving the
same model without it (`--spec-baseline NAME`; neither SGLang nor vLLM has a per-request
switch). A correct speculative engine is lossless: greedy replies must be the baseline's
(on an exact engine, bit for bit: antirez/ds4 #750's fix made draft 1/2/4 identical), and
sampled replies must follow the baseline's distribution (seeded samples may differ: the
verifier draws differently). Per probe prompt:

* greedy: tokens and logprobs against the baseline's, and against the baseline asked again
  (the floor); the first step where they part is the bug's first diverging step;
* sampled (`seeds` seeds per probe, both arms): seed-identical replies, the first step
  where a seed's replies part, and two distribution tests, spec vs baseline, each a
  permutation test over the arm labels: how often a sampled token is the top-1 of its own
  reported distribution, and how often two samples agree token for token (a verifier that
  ignores temperature decodes greedily: sglang #39253);
* special tokens the speculative reply holds where the baseline's does not (an injected
  BOS mid-text is ds4 #750's symptom);
* the engine's acceptance counts where it reports them (SGLang meta_info spec_*).

Judged once per arm by `spec_table` (spec_judge.py)."""
from __future__ import annotations

from dataclasses import dataclass

from fidelity.kld.bounds import compare

from .client import LiveArm
from .family import Cost, Family, FamilyError

FAMILY = "spec"


@dataclass(frozen=True)
class SpecPlan:
    baseline: str | None = None    # the endpoint serving the same model without speculation
    probes: int = 3
    length: int = 200              # probe prompt tokens
    max_tokens: int = 32           # tokens compared per reply
    seeds: int = 8                 # sampled replies per probe and arm
    temperature: float = 1.0
    k: int = 5
    seed: int = 0


def first_diff(a: list[int], b: list[int]) -> int | None:
    """The first step where two token lists part (a shorter one parts where it ends)."""
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    return i if i is not None or len(a) == len(b) else min(len(a), len(b))


def dist_profile(a, b) -> tuple[list[float], int | None]:
    """(KL lower bound per step over the common steps, the first step whose reported
    distribution is not bit-identical)."""
    kl, first = [], None
    for i, (p, q) in enumerate(zip(a.dists, b.dists)):
        kl.append(float(compare(q, p, None)["kl_lb"]))
        same = (len(p.ids) == len(q.ids) and (p.ids == q.ids).all() and (p.logp == q.logp).all())
        if first is None and not same:
            first = i
    return kl, first


def injected(spec: list[int], base: list[int], specials: set[int]) -> list[int]:
    """[the first diverging step] when the speculative reply parts from the baseline's with a
    special token there (a BOS mid-text: antirez/ds4 #750); after the replies part, any
    token may follow, so later special tokens are not counted."""
    i = first_diff(spec, base)
    return [i] if i is not None and i < len(spec) and spec[i] in specials else []


def top1_hits(reply) -> list[bool]:
    """Per step: is the sampled token the top-1 of the distribution the engine reported?"""
    return [d.top1() == t for t, d in zip(reply.tokens, reply.dists)]


class SpecFamily(Family):
    name = FAMILY
    SALT = 7
    baseline: LiveArm | None = None           # set by run_consistency from --spec-baseline

    @staticmethod
    def key_prefix(arm: str, p: SpecPlan) -> str:
        return (f"{FAMILY}|{arm}|vs{p.baseline}|L{p.length}|n{p.max_tokens}|S{p.seeds}|T{p.temperature}"
                f"|s{p.seed}|k{p.k}|")

    @property
    def is_baseline(self) -> bool:
        return self.arm.name == self.plan.baseline

    def check(self) -> None:
        if not self.plan.baseline:
            raise FamilyError("the spec family compares each arm with the same model served without "
                              "speculation: give --spec-baseline NAME (one of the --endpoint names)")
        if self.baseline is None:
            raise FamilyError(f"--spec-baseline {self.plan.baseline!r} names no --endpoint")
        if self.plan.seeds < 2:
            raise FamilyError("the spec family's distribution test needs --spec-seeds >= 2")
        super().check()

    def cost(self) -> Cost:
        if self.is_baseline:
            return Cost()
        p, n = self.plan.probes, self.plan.length
        per = 3 + 2 * self.plan.seeds
        return Cost(p * per, p * per * n, p * per * self.plan.max_tokens)

    def _specials(self) -> set[int]:
        return set(self.tok.special_ids.values()) - {self.tok.eos_id}

    def run(self, progress=lambda m: None) -> None:
        if self.is_baseline:
            return
        self.check()
        for probe in range(self.plan.probes):
            if self.store.has(self._key(probe, "sampled")):
                continue
            ids = self.probe_ids(probe)
            rows = [self._greedy(probe, ids), self._sampled(probe, ids)]
            for r in rows:                          # `sampled` last: it marks the probe done
                if not self.store.has(r["key"]):
                    self.store.add(r)
            progress(f"{self.arm.name}: spec probe {probe + 1}/{self.plan.probes} done")

    def _gen(self, arm: LiveArm, ids, temperature=0.0, seed=None):
        return arm.generate(ids, self.plan.max_tokens, self.plan.k, ignore_eos=True,
                            temperature=temperature, seed=seed)

    def _greedy(self, probe: int, ids) -> dict:
        spec, base, again = self._gen(self.arm, ids), self._gen(self.baseline, ids), self._gen(self.baseline, ids)
        kl, lp_first = dist_profile(spec, base)
        floor_kl, floor_lp = dist_profile(again, base)
        inj = injected(spec.tokens, base.tokens, self._specials())
        return {"key": self._key(probe, "greedy"), "family": FAMILY, "arm": self.arm.name, "probe": probe,
                "condition": "greedy", "baseline": self.baseline.name, "requests": 3,
                "tokens": spec.tokens, "base_tokens": base.tokens,
                "first_diff": first_diff(spec.tokens, base.tokens), "first_lp_diff": lp_first,
                "floor_first_diff": first_diff(again.tokens, base.tokens), "floor_first_lp_diff": floor_lp,
                "kl": kl, "kl_max": max(kl, default=0.0), "floor_kl_max": max(floor_kl, default=0.0),
                "injected": inj, "spec_meta": spec.spec, "base_meta": base.spec}

    def _sampled(self, probe: int, ids) -> dict:
        p = self.plan
        seeds = [p.seed * 1000 + probe * 100 + s for s in range(p.seeds)]
        spec = [self._gen(self.arm, ids, p.temperature, s) for s in seeds]
        base = [self._gen(self.baseline, ids, p.temperature, s) for s in seeds]
        diffs = [first_diff(a.tokens, b.tokens) for a, b in zip(spec, base)]
        specials = self._specials()
        return {"key": self._key(probe, "sampled"), "family": FAMILY, "arm": self.arm.name, "probe": probe,
                "condition": "sampled", "baseline": self.baseline.name, "requests": 2 * len(seeds),
                "temperature": p.temperature, "seeds": seeds,
                "samples": [a.tokens for a in spec], "base_samples": [b.tokens for b in base],
                "top1": [top1_hits(a) for a in spec], "base_top1": [top1_hits(b) for b in base],
                "seed_identical": sum(d is None for d in diffs),
                "first_diff": min((d for d in diffs if d is not None), default=None),
                "injected": sum(len(injected(a.tokens, b.tokens, specials)) for a, b in zip(spec, base)),
                "spec_meta": [a.spec for a in spec]}
