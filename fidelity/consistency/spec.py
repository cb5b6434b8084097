"""The speculative-decoding family: does turning speculation on change the answer?

Every arm, and a baseline serving the same model without speculation (`--spec-baseline
NAME`; neither SGLang nor vLLM has a per-request switch), is asked the same requests and
its replies are recorded in the probe store; then each arm's are compared with the
baseline's (`compared`). Recording first lets `fidelity engines` run its arms one at a time
(the baseline first) and lets a rerun pair new arms with a baseline recorded earlier. A
correct speculative engine is lossless: greedy replies must be the baseline's (on an exact
engine, bit for bit: antirez/ds4 #750's fix made draft 1/2/4 identical), and sampled replies
must follow the baseline's distribution (seeded samples may differ: the verifier draws
differently). Per probe prompt:

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

import numpy as np

from fidelity.scores.bounds import Known, compare

from .client import Generation, Reply
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


def dist_profile(a: list[Known], b: list[Known]) -> tuple[list[float], int | None]:
    """(KL lower bound per step over the common steps, the first step whose reported
    distribution is not bit-identical), of two replies' distributions."""
    kl, first = [], None
    for i, (p, q) in enumerate(zip(a, b)):
        kl.append(float(compare(q, p, None)["kl_lb"]))
        same = (len(p.ids) == len(q.ids) and (p.ids == q.ids).all() and (p.logp == q.logp).all())
        if first is None and not same:
            first = i
    return kl, first


def injected(spec: list[int], base: list[int], specials: set[int] | dict[int, str]) -> list[int]:
    """[the first diverging step] when the speculative reply parts from the baseline's with a
    special token there (a BOS mid-text: antirez/ds4 #750); after the replies part, any
    token may follow, so later special tokens are not counted."""
    i = first_diff(spec, base)
    return [i] if i is not None and i < len(spec) and spec[i] in specials else []


def off_top1(tokens: list[int], dists: list[Known]) -> list[int]:
    """Steps of a greedy reply whose token is not the top-1 of the distribution the engine
    reported for that step (a tie with the top-1 counts as top-1). A lossless engine emits
    only its own top-1 under greedy, speculating or not; a verifier that accepts drafts the
    target rejects emits the draft instead."""
    out = []
    for i, (t, d) in enumerate(zip(tokens, dists)):
        lp = d.get(t)
        if lp is None or lp < float(np.max(d.logp)):
            out.append(i)
    return out


def served_speculation(info: dict | None) -> dict | None:
    """{"on", "k", "how"}: whether a server decodes speculatively and with how many drafts
    per verify, read from its /get_server_info -- fidelity serve's `speculative` block, or
    SGLang's server args (`speculative_algorithm`, `speculative_num_steps`). None when the
    server does not say (vLLM has no such route)."""
    info = info or {}
    s = info.get("speculative")
    if isinstance(s, dict) and "enabled" in s:
        return {"on": bool(s["enabled"]), "k": s.get("num_speculative_tokens"),
                "how": f"/get_server_info speculative.enabled = {bool(s['enabled'])}"}
    if "speculative_algorithm" in info:
        alg = info["speculative_algorithm"]
        return {"on": alg not in (None, "", "NONE"), "k": info.get("speculative_num_steps"),
                "how": f"/get_server_info speculative_algorithm = {alg}"}
    return None


def top1_hits(reply: Reply) -> list[bool]:
    """Per step: is the sampled token the top-1 of the distribution the engine reported?"""
    return [d.top1() == t for t, d in zip(reply.tokens, reply.dists)]


def specials(tok) -> dict[int, str]:
    """The special tokens a reply must not hold where the baseline's does not (EOS aside),
    id -> text (the judge names the one emitted)."""
    return {i: s for s, i in tok.special_ids.items() if i != tok.eos_id}


def _dists_json(dists: list[Known]) -> list:
    return [[d.ids.tolist(), d.logp.tolist()] for d in dists]


def _dists(js: list) -> list[Known]:
    return [Known(np.asarray(i, dtype=np.int64), np.asarray(v, dtype=np.float64)) for i, v in js]


class SpecFamily(Family):
    """Records an arm's replies (greedy, the baseline's twice; sampled over the seeds)."""
    name = FAMILY
    SALT = 7
    baseline_live = False       # set by run_consistency: the baseline is one of this run's arms

    @staticmethod
    def key_prefix(arm: str, p: SpecPlan) -> str:
        return f"{FAMILY}|{arm}|L{p.length}|n{p.max_tokens}|S{p.seeds}|T{p.temperature}|s{p.seed}|k{p.k}|"

    @property
    def is_baseline(self) -> bool:
        return self.arm.name == self.plan.baseline

    def baseline_stored(self) -> bool:
        """Every probe of the baseline recorded under this plan (by an earlier run)."""
        pre = self.key_prefix(self.plan.baseline, self.plan)
        return all(self.store.has(f"{pre}{probe}|sampled") for probe in range(self.plan.probes))

    def check(self) -> None:
        if not self.plan.baseline:
            raise FamilyError("the spec family compares each arm with the same model served without "
                              "speculation: give --spec-baseline NAME (one of the --endpoint names)")
        if not (self.is_baseline or self.baseline_live or self.baseline_stored()):
            raise FamilyError(f"--spec-baseline {self.plan.baseline!r} names no --endpoint, and no replies "
                              "of it are stored for these settings")
        if self.plan.seeds < 2:
            raise FamilyError("the spec family's distribution test needs --spec-seeds >= 2")
        served = self.served()
        if self.is_baseline and served and served["on"]:
            raise FamilyError(f"--spec-baseline {self.plan.baseline!r} decodes speculatively itself "
                              f"({served['how']}, {served['k']} drafts per verify): the baseline must "
                              "serve the same model without speculation")
        super().check()

    def not_speculating(self) -> str:
        """How the server says this (non-baseline) arm decodes without speculation ("" when it
        speculates or does not say): such an arm is not compared -- its replies against the
        baseline's would be read as a speculative fault's."""
        served = self.served()
        return served["how"] if served and not served["on"] and not self.is_baseline else ""

    def served(self) -> dict | None:
        """The arm's speculation as its server reports it (served_speculation)."""
        info = getattr(getattr(self.arm, "ep", None), "info", None) or {}
        return served_speculation(info.get("server_info"))

    def cost(self) -> Cost:
        p, n = self.plan.probes, self.plan.length
        per = 0 if self.not_speculating() else (2 if self.is_baseline else 1) + self.plan.seeds
        return Cost(p * per, p * per * n, p * per * self.plan.max_tokens)

    def run(self, progress=lambda m: None) -> None:
        self.check()
        if self.not_speculating():
            progress(f"{self.arm.name}: not speculating ({self.not_speculating()}): left out of the spec family")
            return
        greedy = ("greedy", "greedy-again") if self.is_baseline else ("greedy",)
        for probe in range(self.plan.probes):
            if self.store.has(self._key(probe, "sampled")):
                continue
            ids = self.probe_ids(probe)
            for cond in greedy:
                if not self.store.has(self._key(probe, cond)):
                    self.store.add(self._greedy(probe, ids, cond))
            self.store.add(self._sampled(probe, ids))          # last: it marks the probe done
            progress(f"{self.arm.name}: spec probe {probe + 1}/{self.plan.probes} recorded")

    def _gen(self, ids, temperature=0.0, seed=None) -> Reply:
        return self.arm.generate(ids, Generation(self.plan.max_tokens, self.plan.k, True, temperature, seed))

    def _row(self, probe: int, condition: str, requests: int) -> dict:
        return {"key": self._key(probe, condition), "family": FAMILY, "arm": self.arm.name, "probe": probe,
                "condition": condition, "requests": requests}

    def _greedy(self, probe: int, ids, condition: str) -> dict:
        r = self._gen(ids)
        return {**self._row(probe, condition, 1), "tokens": r.tokens, "dists": _dists_json(r.dists),
                "spec_meta": r.spec, "served": self.served()}

    def _sampled(self, probe: int, ids) -> dict:
        p = self.plan
        seeds = [p.seed * 1000 + probe * 100 + s for s in range(p.seeds)]
        replies = [self._gen(ids, p.temperature, s) for s in seeds]
        return {**self._row(probe, "sampled", len(seeds)), "temperature": p.temperature, "seeds": seeds,
                "samples": [r.tokens for r in replies], "top1": [top1_hits(r) for r in replies],
                "spec_meta": [r.spec for r in replies]}


def compared(recorded: list[dict], baseline: str, specials: dict[int, str]) -> list[dict]:
    """Each arm's recorded replies against the baseline's, probe by probe (arms in the order
    recorded; a probe the baseline or the arm has not finished is left out): a greedy row
    and a sampled row per probe, as spec_table judges them."""
    by = {(r["arm"], int(r["probe"]), r["condition"]): r for r in recorded}
    arms = list(dict.fromkeys(r["arm"] for r in recorded if r["arm"] != baseline))
    probes = sorted({p for (a, p, c) in by if a == baseline and c == "sampled"})
    out = []
    for arm in arms:
        for probe in probes:
            base = [by.get((baseline, probe, c)) for c in ("greedy", "greedy-again", "sampled")]
            mine = [by.get((arm, probe, c)) for c in ("greedy", "sampled")]
            if all(base) and all(mine):
                out += [_greedy_vs(mine[0], *base[:2], specials), _sampled_vs(mine[1], base[2], specials)]
    return out


def _greedy_vs(spec: dict, base: dict, again: dict, specials: dict[int, str]) -> dict:
    sd, bd = _dists(spec["dists"]), _dists(base["dists"])
    kl, lp_first = dist_profile(sd, bd)
    floor_kl, floor_lp = dist_profile(_dists(again["dists"]), bd)
    inj = injected(spec["tokens"], base["tokens"], specials)
    off = off_top1(spec["tokens"], sd)
    return {"family": FAMILY, "arm": spec["arm"], "probe": spec["probe"], "condition": "greedy",
            "baseline": base["arm"], "requests": spec["requests"],
            "tokens": spec["tokens"], "base_tokens": base["tokens"],
            "first_diff": first_diff(spec["tokens"], base["tokens"]), "first_lp_diff": lp_first,
            "floor_first_diff": first_diff(again["tokens"], base["tokens"]), "floor_first_lp_diff": floor_lp,
            "kl": kl, "kl_max": max(kl, default=0.0), "floor_kl_max": max(floor_kl, default=0.0),
            "injected": inj, "injected_tokens": [specials[spec["tokens"][i]] for i in inj],
            "off_top1": off, "off_top1_special": [specials.get(spec["tokens"][i], "") for i in off],
            "base_off_top1": off_top1(base["tokens"], bd),
            "served": spec.get("served"),
            "spec_meta": spec["spec_meta"], "base_meta": base["spec_meta"]}


def _sampled_vs(spec: dict, base: dict, specials: dict[int, str]) -> dict:
    diffs = [first_diff(a, b) for a, b in zip(spec["samples"], base["samples"])]
    return {"family": FAMILY, "arm": spec["arm"], "probe": spec["probe"], "condition": "sampled",
            "baseline": base["arm"], "requests": spec["requests"], "temperature": spec["temperature"],
            "seeds": spec["seeds"], "samples": spec["samples"], "base_samples": base["samples"],
            "top1": spec["top1"], "base_top1": base["top1"],
            "seed_identical": sum(d is None for d in diffs),
            "first_diff": min((d for d in diffs if d is not None), default=None),
            "injected": sum(len(injected(a, b, specials)) for a, b in zip(spec["samples"], base["samples"])),
            "spec_meta": spec["spec_meta"]}
