"""The spec family's one judgement per arm (speculation on vs the baseline without it).

Flagged when
* greedy: the baseline's floor (asked twice) is exact and some speculative reply is not
  bit-identical to the baseline's -- tokens or reported logprobs; on a baseline that is not
  exact, when replies part in tokens on more probes than the floor's do;
* sampled: how often the samples take their step's top-1 token, or how often two samples
  agree, differs from the baseline's (two-sided permutation tests over the arm labels,
  Bonferroni over the two, p < ALPHA): a lossless speculative sampler draws from the same
  distribution, whatever its seeds give;
* a speculative greedy reply parts from the baseline's with a special token.
Each flagged arm gets its first diverging step and what the signature looks like
(`_looks_like`): differences from the first verified row on are the verify's arithmetic;
later ones state carried across a verify (the rollback); only the sampled distribution
moving is a verifier that does not sample."""
from __future__ import annotations

import itertools

import numpy as np
import pandas as pd

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


def _accept(greedy: pd.DataFrame) -> tuple[float | None, list[float] | None]:
    """Mean accepted tokens per verify + 1 and the acceptance rate per draft position, from
    the engine's spec_* counts (None where it reports none)."""
    metas = [m for m in greedy.get("spec_meta", []) if isinstance(m, dict) and m.get("spec_verify_ct")]
    if not metas:
        return None, None
    length = float(np.mean([m.get("spec_accept_length", np.nan) for m in metas]))
    per = [m.get("spec_accepted_per_position") for m in metas]
    if not all(isinstance(p, list) for p in per):
        return length, None
    verifies = sum(m["spec_verify_ct"] for m in metas)
    return length, [float(x) / verifies for x in np.sum(np.array(per, dtype=float), 0)]


def _looks_like(greedy_flag: bool, sampled_flag: bool, first_lp_step, injected: int) -> str:
    """The signature in words. A special token where the replies part is a row read wrongly
    after a verify, whatever the numerics did before. Otherwise: step 0 comes from the
    prefill; step 1 from the first verify's first row, computed on the prefill's state: a
    difference there is the verify's own arithmetic (nothing was rolled back yet). A first
    difference later is state carried across a verify -- or a verify whose first rows
    happened to round alike."""
    if injected:
        return ("a special token injected where the replies part: a logits row read corrupt after a "
                "verify (antirez/ds4 #750 class: with draft >= 2, a rollback without snapshot emitted BOS)")
    if greedy_flag:
        if first_lp_step is not None and first_lp_step <= 1:
            return "a verify step whose numerics differ from a decode step's: not batch-exact (antirez/ds4 #750 class)"
        return "state carried wrongly across a verify: the rollback of the window / compressor " \
               "(GDzhu01/vllm-ascend-deepseekv4 #131 class)"
    if sampled_flag:
        return "a verifier that does not sample as the request asks (sglang #39253 class)"
    return ""


def spec_table(rows: pd.DataFrame) -> pd.DataFrame:
    cols = ["arm", "baseline", "probes", "greedy_bitwise", "greedy_diverged", "first_step",
            "first_lp_step", "kl_first", "kl_max", "floor", "seed_identical", "samples",
            "sampled_first_step", "agree_spec", "agree_base", "top1_spec", "top1_base",
            "p_distribution", "injected",
            "accept_length", "accept_per_position", "flagged", "looks_like", "why"]
    if rows.empty or "family" not in rows:
        return pd.DataFrame(columns=cols)
    out = []
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
        sampled_flag = p < ALPHA
        length, per = _accept(gr)
        flagged = bool(greedy_flag or sampled_flag or n_inj)
        why = []
        if greedy_flag:
            why.append(f"greedy replies differ from the baseline's in {len(gr) - bitwise}/{len(gr)} probes"
                       + (" (the baseline's own floor is exact)" if exact_floor else ""))
        if sampled_flag:
            why.append(f"sampled replies take the top-1 token {dg:+.2f} more often than the baseline's and "
                       f"agree with each other {d:+.2f} more (p = {p:.2g})")
        if n_inj:
            why.append(f"{n_inj} special token(s) injected")
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
                    "p_distribution": p, "injected": n_inj, "accept_length": length,
                    "accept_per_position": None if per is None else " / ".join(f"{x:.2f}" for x in per),
                    "flagged": flagged,
                    "looks_like": _looks_like(greedy_flag, sampled_flag,
                                              int(lp.min()) if lp.notna().any() else None, n_inj),
                    "why": "; ".join(why) or "lossless"})
    return pd.DataFrame(out, columns=cols)


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
        step = r.first_lp_step if pd.notna(r.first_lp_step) else r.sampled_first_step
        where = f" from generated step {int(step)}" if step is not None and pd.notna(step) else ""
        tok = (f"; greedy tokens part from step {int(r.first_step)}" if r.first_step is not None
               and pd.notna(r.first_step) else "")
        lines.append(f"`{r.arm}` (spec, vs `{r.baseline}`) changes its replies{where}{tok}: {r.why}. "
                     f"Looks like {r.looks_like}.{acc}")
    return lines
