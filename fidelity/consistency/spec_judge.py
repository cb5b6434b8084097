"""The spec family's one judgement per arm (speculation on vs the baseline without it).

Flagged when
* greedy: the baseline's floor (asked twice) is exact and some speculative reply is not
  bit-identical to the baseline's -- tokens or reported logprobs; on a baseline that is not
  exact, when replies part in tokens on more probes than the floor's do;
* sampled: how often the samples take their step's top-1 token, or how often two samples
  agree, differs from the baseline's (two-sided permutation tests over the arm labels,
  Bonferroni over the two, p < ALPHA): a lossless speculative sampler draws from the same
  distribution, whatever its seeds give;
* a speculative greedy reply parts from the baseline's with a special token;
* a greedy token is not the top-1 of its own reported distribution more often than in the
  baseline's replies (only an emitted token that is not the target's pick does that).
A flagged arm's acceptance is also set against a *reference* speculative arm of the same run:
one judged lossless, serving the same drafts per verify (`reference_acceptance`); a first
draft accepted more often than there is evidence that the verifier accepts what it should not.
Each flagged arm gets its first token and first distribution difference and the kind the
evidence points to (`_looks_like`): wrong acceptance, a corrupt correction row, the
verify's arithmetic, state carried across a verify, a verifier that does not sample."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd
from scipy.stats import fisher_exact

from reference_model.tokenizer import BOS

ALPHA = 0.05
PERMUTATIONS = 2000


def agreement(samples: list[list[int]]) -> float:
    """Mean over pairs of samples of the fraction of steps holding the same token."""
    pairs = [(a, b) for a, b in itertools.combinations(samples, 2) if min(len(a), len(b))]
    if not pairs:
        return float("nan")
    return float(np.mean([np.mean([x == y for x, y in zip(a, b)]) for a, b in pairs]))


def greedy_rate(hits: list[list[bool]]) -> float:
    """Mean over samples of the fraction of their steps that took the top-1 token."""
    rates = [np.mean(h) for h in hits if len(h)]
    return float(np.mean(rates)) if rates else float("nan")


def permutation_p(groups: list[tuple[list, list]], seed: int = 0, of=agreement) -> tuple[float, float]:
    """(mean of(spec) - of(base) over probes, two-sided permutation p): the arm labels of
    each probe's samples shuffled together (seeded: the same data gives the same p).
    `of`: agreement (samples' token lists) or greedy_rate (their top-1 hits)."""
    def stat(gs):
        return float(np.nanmean([of(a) - of(b) for a, b in gs]))
    d = stat(groups)
    if not np.isfinite(d):
        return d, 1.0
    rng = np.random.default_rng(seed)
    hits = 0
    for _ in range(PERMUTATIONS):
        perm = []
        for a, b in groups:
            pool = list(a) + list(b)
            idx = rng.permutation(len(pool))
            perm.append(([pool[i] for i in idx[:len(a)]], [pool[i] for i in idx[len(a):]]))
        hits += abs(stat(perm)) >= abs(d) - 1e-12
    return d, (1 + hits) / (1 + PERMUTATIONS)


def _spec_metas(greedy: pd.DataFrame) -> tuple[list[dict], list | None]:
    """The greedy probes' spec_* counts that hold verifies, and their accepted-per-draft-position
    lists (None unless every one reports them)."""
    metas = [m for m in greedy.get("spec_meta", []) if isinstance(m, dict) and m.get("spec_verify_ct")]
    per = [m.get("spec_accepted_per_position") for m in metas]
    return metas, per if all(isinstance(p, list) for p in per) else None


def _accept(greedy: pd.DataFrame) -> tuple[float | None, list[float] | None]:
    """Mean accepted tokens per verify + 1 and the acceptance rate per draft position, from
    the engine's spec_* counts (None where it reports none)."""
    metas, per = _spec_metas(greedy)
    if not metas:
        return None, None
    length = float(np.mean([m.get("spec_accept_length", np.nan) for m in metas]))
    if per is None:
        return length, None
    verifies = sum(m["spec_verify_ct"] for m in metas)
    return length, [float(x) / verifies for x in np.sum(np.array(per, dtype=float), 0)]


def accept_counts(greedy: pd.DataFrame) -> tuple[int, int] | None:
    """(verifies, first drafts accepted) summed over the greedy probes' spec_* counts (None
    where the engine reports no per-position counts). The first draft position is the one
    every verify tries, so its count is a plain proportion over verifies."""
    metas, per = _spec_metas(greedy)
    if not metas or per is None or not all(per):
        return None
    return int(sum(m["spec_verify_ct"] for m in metas)), int(sum(p[0] for p in per))


def reference_acceptance(arm: tuple[int, int], ref: tuple[int, int]) -> float:
    """One-sided Fisher exact p that the arm accepts its first draft more often than the
    reference arm (verifies, accepted each). Verifies within one reply are not independent
    trials, so read p as a screen, not as an exact error rate."""
    (n1, a1), (n0, a0) = arm, ref
    return float(fisher_exact([[a1, n1 - a1], [a0, n0 - a0]], alternative="greater")[1])


def _off_top1(greedy: pd.DataFrame) -> tuple[list[str], list[int], int]:
    """Over the greedy probes: per step whose token is not its own reported top-1, the
    special token's name ("" for an ordinary token); those steps; the baseline's count."""
    names = [t for x in greedy.get("off_top1_special", []) for t in x]
    steps = [i for x in greedy.get("off_top1", []) for i in x]
    return names, steps, sum(len(x) for x in greedy.get("base_off_top1", []))


def _served_k(greedy: pd.DataFrame) -> int | None:
    """The drafts per verify the arm's server reported serving (None: it did not say)."""
    ks = [m.get("k") for m in greedy.get("served", []) if isinstance(m, dict) and m.get("on")]
    return int(ks[0]) if ks and ks[0] is not None else None


def _looks_like(greedy_flag: bool, sampled_flag: bool, first_lp_step, off: list[str], base_off: int,
                injected: list[str], k: int | None, accepts_more: str = "") -> str:
    """The signature in words, from evidence, most specific first.

    * Greedy tokens that are not the top-1 of their own reported distribution (`off`: the
      special-token names among them, "" for ordinary tokens), more than the baseline's:
      something other than the target's pick was emitted. Only BOS, with two or more
      drafts, is the corrupt correction row of antirez/ds4 #750 (a rollback without
      snapshot reads a zeroed row); anything else -- at one draft always, since no rollback
      can then corrupt a row -- is a verifier accepting drafts the target rejects.
    * `accepts_more` (the acceptance above a lossless reference arm's, in words; "" when
      not): the same kind, from the engine's own counts.
    * A special token where the replies part that *is* its step's top-1: the row itself
      moved there (the state or numerics below), named by the token.
    * Otherwise the first distribution step: 0-1 comes from the first verify's first row on
      the prefill's state, so the verify's own arithmetic; later, state carried across a
      verify (the rollback) -- or a verify whose first rows happened to round alike.
    * Only the sampled distribution moving: a verifier that does not sample."""
    drafts = f"{k} draft{'s' if k != 1 else ''} per verify" if k else "drafts per verify not reported"
    more = f"; {accepts_more}" if accepts_more else ""
    if len(off) > base_off:
        specials = sorted({t for t in off if t})
        if specials == [BOS] and (k is None or k >= 2) and not accepts_more:
            return (f"a logits row read corrupt after a verify: BOS emitted where it is not its step's top-1 "
                    f"({drafts}; antirez/ds4 #750 class: a rollback without snapshot read a zeroed row)")
        named = f", among them the special token(s) {', '.join(specials)}" if specials else ""
        return (f"a verifier that accepts drafts the target rejects: {len(off)} greedy token(s) are not the "
                f"top-1 of the distribution the server reported for their step (the baseline's: {base_off})"
                f"{named}{more}; {drafts}")
    if accepts_more and (greedy_flag or injected):
        return f"a verifier that accepts drafts the target rejects: {accepts_more}; {drafts}"
    tail = f" (the replies part with the special token {injected[0]}, its step's top-1)" if injected else ""
    if greedy_flag or injected:
        if first_lp_step is not None and first_lp_step <= 1:
            return ("a verify step whose numerics differ from a decode step's: not batch-exact "
                    f"(antirez/ds4 #750 class){tail}")
        return ("state carried wrongly across a verify: the rollback of the window / compressor "
                f"(GDzhu01/vllm-ascend-deepseekv4 #131 class){tail}")
    if sampled_flag:
        return "a verifier that does not sample as the request asks (sglang #39253 class)"
    return ""


def spec_table(rows: pd.DataFrame) -> pd.DataFrame:
    cols = ["arm", "baseline", "probes", "greedy_bitwise", "greedy_diverged", "first_step",
            "first_lp_step", "kl_first", "kl_max", "floor", "seed_identical", "samples",
            "sampled_first_step", "agree_spec", "agree_base", "top1_spec", "top1_base",
            "p_distribution", "injected", "injected_token", "off_top1", "base_off_top1", "first_off_top1",
            "k_served", "accept_length", "accept_per_position", "accept_first", "accept_reference",
            "p_accept_above", "flagged", "looks_like", "why"]
    if rows.empty or "family" not in rows:
        return pd.DataFrame(columns=cols)
    out, evidence = [], []
    for arm, g in rows[rows.family == "spec"].groupby("arm", sort=False):
        gr, sa = g[g.condition == "greedy"], g[g.condition == "sampled"]
        exact_floor = bool(gr.floor_first_diff.isna().all() and gr.floor_first_lp_diff.isna().all())
        lp = pd.to_numeric(gr.first_lp_diff, errors="coerce")
        tok = pd.to_numeric(gr.first_diff, errors="coerce")
        bitwise = int((lp.isna() & tok.isna()).sum())
        if exact_floor:
            greedy_flag = bitwise < len(gr)
        else:
            greedy_flag = int(tok.notna().sum()) > int(pd.to_numeric(gr.floor_first_diff, errors="coerce").notna().sum())
        first_kl = None
        if lp.notna().any():
            r = gr.loc[lp.idxmin()]
            first_kl = float(r.kl[int(r.first_lp_diff)])
        d, p_agree = permutation_p(list(zip(sa.samples, sa.base_samples)))
        dg, p_top1 = permutation_p(list(zip(sa.top1, sa.base_top1)), of=greedy_rate)
        p = min(1.0, 2 * min(p_agree, p_top1))                # Bonferroni over the two tests
        n_inj = int(sum(len(x) for x in gr.injected))
        inj_tokens = [t for x in gr.get("injected_tokens", []) for t in x]
        off, off_steps, base_off = _off_top1(gr)
        k = _served_k(gr)
        sampled_flag = p < ALPHA
        length, per = _accept(gr)
        counts = accept_counts(gr)
        flagged = bool(greedy_flag or sampled_flag or n_inj or len(off) > base_off)
        why = []
        if greedy_flag:
            why.append(f"greedy replies differ from the baseline's in {len(gr) - bitwise}/{len(gr)} probes"
                       + (" (the baseline's own floor is exact)" if exact_floor else ""))
        if sampled_flag:
            why.append(f"sampled replies take the top-1 token {dg:+.2f} more often than the baseline's and "
                       f"agree with each other {d:+.2f} more (p = {p:.2g})")
        if n_inj:
            why.append(f"{n_inj} special token(s) injected ({', '.join(dict.fromkeys(inj_tokens))})"
                       if inj_tokens else f"{n_inj} special token(s) injected")
        if len(off) > base_off:
            why.append(f"{len(off)} greedy token(s) not the top-1 of their own reported distribution "
                       f"(first at step {min(off_steps)}; the baseline's: {base_off})")
        out.append({"arm": arm, "baseline": g.baseline.iloc[0], "probes": len(gr), "greedy_bitwise": bitwise,
                    "greedy_diverged": int(tok.notna().sum()),
                    "first_step": int(tok.min()) if tok.notna().any() else None,
                    "first_lp_step": int(lp.min()) if lp.notna().any() else None,
                    "kl_first": first_kl, "kl_max": float(gr.kl_max.max()),
                    "floor": "bit-identical" if exact_floor else f"KL up to {gr.floor_kl_max.max():.3g}",
                    "seed_identical": int(sa.seed_identical.sum()), "samples": int(sum(len(s) for s in sa.seeds)),
                    "sampled_first_step": (int(pd.to_numeric(sa.first_diff, errors="coerce").min())
                                           if pd.to_numeric(sa.first_diff, errors="coerce").notna().any() else None),
                    "agree_spec": float(np.nanmean([agreement(s) for s in sa.samples])),
                    "agree_base": float(np.nanmean([agreement(s) for s in sa.base_samples])),
                    "top1_spec": float(np.nanmean([greedy_rate(h) for h in sa.top1])),
                    "top1_base": float(np.nanmean([greedy_rate(h) for h in sa.base_top1])),
                    "p_distribution": p, "injected": n_inj,
                    "injected_token": ", ".join(dict.fromkeys(inj_tokens)) or None,
                    "off_top1": len(off), "base_off_top1": base_off,
                    "first_off_top1": min(off_steps) if off_steps else None, "k_served": k,
                    "accept_length": length,
                    "accept_per_position": None if per is None else " / ".join(f"{x:.2f}" for x in per),
                    "accept_first": None if counts is None else f"{counts[1]}/{counts[0]}",
                    "accept_reference": None, "p_accept_above": None,
                    "flagged": flagged, "looks_like": "", "why": "; ".join(why) or "lossless"})
        evidence.append((counts, (greedy_flag, sampled_flag, int(lp.min()) if lp.notna().any() else None,
                                  off, base_off, inj_tokens, k)))
    for r, (counts, ev) in zip(out, evidence):
        more = _against_reference(r, counts, out, evidence)
        r["looks_like"] = _looks_like(*ev, accepts_more=more) if r["flagged"] else ""
    return pd.DataFrame(out, columns=cols)


def _against_reference(r: dict, counts, out: list[dict], evidence: list) -> str:
    """For a flagged arm with acceptance counts: fill its reference columns from the first
    lossless arm of the run with the same baseline and the same drafts per verify, and
    return the acceptance above it in words when p < ALPHA ("" otherwise)."""
    if not r["flagged"] or counts is None or r["k_served"] is None:
        return ""
    ref = next(((o, c) for o, (c, _) in zip(out, evidence)
                if not o["flagged"] and c is not None and o["k_served"] == r["k_served"]
                and o["baseline"] == r["baseline"]), None)
    if ref is None:
        return ""
    o, c = ref
    p = reference_acceptance(counts, c)
    r["accept_reference"], r["p_accept_above"] = o["arm"], p
    if p >= ALPHA:
        return ""
    return (f"its first draft is accepted in {counts[1]}/{counts[0]} verifies ({counts[1] / counts[0]:.2f}), "
            f"the lossless `{o['arm']}`'s at the same drafts per verify in {c[1]}/{c[0]} "
            f"({c[1] / c[0]:.2f}; one-sided p = {p:.2g})")


def spec_lines(t: pd.DataFrame) -> list[str]:
    """One sentence per arm: lossless or not, the first diverging step, what it looks like,
    and the engine's acceptance where reported."""
    lines = []
    for _, r in t.iterrows():
        acc = ""
        if r.accept_length is not None and np.isfinite(r.accept_length):
            per = (f", accepted per draft position {r.accept_per_position}"
                   if isinstance(r.accept_per_position, str) else "")
            acc = f" Acceptance length {r.accept_length:.2f}{per}."
        if not r.flagged:
            same = ("bit-identical" if r.greedy_bitwise == r.probes else "the same greedy tokens")
            lines.append(f"`{r.arm}` (spec, vs `{r.baseline}`): lossless -- greedy replies {same} in "
                         f"{r.probes}/{r.probes} probes, sampled replies as distributed as the baseline's "
                         f"(p = {r.p_distribution:.2g}; {r.seed_identical}/{r.samples} seed-identical).{acc}")
            continue
        parts = []
        if r.first_step is not None and pd.notna(r.first_step):
            parts.append(f"greedy tokens part from the baseline's at generated step {int(r.first_step)}")
        if r.first_lp_step is not None and pd.notna(r.first_lp_step):
            parts.append(f"the reported distributions at step {int(r.first_lp_step)}")
        elif r.sampled_first_step is not None and pd.notna(r.sampled_first_step):
            parts.append(f"sampled replies at step {int(r.sampled_first_step)}")
        where = f" ({', '.join(parts)})" if parts else ""
        lines.append(f"`{r.arm}` (spec, vs `{r.baseline}`) changes its replies{where}: {r.why}. "
                     f"Looks like {r.looks_like}.{acc}")
    return lines
