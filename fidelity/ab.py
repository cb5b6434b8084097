"""`fidelity ab`: golden vs engine numerics, layer by layer, with attribution.

Design of arms (default): golden, three noise floors (QAT: reference vs exact; reduction
order: fp32 vs fp64 accumulation; indexer tie order: top-k ties broken towards the higher
index), every optimization alone, the engine (all optimizations) and the engine minus
each. Stage two runs the full factorial over the few toggles with the largest effects, so
Shapley values are exact there. The verdict reads several signals (fidelity/signals.py),
each against its own floors. Everything is computed from tidy tables."""
from __future__ import annotations

import itertools
import platform
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import pandas as pd
import torch

from reference_model import Numerics

from . import analysis as A
from . import signals as S
from .attribution import attribute, bootstrap_mean_ci
from .lockstep import DEFAULT_TAPS, Arm, LockstepResult, LockstepRunner, Prompt
from .ab_report import write_report

GOLDEN = "golden"
FLOOR = "floor:exact"              # reference vs exact: the QAT noise floor (verdict, attribution)
FLOOR_ORDER = "floor:fp32-accum"   # fp32 instead of fp64 accumulation: reduction-order noise
FLOOR_TIES = "floor:tie-order"     # indexer top-k ties broken the other way (torch.topk leaves it open)
FLOORS = (FLOOR, FLOOR_ORDER, FLOOR_TIES)
LONG_LENGTHS = (250, 511, 2047)    # --long: 2047 tokens = 511 CSA entries = 32x the tiny index_topk


@dataclass
class ABSettings:
    arms: list[str] | None = None          # extra/explicit arms (ToggleSet syntax); None = default design
    base: str = "engine"                   # arm whose leave-one-out is computed
    mode: str = "propagated"
    lengths: tuple[int, ...] = (250, 511)     # residues 2 and 3 mod 4: partial compressor groups
    prompts_per_length: int = 3
    decode_steps: int = 4
    seed: int = 0
    shapley_top: int = 3                   # factorial stage over this many toggles (0 = off)
    n_boot: int = 1000
    floor_k: float = 2.0
    vs: str | None = None                  # first divergence also against this arm
    taps: tuple[str, ...] = DEFAULT_TAPS
    keep: tuple[str, ...] = ()
    checkpoint: str = "embedded:tiny-random(seed=0)"
    prompts_file: str | None = None        # the user's prompts (JSONL) instead of the built-in ones
    devices: tuple[str, ...] = ("cpu",)    # layers placed across these (fidelity.devices)
    accumulate: str = "float64"            # golden's accumulation dtype (torch dtype name)
    activation_budget: int | None = None   # bytes of residual streams kept in memory per pass
    weights_variants: tuple = ()           # ((name, label), ...): other checkpoints as arms
    command_line: str = field(default_factory=lambda: " ".join(sys.argv))


def builtin_prompts(cfg, lengths, per_length: int, seed: int, tokenizer=None) -> list[Prompt]:
    """Deterministic prompts at each length. With a tokenizer: needle haystacks (the task
    the embedded model was trained on) of exactly that many tokens, needle depths spread
    over the context; without one (an untrained model): random token ids. Lengths should
    include ones where compressed entries exceed index_topk (length/4 > index_topk)."""
    out = []
    for L in lengths:
        for j in range(per_length):
            if tokenizer is None:
                g = torch.Generator().manual_seed(seed * 1_000_003 + L * 101 + j)
                toks = torch.randint(2, cfg.vocab_size, (L,), generator=g)
                needle = ()
            else:
                ids, needle = haystack_ids(tokenizer, L, (j + 0.5) / per_length * 100,
                                            seed * 1_000_003 + L * 101 + j)
                toks = torch.tensor(ids)
            out.append(Prompt(f"L{L}-{j}", toks, group=f"L{L}", needle_tokens=needle))
    return out


def _all_token_ids(path) -> bool:
    import json
    from pathlib import Path
    return all("token_ids" in json.loads(x) for x in Path(path).read_text().splitlines() if x.strip())


def haystack_ids(tokenizer, length: int, depth: float, seed: int) -> tuple[list[int], tuple[int, ...]]:
    """Token ids of an exact-length haystack and the positions of the needle value's tokens."""
    from needle.haystack import (HaystackSpec, LocalCounter, PromptFormat, build_prompt,
                                 value_token_positions)
    p = build_prompt(HaystackSpec(), PromptFormat(), LocalCounter(tokenizer), length, depth, seed)
    ids, offsets = tokenizer.encode_with_offsets(p.text)
    if len(ids) != length:
        raise ValueError(f"could not build a {length}-token haystack (got {len(ids)})")
    return ids, tuple(value_token_positions(offsets, p.value_spans))


def _toggle_api():
    from kernel_toggles import arms as K
    return K


def design(settings: ABSettings) -> tuple[dict[str, object], list[str]]:
    """Arm label -> ToggleSet, and the toggle names attribution ranges over."""
    K = _toggle_api()
    base = K.ToggleSet.parse(settings.base)
    arms: dict[str, object] = {}
    if settings.arms is None:
        for s in K.one_at_a_time(base):
            arms[str(s)] = s
        arms[settings.base] = base
        named_base = K.is_engine_spelling(settings.base)
        for drop in base.names:               # ASCII names that parse back: engine-x
            arms[f"{settings.base}-{drop}" if named_base else str(base.without(drop))] = base.without(drop)
    else:
        for text in settings.arms:
            ts = K.ToggleSet.parse(text)
            arms[text if text in ("engine",) or text.startswith("engine") else str(ts)] = ts
    arms.pop(GOLDEN, None)
    singles = [n for ts in arms.values() if len(ts) == 1 for n in ts.names]
    return arms, list(dict.fromkeys([*base.names, *singles]))


def _mk_arms(label_sets: dict, cd=torch.float64) -> list[Arm]:
    return [Arm(label, ts.numerics("reference", compute_dtype=cd), frozenset(ts.names))
            for label, ts in label_sets.items()]


def floor_arms(cd=torch.float64) -> list[Arm]:
    """The three noise floors (see the module docstring); `cd` is golden's accumulation
    dtype (the tie-order floor uses it too, so it measures only the tie order)."""
    from reference_model.numerics import topk_highest_index_ties
    ties = Numerics("reference", cd).with_kernels(
        "tie-order", index_topk=lambda golden, scores, k: topk_highest_index_ties(scores, k))
    return [Arm(FLOOR, Numerics("exact"), frozenset(), role="floor"),
            Arm(FLOOR_ORDER, Numerics("reference", torch.float32), frozenset(), role="floor"),
            Arm(FLOOR_TIES, ties, frozenset(), role="floor")]


def _pairs(settings, label_sets) -> dict[str, str]:
    """Arms compared directly with the --vs arm: those that contain all its toggles."""
    if not settings.vs or settings.vs == GOLDEN:
        return {}
    if settings.vs not in label_sets:
        raise ValueError(f"--vs {settings.vs!r} is not one of the arms: {', '.join(label_sets)}")
    ref = frozenset(label_sets[settings.vs].names)
    return {a: settings.vs for a, ts in label_sets.items()
            if a != settings.vs and frozenset(ts.names) > ref}


WEIGHTS_PREFIX = "weights:"


def run_ab(weights, settings: ABSettings, out_dir="reports", run_id: str | None = None,
           progress=print, tokenizer=None, variants: dict | None = None) -> dict:
    """`variants`: {name: WeightSource} of other checkpoints of the same architecture; each
    becomes an arm `weights:<name>` (golden numerics on those weights), so drift and KLD
    are attributed to the checkpoint as well as to the numerics toggles."""
    t_start = time.time()
    cfg = weights.cfg
    if settings.prompts_file:
        from .prompt_sets import file_prompts
        if tokenizer is None and not _all_token_ids(settings.prompts_file):
            raise ValueError("--prompts with text or messages needs a tokenizer")
        prompts = file_prompts(settings.prompts_file, tokenizer, cfg.vocab_size, group="file")
        longest = "file"
    else:
        prompts = builtin_prompts(cfg, settings.lengths, settings.prompts_per_length, settings.seed,
                                  tokenizer)
        longest = f"L{max(settings.lengths)}"
    label_sets, toggles = design(settings)
    pairs = _pairs(settings, label_sets)
    cd = getattr(torch, settings.accumulate)
    golden = Arm(GOLDEN, Numerics("reference", cd), frozenset(), role="golden")
    weight_arms = [Arm(WEIGHTS_PREFIX + n, Numerics("reference", cd), frozenset({WEIGHTS_PREFIX + n}),
                       weights=w) for n, w in (variants or {}).items()]
    toggles = toggles + [a.name for a in weight_arms]
    arms = [golden] + floor_arms(cd) + _mk_arms(label_sets, cd) + weight_arms
    progress(f"stage 1: {len(arms)} arms × {len(prompts)} prompts, mode {settings.mode}")
    res = _run(weights, arms, prompts, settings, progress, pairs)

    sets = {a.name: a.toggles for a in arms if a.role == "arm"}
    outcomes = A.prompt_outcomes(pd.DataFrame(res.kld), group=longest)
    table = A.outcome_matrix(outcomes, sets, GOLDEN)

    # stage 2: full factorial over the toggles with the largest single or leave-one-out effect
    top = _top_toggles([t for t in toggles if not t.startswith(WEIGHTS_PREFIX)], table,
                       settings.shapley_top)
    if len(top) >= 2:
        K = _toggle_api()
        new = {}
        for r in range(2, len(top) + 1):
            for combo in itertools.combinations(top, r):
                s = frozenset(combo)
                if s not in table and s not in {frozenset(v) for v in sets.values()}:
                    ts = K.ToggleSet(combo)
                    new[str(ts)] = ts
        if new:
            progress(f"stage 2: factorial over {', '.join(top)} ({len(new)} more arms)")
            extra = _run(weights, [golden] + _mk_arms(new, cd), prompts, settings, progress)
            extra.needle = [r for r in extra.needle if r["arm"] != GOLDEN]   # already in stage 1
            res.extend(extra)
            sets.update({k: frozenset(v.names) for k, v in new.items()})
            outcomes = A.prompt_outcomes(pd.DataFrame(res.kld), group=longest)
            table = A.outcome_matrix(outcomes, sets, GOLDEN)

    drift = A.with_floor_multiple(pd.DataFrame(res.drift), FLOOR)
    kld = pd.DataFrame(res.kld)
    attr = _attribution(toggles, top, table, settings)
    floor_vals = outcomes[outcomes.arm == FLOOR].sort_values("prompt").kld.to_numpy()
    fmean, flo, fhi = bootstrap_mean_ci(floor_vals, settings.n_boot, settings.seed)
    needle = pd.DataFrame(res.needle)
    groups = {p.id: p.group for p in prompts}
    sig = S.with_longest(S.prompt_signals(drift, kld, needle, cfg.window_size), groups, longest)
    sig_summary = S.signal_summary(sig, settings.n_boot, settings.seed)
    floors = S.floor_levels(sig_summary, list(FLOORS))
    base_set = frozenset(_toggle_api().ToggleSet.parse(settings.base).names)
    sig_attr = S.attribute_signals(sig, sets, toggles, GOLDEN, settings.n_boot, settings.seed, base_set)
    pair_df, pair_kld = pd.DataFrame(res.pairs), pd.DataFrame(res.pair_kld)
    if len(pair_kld):
        pair_sig = S.with_longest(S.prompt_signals(pair_df, pair_kld, None, cfg.window_size),
                                  groups, longest)
        vs_set = frozenset(label_sets[settings.vs].names)
        sig_attr = pd.concat([sig_attr, S.direct_effects(pair_sig, sets, vs_set, settings.n_boot,
                                                         settings.seed)], ignore_index=True)
    verdict, verdict_table = S.verdict(sig_attr, floors, len(prompts))
    per_length = _per_length_attr(kld, sets, toggles, settings)
    firsts = _first_divergences(drift, pair_df, sets, pairs, settings.floor_k)
    summary = _summary_table(drift, kld, sig_summary, sets)
    manifest = {
        "run_id": run_id, "config": cfg.to_dict(), "config_hash": cfg.config_hash(),
        "checkpoint": settings.checkpoint, "settings": asdict(settings),
        "arms": {k: sorted(v) for k, v in sets.items()}, "golden": GOLDEN, "floor": FLOOR,
        "floors": list(FLOORS), "vs": settings.vs,
        "prompts": [{"id": p.id, "length": p.length, "group": p.group} for p in prompts],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "numpy": np.__version__, "pandas": pd.__version__},
        "seconds": round(time.time() - t_start, 1),
    }
    result = {"manifest": manifest, "verdict": verdict, "noise_floor": {"mean": fmean, "lo": flo, "hi": fhi},
              "floors": floors.to_dict("records"), "first_divergence": firsts, "events": res.events}
    tables = {"drift": drift, "kld": kld, "attribution": attr, "attribution_by_length": per_length,
              "summary": summary, "signals": sig, "signal_summary": sig_summary,
              "signal_attribution": verdict_table, "pairs": pair_df, "needle": needle}
    if out_dir is not None:
        path = write_report(out_dir, run_id or time.strftime("ab-%Y%m%d-%H%M%S"), tables, result,
                            sets, res)
        result["path"] = str(path)
    result.update(tables)
    return result


def _run(weights, arms, prompts, settings, progress, pairs=None) -> LockstepResult:
    return LockstepRunner(weights, arms, settings.mode, settings.decode_steps, settings.taps,
                          settings.keep, progress=progress, pairs=pairs,
                          activation_budget=settings.activation_budget,
                          devices=list(settings.devices) if settings.devices != ("cpu",) else None
                          ).run(prompts)


def _first_divergences(drift, pair_df, sets, pairs, k) -> list[dict]:
    """Per arm: first divergence from golden and, for arms with a --vs arm, from it; both
    thresholds are k × the reduction-order floor."""
    out = []
    for a in sets:
        for vs in (None, pairs.get(a)) if a in pairs else (None,):
            f = A.first_divergence(drift, a, FLOOR_ORDER, k, pair_df, vs)
            if f:
                out.append(f)
    return out


def _top_toggles(toggles, table, m):
    if m <= 0:
        return []
    eff = {}
    full = frozenset(toggles)
    for t in toggles:
        vals = []
        if frozenset({t}) in table:
            vals.append(abs(table[frozenset({t})].mean()))
        if full in table and full - {t} in table:
            vals.append(abs(table[full].mean() - table[full - {t}].mean()))
        if vals:
            eff[t] = max(vals)
    return sorted(eff, key=lambda t: -eff[t])[: min(m, 6)]


def _attribution(toggles, top, table, settings) -> pd.DataFrame:
    rows = [r for r in attribute(toggles, table, settings.n_boot, settings.seed)
            if r["method"] != "shapley" or len(toggles) <= 6]
    if len(top) >= 2:
        sub = {k: v for k, v in table.items() if k <= frozenset(top)}
        rows += [r for r in attribute(top, sub, settings.n_boot, settings.seed) if r["method"] == "shapley"]
    return pd.DataFrame(rows, columns=["toggle", "method", "value", "lo", "hi"])


def _per_length_attr(kld, sets, toggles, settings) -> pd.DataFrame:
    rows = []
    for group in sorted(kld.group.unique(), key=lambda g: int(g[1:]) if g[1:].isdigit() else 0):
        t = A.outcome_matrix(A.prompt_outcomes(kld, group=group), sets, GOLDEN)
        for r in attribute(toggles, t, max(200, settings.n_boot // 5), settings.seed):
            if r["method"] != "shapley":
                rows.append({"group": group, **r})
    return pd.DataFrame(rows)


def _summary_table(drift, kld, sig_summary, sets) -> pd.DataFrame:
    """Per arm: final-logit KLD summary (prefill, all buckets), decode KLD, and the worst
    place of each verdict signal (answer KLD, top-k recall, needle entry, experts)."""
    d = drift[(drift.tap == "logits") & (drift.bucket == "all")]
    rows = []
    for arm in list(FLOORS) + list(sets):
        p = d[(d.arm == arm) & (d.phase == "prefill")]
        dec = kld[(kld.arm == arm) & (kld.phase == "decode")]
        if p.empty:
            continue
        ss = sig_summary[sig_summary.arm == arm].groupby("signal")["mean"].max()
        rows.append({"arm": arm, "kld_mean": p.kld_mean.mean(), "kld_p99": p.kld_p99.mean(),
                     "kld_max": p.kld_max.max(), "same_top1": p.same_top1.mean(),
                     "dp_mean": p.dp_mean.mean(),
                     "decode_kld_mean": dec.kld.mean() if len(dec) else np.nan,
                     "answer_kld": ss.get("answer_kld", np.nan),
                     "late_kld_excess": ss.get("late_kld_excess", np.nan),
                     "topk_recall_min": 1 - ss.get("topk_loss", np.nan),
                     "needle_lost_max": ss.get("needle_lost", np.nan),
                     "expert_same_min": 1 - ss.get("expert_disagree", np.nan)})
    return pd.DataFrame(rows)
