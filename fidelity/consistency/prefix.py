"""The prefix-cache family: does a prompt answered from the engine's prefix cache give
what the same prompt gives cold?

Per probe prompt (an exact-length needle haystack: the model has an answer to lose):
  cold        the prompt after a cache flush -- the reference reply;
  cold-again  flushed and asked again: the floor (what "the same" means on this engine);
  full-hit    asked twice in a row, the second answer compared;
  hit@P       the cache warmed by another prompt sharing the first P tokens, then the
              prompt: P at each boundary class (the window, a CSA group of 4, an HCA group
              of 128, the page and prefill-chunk sizes the server reports) and P +- 1;
  multi-turn  the chat's second turn (the prompt, its answer, a follow-up question) after
              the first, against the second turn cold;
  evicted     the prompt, then other prompts worth more tokens than the cache holds, then
              the prompt again (what is left of its cached prefix, if anything, restored).
Each hit records the engine's own cached-token count, the proof that a hit happened. On a
server without a flush route every cold start is two random leading tokens no request had
(the report says which was used); the floor then compares two such starts, so it is not
exact and hits are judged against it.

The counts are also checked: a cold reply may take no prompt tokens from the cache and a
hit@P at most P. A request the server processed but answered with an error (a 500 while
writing the answer, a gateway's timeout) is retried by the transport, and the retry hits
the cache the first attempt filled: a "cold" reference that is warm, a hit@P that is a full
hit. Such a reply is discarded, the cache flushed and the condition asked again (up to
RERUNS times); the rows and the report say how often."""
from __future__ import annotations

import random
from dataclasses import dataclass

from .client import Generation, LiveArm, Reply
from .compare import compare_replies
from .family import Cost, Family
from .serial import known_list, known_rows
from .store import ProbeStore

FAMILY = "prefix"
FOLLOW_UP = "Say that again, please."
RERUNS = 2               # times a condition is asked again when its reply came from the cache beyond it


@dataclass(frozen=True)
class PrefixPlan:
    length: int = 320            # prompt tokens
    probes: int = 2              # prompts
    max_tokens: int = 8          # greedy tokens compared
    k: int = 5                   # top-k per generated token
    seed: int = 0
    page_size: int | None = None      # the engine's, when it does not report it
    chunk_size: int | None = None
    evict_tokens: int | None = None   # other prompts' tokens sent between a warm-up and the ask
                                      # (default: 1.25 x the cache's max_total_num_tokens if reported)


def boundaries(cfg, sizes: dict, plan: PrefixPlan) -> list[tuple[str, int]]:
    """(class, P) shared-prefix lengths: each class's boundary and +-1, inside the prompt
    (at least one token left to compute). A CSA group boundary is taken off the other
    classes' multiples so it tests the ratio-4 compressor alone."""
    ratios = [r for r in cfg.compress_ratios if r]
    page = sizes.get("page_size") or plan.page_size
    chunk = sizes.get("chunked_prefill_size") or plan.chunk_size
    classes = [("window", cfg.window_size)]
    if 4 in ratios:
        classes.append(("csa-group", 4 * (cfg.window_size // 4 + 5)))
    if 128 in ratios:
        classes.append(("hca-group", 128))
    if page and page > 1:
        classes.append(("page", int(page)))
    if chunk:
        classes.append(("prefill-chunk", int(chunk)))
    out = []
    for name, b in classes:
        for d in (-1, 0, 1):
            p = b + d
            if 1 <= p <= plan.length - 2 and (name, p) not in out:
                out.append((name, p))
    return out


def _parting_at(ids: list[int], p: int, vocab: int) -> list[int]:
    """The prompt with token p replaced: it shares exactly its first p tokens with `ids`
    (another haystack would share the chat template's tokens too)."""
    return ids[:p] + [2 + (ids[p] - 1) % (vocab - 2)] + ids[p + 1:]


def _reply_row(r: Reply) -> dict:
    return {"tokens": r.tokens, "cached": r.cached, "finish": r.finish, "dists": known_rows(r.dists)}


def _reply(row: dict) -> Reply:
    return Reply(row["tokens"], known_list(row["dists"]), row["cached"], row["finish"])


class PrefixFamily(Family):
    name = FAMILY
    SALT = 1

    def __init__(self, arm: LiveArm, store: ProbeStore, tokenizer, cfg, plan: PrefixPlan, reference=None):
        super().__init__(arm, store, tokenizer, cfg, plan, reference)
        self.flush_route: str | None = None
        self.busting: bool | None = None             # decided at the first cold request
        self._rng = random.SystemRandom()
        self.warm: list[int] = []                    # cached counts of replies discarded as warm, this condition
        self.still_warm = False                      # this condition's last reply too

    @staticmethod
    def key_prefix(arm: str, p: PrefixPlan) -> str:
        """What a stored probe's key starts with: the family, the arm and the plan."""
        return f"{FAMILY}|{arm}|L{p.length}|s{p.seed}|n{p.max_tokens}|k{p.k}|"

    def _fresh(self) -> list[int]:
        """An empty cache for what follows: flushed (nothing to prepend), or, on a server
        without a flush route, two random leading tokens no earlier request had."""
        if self.busting is None:
            self.flush_route = self.arm.flush()
            self.busting = self.flush_route is None
            if not self.busting:
                return []
        if not self.busting:
            self.arm.flush()
            return []
        return [self._rng.randrange(2, self.cfg.vocab_size) for _ in range(2)]

    def _ask(self, ids: list[int]) -> Reply:
        return self.arm.generate(ids, Generation(self.plan.max_tokens, self.plan.k))

    def _within(self, once, most: int) -> Reply:
        """once()'s reply, asked again (each once() starts with a flush) while the engine
        says it took more than `most` prompt tokens from its cache -- a retried request
        whose first attempt the server had processed -- at most RERUNS times; the counts
        discarded go to self.warm, and self.still_warm says the last one was over too."""
        for _ in range(RERUNS + 1):
            got = once()
            if got.cached is None or got.cached <= most:
                return got
            self.warm.append(int(got.cached))
        self.still_warm = True
        return got

    def _cold(self, ids: list[int]) -> Reply:
        return self._within(lambda: self._ask(self._fresh() + ids), 0)

    def _twice(self, ids: list[int]) -> Reply:
        lead = self._fresh()
        self._ask(lead + ids)
        return self._ask(lead + ids)

    def _after_warm(self, ids: list[int], warm: list[int], shared: int) -> Reply:
        def once():
            lead = self._fresh()
            self._ask(lead + warm)
            return self._ask(lead + ids)
        return self._within(once, shared)

    def _multi_turn(self, ids: list[int]) -> tuple[Reply, Reply]:
        """A chat's second turn re-sent with the first turn and its answer, after the first
        turn (the cache holds its prompt, and its answer on engines that cache generated
        tokens); and the same second turn cold."""
        lead = self._fresh()
        first = self._ask(lead + ids)
        answer = first.tokens[:first.tokens.index(self.tok.eos_id)] if self.tok.eos_id in first.tokens \
            else first.tokens
        turn2 = ids + answer + self._follow_up()
        got = self._ask(lead + turn2)
        return self._cold(turn2), got

    def _evict_tokens(self) -> int | None:
        """How many tokens of other prompts evict the cache: given, or 1.25 x the capacity
        the server reports (SGLang's max_total_num_tokens); None: the condition is skipped."""
        if self.plan.evict_tokens:
            return self.plan.evict_tokens
        cap = (self.arm.ep.info.get("server_info") or {}).get("max_total_num_tokens")
        return int(1.25 * cap) if cap else None

    def _after_eviction(self, ids: list[int], tokens: int) -> Reply:
        lead = self._fresh()
        self._ask(lead + ids)
        rng = random.Random(tokens)
        for _ in range(-(-tokens // len(ids))):              # prompts of the probe's length
            self._ask(lead[:1] + [rng.randrange(2, self.cfg.vocab_size) for _ in range(len(ids))])
        return self._ask(lead + ids)

    def _follow_up(self) -> list[int]:
        """The tokens that end an assistant turn and ask a follow-up, in the chat encoding
        (DeepSeek's own renderer: the text after the answer in a 3-message conversation)."""
        from reference_model.tokenizer import render_chat
        one = render_chat([{"role": "user", "content": "Q"}], thinking=False)
        three = render_chat([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"},
                             {"role": "user", "content": FOLLOW_UP}], thinking=False)
        return self.tok.encode(three[len(one) + 1:])

    def cost(self) -> Cost:
        """Per probe: cold, cold-again, the full hit (2), each hit (2), the multi-turn (3:
        the second turn twice, about the prompt plus the answer and the follow-up), the
        eviction (the prompt twice and the other prompts between)."""
        p, n, gen = self.plan, self.plan.length, self.plan.max_tokens
        hits = len(boundaries(self.cfg, self.arm.sizes(), p))
        turn2 = n + gen + 16
        requests, tokens = 4 + 2 * hits + 3, 4 * n + 2 * hits * n + n + 2 * turn2
        evict = self._evict_tokens()
        if evict:
            others = -(-evict // n)
            requests, tokens = requests + 2 + others, tokens + (2 + others) * n
        return Cost(p.probes * requests, p.probes * tokens, p.probes * requests * gen)

    def run(self, progress=lambda m: None) -> None:
        plan = self.plan
        points = boundaries(self.cfg, self.arm.sizes(), plan)
        self._fresh()             # learn how cold starts are made, even when every probe is stored
        for probe in range(plan.probes):
            ids = self.probe_ids(probe)
            ref = self._reference(probe, ids)
            self._measure(probe, "cold-again", "floor", None, ref, lambda: self._cold(ids))
            self._measure(probe, "full-hit", "full", len(ids), ref, lambda: self._twice(ids))
            for cls, p in points:
                self._measure(probe, f"hit@{p}", cls, p, ref,
                              lambda p=p: self._after_warm(ids, _parting_at(ids, p, self.cfg.vocab_size), p))
            self._measure(probe, "multi-turn", "multi-turn", len(ids), None, lambda: self._multi_turn(ids))
            evict = self._evict_tokens()
            if evict:
                self._measure(probe, "evicted", "eviction", evict, ref, lambda: self._after_eviction(ids, evict))
            progress(f"{self.arm.name}: prefix probe {probe + 1}/{plan.probes} done")

    def _reference(self, probe: int, ids: list[int]) -> Reply:
        key = self._key(probe, "cold")
        if not self.store.has(key):
            n0 = self.arm.sent
            self.warm, self.still_warm = [], False
            r = self._cold(ids)
            self.store.add({"key": key, "family": FAMILY, "arm": self.arm.name, "probe": probe,
                            "condition": "cold", "requests": self.arm.sent - n0, **self._rerun_fields(),
                            "reference": _reply_row(r)})
        row = next(r for r in self.store.rows if r["key"] == key)
        return _reply(row["reference"])

    def _measure(self, probe, condition, cls, shared, ref: Reply | None, ask) -> None:
        """One condition's reply against `ref` (None: ask() returns its own (ref, reply))."""
        key = self._key(probe, condition)
        if self.store.has(key):
            return
        n0 = self.arm.sent
        self.warm, self.still_warm = [], False
        got = ask()
        if ref is None:
            ref, got = got
        self.store.add({"key": key, "family": FAMILY, "arm": self.arm.name, "probe": probe,
                        "condition": condition, "class": cls, "shared": shared, "requests": self.arm.sent - n0,
                        "cached": got.cached, "tokens": got.tokens, **self._rerun_fields(),
                        "cold_by": self.flush_route or "two random leading tokens (no flush route)",
                        **compare_replies(ref, got)})

    def _rerun_fields(self) -> dict:
        """reruns: times the condition was asked again because a reply came from the cache
        beyond it; warm_cached: those replies' cached counts; still_warm: the kept one too."""
        return {"reruns": len(self.warm), "warm_cached": self.warm, "still_warm": self.still_warm}
