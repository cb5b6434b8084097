"""The chunked-prefill family: does the engine's answer jump where its prefill is cut?

An engine prefills a long prompt in chunks of its `chunked_prefill_size`; state carried
across a chunk boundary (indexer keys, compressor rows, the window) is where serving bugs
hide (vLLM PR #51252: top-k wrong only on chunked shapes). Per probe prompt (straddling the
chunk size), the endpoint's prompt logprobs are compared position by position with a
reference scored in one piece (`--arm`, e.g. the golden): KL per position along the
prompt, chunk boundaries marked. Each boundary b is judged by its own pair of windows: the
W positions just before it (`before@b`, the floor) and just after (`after@b`). An arm
whose KL jumps at the boundary is flagged; one that differs from the reference evenly (a
kernel's numerics) is not. What this family cannot tell apart: an arm whose own numerics
change regime at the boundary's position (on the tiny model with 64-token chunks, the
indexer starts selecting at 4 x index_topk = 64 tokens, so an indexer kernel's KL starts
there); `fidelity ab --arm 'x@chunked(N)'` separates the two in-process."""
from __future__ import annotations

from dataclasses import dataclass

from fidelity.scores.bounds import compare
from fidelity.scores.dialects import Request

from .client import LiveArm
from .family import Cost, Family, FamilyError

FAMILY = "chunk"


@dataclass(frozen=True)
class ChunkPlan:
    length: int | None = None      # prompt tokens (default: 1.5 chunks + 1, or the shortest probe
                                   # prompt buildable from there when that is too short)
    probes: int = 4
    window: int = 16               # positions compared on each side of a boundary
    k: int = 5
    seed: int = 0
    chunk_size: int | None = None  # the engine's, when it does not report it


def chunk_size(arm: LiveArm, plan: ChunkPlan) -> int:
    c = arm.sizes().get("chunked_prefill_size") or plan.chunk_size
    if not c:
        raise FamilyError(f"{arm.name}: the chunked-prefill family needs the engine's prefill chunk "
                         "size: the server does not report chunked_prefill_size; give --chunk-size")
    return int(c)


def chunk_prompts(tok, plan: ChunkPlan, c: int) -> list[list[int]]:
    """The prompts ChunkFamily.run sends at chunk size c (for `fidelity engines`, which
    scores their reference before the engine launches)."""
    fam = ChunkFamily(None, None, tok, None, plan)
    n = fam.length_at(c)
    return [fam.probe_ids(probe, n) for probe in range(plan.probes)]


class ChunkFamily(Family):
    name = FAMILY
    SALT = 4
    NEEDS_REFERENCE = "compares with a reference scored in one piece"

    @staticmethod
    def key_prefix(arm: str, p: ChunkPlan) -> str:
        return f"{FAMILY}|{arm}|L{p.length}|s{p.seed}|w{p.window}|k{p.k}|"

    def length_at(self, c: int) -> int:
        """--length, else 1.5 chunks + 1 -- or, when the probe template cannot be built that
        short (a small chunk: 145 tokens at 96), the shortest length from there it can."""
        if self.plan.length:
            return self.plan.length
        n = c + c // 2 + 1
        return n if self._unbuildable(n) is None else (self.shortest(n + 1) or n)

    def length(self) -> int:
        if not hasattr(self, "_n"):
            self._n = self.length_at(chunk_size(self.arm, self.plan))
        return self._n

    def check(self) -> None:
        super().check()
        c, n = chunk_size(self.arm, self.plan), self.length()
        w = min(self.plan.window, c // 2)
        if n <= c + w:
            raise FamilyError(f"the chunk family's {n}-token probe prompts do not cross the {c}-token "
                              f"prefill chunk by {w} positions: give --length chunk=N with N > {c + w}")

    def cost(self) -> Cost:
        n, p = self.length(), self.plan.probes
        return Cost(p, p * n, p, p * n)

    def run(self, progress=lambda m: None) -> None:
        self.check()
        plan = self.plan
        c, n = chunk_size(self.arm, plan), self.length()
        w = min(plan.window, c // 2)
        for probe in range(plan.probes):
            if self.store.has(self._key(probe, "profile")):
                continue
            ids = self.probe_ids(probe, n)
            req = Request(k=plan.k, steps=1)
            ref, got = self.reference.score(ids, req), self.arm.score(ids, req)
            cmp = [compare(p, q, None) for p, q in zip(ref.known[:-1], got.known[:-1])]
            kl, top1 = [c["kl_lb"] for c in cmp], [bool(c["same_top1"]) for c in cmp]
            rows = [self._row(probe, cond, cls, a, kl[a:b], top1[a:b]) for cond, cls, a, b in self._windows(n, c, w)]
            rows.append({"key": self._key(probe, "profile"), "family": FAMILY, "arm": self.arm.name,
                         "probe": probe, "condition": "profile", "requests": 1, "chunk": c, "kl": kl})
            for r in rows:                              # the profile last: it marks the probe done
                if not self.store.has(r["key"]):
                    self.store.add(r)
            progress(f"{self.arm.name}: chunk probe {probe + 1}/{plan.probes} done")

    def _row(self, probe, cond, cls, start, kl, same) -> dict:
        return {"key": self._key(probe, cond), "family": FAMILY, "arm": self.arm.name, "probe": probe,
                "condition": cond, "class": cls, "shared": start, "cached": None, "tokens": [],
                "bitwise": all(x == 0 for x in kl), "kl_window": kl,
                "first_diff": next((i for i, s in enumerate(same) if not s), None),
                "kl_first": kl[0], "kl_max": max(kl), "same_top1_first": same[0]}

    @staticmethod
    def _windows(n: int, c: int, w: int):
        """(condition, class, start, end): the W positions before and after each boundary."""
        for b in range(c, n - 1, c):
            if b + w <= n - 1:
                yield f"before@{b}", "floor", b - w, b
                yield f"after@{b}", "chunk-boundary", b, b + w
