"""Boundary-aligned prompt lengths (`--lengths boundaries[:MAX]` in ab, kld and needle).

DeepSeek-V4's worst engine bugs act only at some lengths: a needle's last digit wrong
whenever the prompt length is 3 mod 4 (vllm #55927: the ratio-4 compressor's partial
group), output garbage from prompt length 4 (the first complete ratio-4 group, an Ascend
fork), an indexer broken only once the context exceeds index_topk entries (ROCm/ATOM
#1466), a cliff at the 128-token window. A grid of round lengths (250, 511) samples one
residue per length and no boundary on purpose. This module derives the grid from the
model's config instead of hard-coding it:

* every length comes in a block A-1, A, ..., A+m-2 around an anchor A, where m is the
  smallest compress ratio (4 on V4, the CSA groups): the block sits on both sides of A
  and covers every residue mod m, so a bug of one residue shows in one row of the
  per-residue table and not the others;
* anchors: the smallest ratio itself (the first compressed entry exists from length m),
  the sliding window (at W+1 the first token leaves the last query's window), each
  indexer's capacity index_topk x its ratio (2048 on V4-Flash: from there the indexer
  must drop entries; the block runs to A+m, the first length whose last query sees
  index_topk + 1 entries), and the
  larger ratio's multiples R·2^k (either side of a complete HCA group: residues 127, 0,
  1, 2 mod 128 on V4), up to the cap;
* lengths outside [min_len, max_len] are dropped and reported (a haystack has a minimum).

`needle_window_depths` turns "the needle just inside / just outside the window, seen
from the question" into needle depths for one length."""
from __future__ import annotations

from dataclasses import dataclass

KEYWORD = "boundaries"
SYNTAX = "comma-separated integers, or 'boundaries' / 'boundaries:MAX'"


class LengthsError(ValueError):
    """A --lengths value that names no grid."""


@dataclass(frozen=True)
class LengthSpec:
    """A parsed --lengths: explicit lengths, or the boundary grid capped at `max_len`
    (None: the default cap, `default_max`)."""
    lengths: tuple[int, ...] = ()
    boundaries: bool = False
    max_len: int | None = None

    def __str__(self) -> str:
        if self.boundaries:
            return KEYWORD + (f":{self.max_len}" if self.max_len else "")
        return ",".join(map(str, self.lengths))


def parse_lengths(text: str, option: str = "--lengths") -> LengthSpec:
    """`250,511` -> explicit lengths; `boundaries` or `boundaries:4096` -> the boundary
    grid. Anything else raises LengthsError naming the option and the value."""
    t = (text or "").strip()
    if t.lower().startswith(KEYWORD):
        rest = t[len(KEYWORD):]
        if not rest:
            return LengthSpec(boundaries=True)
        if not rest.startswith(":") or not rest[1:].strip().isdigit() or int(rest[1:]) < 2:
            raise LengthsError(f"{option} {text!r}: boundaries:MAX needs an integer MAX >= 2 "
                               f"(the longest length of the grid)")
        return LengthSpec(boundaries=True, max_len=int(rest[1:]))
    try:
        out = tuple(int(x) for x in t.split(",") if x.strip())
    except ValueError:
        raise LengthsError(f"{option} {text!r}: expected {SYNTAX}") from None
    if not out:
        raise LengthsError(f"{option} {text!r}: no lengths given; expected {SYNTAX}")
    bad = [n for n in out if n < 2]
    if bad:
        raise LengthsError(f"{option} {text!r}: lengths must be at least 2 tokens, got {bad}")
    return LengthSpec(lengths=out)


def argtype(text: str) -> LengthSpec:
    """argparse `type` of a --lengths option: a bad value is a usage error naming it."""
    import argparse
    try:
        return parse_lengths(text)
    except LengthsError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


HELP = ("or 'boundaries' / 'boundaries:MAX': lengths derived from the model's config that cover "
        "every residue mod 4 on both sides of the window, of index_topk x 4 and of multiples of "
        "128, up to MAX (default twice the largest of them); reported per residue (docs/lengths.md: "
        "which grid when)")


@dataclass(frozen=True)
class Boundaries:
    """The config's numbers the grid is built from."""
    window: int
    ratios: tuple[int, ...]        # distinct compress ratios > 1, ascending
    index_topk: int
    index_ratios: tuple[int, ...]  # ratios of the layers that run an indexer (4 on V4: CSA)

    @classmethod
    def of(cls, cfg) -> "Boundaries":
        """From a ModelConfig / V41Config, or its to_dict()."""
        get = (cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k))
        rs = [int(r) for r in get("compress_ratios")]
        ratios = tuple(sorted({r for r in rs if r > 1}))
        layers = cfg.indexer_layers() if hasattr(cfg, "indexer_layers") else \
            [i for i, r in enumerate(rs) if r == 4]          # a config dict: V4's CSA layers
        return cls(int(get("window_size")), ratios, int(get("index_topk")),
                   tuple(sorted({rs[i] for i in layers if rs[i] >= 1}, reverse=True)))

    @classmethod
    def from_dict(cls, d: dict) -> "Boundaries":
        """From its own asdict() (a report's manifest)."""
        return cls(int(d["window"]), tuple(d["ratios"]), int(d["index_topk"]), tuple(d["index_ratios"]))

    @property
    def modulus(self) -> int:
        """The residue the grid covers: the smallest ratio's (4 on V4), 1 without one."""
        return self.ratios[0] if self.ratios else 1

    @property
    def index_capacities(self) -> list[tuple[int, int]]:
        """(ratio, length) per indexer ratio: the length whose last query sees exactly
        index_topk compressed entries of that ratio (2048 on V4-Flash)."""
        return [(r, self.index_topk * r) for r in self.index_ratios]


@dataclass(frozen=True)
class GridPoint:
    length: int
    residue: int                   # length mod Boundaries.modulus
    boundary: str                  # which boundaries it sits at (label_length)


def residue_label(length: int, modulus: int) -> str:
    return f"{length % modulus} mod {modulus}"


def _offset(name: str, d: int) -> str:
    return name if d == 0 else f"{name}{d:+d}"


def label_length(length: int, b: Boundaries) -> str:
    """The boundaries `length` sits next to (within its anchor's block), e.g. 'window 128+1;
    1x128+1', or '' when none: works for any length, so a user's own grid is labelled too."""
    m, out = b.modulus, []

    def near(A, hi):
        return A >= 1 and A - 1 <= length <= A + hi

    if b.ratios and near(m, m - 2):
        out.append(_offset(f"ratio {m}", length - m))
    if near(b.window, m - 2):
        out.append(_offset(f"window {b.window}", length - b.window))
    for r, cap in b.index_capacities:
        if near(cap, m):
            out.append(_offset(f"index_topk x{r} {cap}", length - cap))
    for R in b.ratios[1:]:
        k = max(1, round(length / R))
        if near(k * R, m - 2):
            out.append(_offset(f"{k}x{R}", length - k * R))
    return "; ".join(out)


def period_label(length: int, b: Boundaries) -> str:
    """Every period of the config `length` is a whole multiple of, largest first, e.g.
    '3x128 = 12x32 (window) = 96x4': a bug tied to one of them acts at this length, so a
    residue mod 4 alone cannot say which (docs/lengths.md)."""
    named = {b.window: "window"} | {cap: f"index_topk x{r}" for r, cap in b.index_capacities}
    periods = sorted({p for p in (b.window, *b.ratios, *named) if p and p > 1}, reverse=True)
    parts = [f"{length // p}x{p}" + (f" ({named[p]})" if p in named else "")
             for p in periods if length >= p and length % p == 0]
    return " = ".join(parts)


def periods(b: Boundaries) -> list[int]:
    """The config's own length periods, ascending: each compress ratio, the window and each
    indexer's capacity index_topk x ratio (period_label's set)."""
    return sorted({p for p in (b.window, *b.ratios, *(c for _, c in b.index_capacities)) if p and p > 1})


def separating_lengths(acted: list[int], b: Boundaries) -> list[int]:
    """Lengths that tell the config's periods apart for a toggle that acted at `acted` only:
    each acting length L, L + p for every period p (same residue mod p and mod every period
    dividing p, another mod the rest) and L + 1 (another residue for all of them). Run at
    these, the lengths it acts at read off its period (`period_reading`); acting at L alone
    means that one length."""
    return sorted({x for L in acted for x in (L, L + 1, *(L + p for p in periods(b)))})


def period_reading(acted: list[int], tried: list[int], b: Boundaries) -> str:
    """Which of the config's periods explain where a toggle acted, in words: the one period
    that fits (`fits`), or the several this run cannot tell apart. With one acting length
    and no period fitting: the periods ruled out (another length of the run shares its
    residue and did not act) and those this run cannot rule out. '' when the grid says
    nothing (a single length tried, or acting lengths of mixed residues)."""
    acted, tried = sorted(set(acted)), sorted(set(tried) | set(acted))
    if not acted:
        return ""
    fit = fits(acted, tried, b)
    if fit:
        p = fit[0]
        same = [L for L in tried if L % p == acted[0] % p]
        said = (f"it acted at every length {acted[0] % p} mod {p} of this run ({', '.join(map(str, same))}) and at "
                f"no other: a condition with period {p}{_period_name(p, b)}")
        if len(fit) > 1:
            said += f", or {' or '.join(map(str, fit[1:]))}: this run cannot tell them apart"
        return said
    if len(acted) > 1:
        return ""
    L = acted[0]
    out = [p for p in periods(b) if any(x != L and x % p == L % p for x in tried)]
    if not out:
        return ""
    left = [p for p in periods(b) if p not in out]
    return (f"length {L} alone: lengths sharing its residue mod {', '.join(map(str, out))} did not act"
            + (f"; a period of {', '.join(map(str, left))} is not ruled out by this run" if left else ""))


def fits(acted: list[int], tried: list[int], b: Boundaries) -> list[int]:
    """The config's periods p (ascending) that explain where a toggle acted: every acting
    length has one residue r mod p, and every tried length with that residue acted (two
    lengths at least: one length alone fits no period)."""
    acted, tried = sorted(set(acted)), set(tried) | set(acted)
    out = []
    for p in periods(b):
        same = {L for L in tried if L % p == acted[0] % p}
        if all(L % p == acted[0] % p for L in acted) and same == set(acted) and len(same) >= 2:
            out.append(p)
    return out


def _period_name(p: int, b: Boundaries) -> str:
    names = [n for n, v in (("the window", b.window), *((f"compress ratio {r}", r) for r in b.ratios),
                            *((f"index_topk x{r}", c) for r, c in b.index_capacities)) if v == p]
    return f" ({', '.join(names)})" if names else ""


def default_max(b: Boundaries, min_len: int = 2) -> int:
    """Twice the largest structural length (window, index_topk x ratio, the largest ratio,
    the shortest prompt allowed), plus the rest of that anchor's block: every boundary
    once, and a multiple of the largest ratio above the shortest prompt (a haystack of the
    tiny model needs ~160 tokens)."""
    caps = [c for _, c in b.index_capacities]
    return 2 * max([b.window, *caps, *b.ratios, min_len]) + b.modulus - 2


def _anchors(b: Boundaries, max_len: int) -> list[tuple[int, int]]:
    """(anchor, last offset of its block)."""
    m = b.modulus
    out = [(b.window, m - 2)]
    if b.ratios:
        out.append((m, m - 2))
    out += [(cap, m) for _, cap in b.index_capacities]
    for R in b.ratios[1:]:
        A = R
        while A - 1 <= max_len:
            out.append((A, m - 2))
            A *= 2
    return out


def boundary_grid(cfg, max_len: int | None = None, min_len: int = 2) -> tuple[list[GridPoint], list[int]]:
    """The boundary grid of `cfg` (lengths ascending) and the lengths it dropped for
    lying outside [min_len, max_len] (max_len None: default_max)."""
    b = cfg if isinstance(cfg, Boundaries) else Boundaries.of(cfg)
    top = default_max(b, min_len) if max_len is None else max_len
    cand = sorted({A + d for A, hi in _anchors(b, top) for d in range(-1, hi + 1) if A + d >= 1})
    keep = [L for L in cand if min_len <= L <= top]
    dropped = [L for L in cand if L not in keep and L >= 1]
    return [GridPoint(L, L % b.modulus, label_length(L, b)) for L in keep], dropped


def resolve(spec: LengthSpec, cfg, min_len: int = 2,
            option: str = "--lengths") -> tuple[list[int], list[GridPoint], str]:
    """Lengths to run, every length's grid point (residue, boundary label) and a note for
    the user on what the grid dropped ('' when nothing). Raises LengthsError when the
    boundary grid keeps no length."""
    b = Boundaries.of(cfg)
    if not spec.boundaries:
        pts = [GridPoint(L, L % b.modulus, label_length(L, b)) for L in spec.lengths]
        return list(spec.lengths), pts, ""
    pts, dropped = boundary_grid(b, spec.max_len, min_len)
    top = spec.max_len or default_max(b, min_len)
    if not pts:
        raise LengthsError(f"{option} {spec}: no boundary length between {min_len} (the shortest "
                           f"prompt) and {top}; give a larger MAX")
    note = ""
    if dropped:
        note = (f"{option} {spec}: {len(pts)} lengths from {pts[0].length} to {pts[-1].length}; "
                f"left out {len(dropped)} outside [{min_len}, {top}]: {', '.join(map(str, dropped))}")
    return [p.length for p in pts], pts, note


def shortest_haystack(counter, spec=None, fmt=None, seeds: int = 16, margin: int = 8) -> int:
    """Fewest tokens a needle haystack can be built with (the boundary grid drops shorter
    lengths): the longest no-filler prompt over `seeds` needles (keys and values differ
    in length) by `counter` (needle.haystack's: LocalCounter(tokenizer) in process), plus
    `margin` tokens so the exact-length search has filler to work with."""
    from needle.haystack import HaystackSpec, PromptFormat, probe_prompts
    return max(counter.count(probe_prompts(spec or HaystackSpec(), fmt or PromptFormat(), s)[0])
               for s in range(seeds)) + margin


def needle_window_depths(length: int, window: int, no_filler_length: int, tail: int,
                         margin: int | None = None) -> list[tuple[float, str]]:
    """Needle depths (percent) that put the needle's value about `window - margin` tokens
    (inside the last query's window) and `window + margin` tokens (just outside) before the
    prompt's last token, with their side ('inside'/'outside'); a side the prompt cannot
    reach is left out (on the tiny model the question alone is longer than the window).

    `no_filler_length`: tokens of the prompt with no filler; `tail`: tokens after the
    needle's value in it (its distance from the last token at depth 100). The distance
    grows linearly with the filler above the needle: tail + (1 - depth) x filler. The
    haystack snaps the needle to a sentence boundary, so the distance is approximate;
    in-process runs report the measured one."""
    margin = max(1, window // 4) if margin is None else margin
    filler = length - no_filler_length
    out = []
    for side, dist in (("inside", window - margin), ("outside", window + margin)):
        if filler <= 0:
            break
        d = min(max(dist, tail), tail + filler)
        if (side == "inside") != (d <= window - 1):
            continue
        depth = round(100 * (1 - (d - tail) / filler), 1)
        if all(abs(depth - x) > 1e-9 for x, _ in out):
            out.append((depth, side))
    return out
