"""`fidelity ab`: golden vs engine numerics, layer by layer, with attribution.

Design of arms (default): golden, the exact-profile noise floor, every optimization alone,
the engine (all optimizations) and the engine minus each. Stage two runs the full
factorial over the few toggles with the largest effects, so Shapley values are exact
there. Everything is computed from one tidy drift table and one per-position KLD table."""
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

from . import ab_plots as plots
from . import analysis as A
from .attribution import attribute, bootstrap_mean_ci
from .lockstep import DEFAULT_TAPS, Arm, LockstepResult, LockstepRunner, Prompt
from .report_io import ReportWriter, df_to_html, df_to_markdown

GOLDEN = "golden"
FLOOR = "floor:exact"              # reference vs exact: the QAT noise floor (verdict, attribution)
FLOOR_ORDER = "floor:fp32-accum"   # fp32 instead of fp64 accumulation: reduction-order noise


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
    taps: tuple[str, ...] = DEFAULT_TAPS
    keep: tuple[str, ...] = ()
    checkpoint: str = "embedded:tiny-random(seed=0)"
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
            else:
                toks = torch.tensor(_haystack_ids(tokenizer, L, (j + 0.5) / per_length * 100,
                                                  seed * 1_000_003 + L * 101 + j))
            out.append(Prompt(f"L{L}-{j}", toks, group=f"L{L}"))
    return out


def _haystack_ids(tokenizer, length: int, depth: float, seed: int) -> list[int]:
    from needle.haystack import HaystackSpec, LocalCounter, PromptFormat, build_prompt
    p = build_prompt(HaystackSpec(), PromptFormat(), LocalCounter(tokenizer), length, depth, seed)
    ids = tokenizer.encode(p.text)
    if len(ids) != length:
        raise ValueError(f"could not build a {length}-token haystack (got {len(ids)})")
    return ids


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
        for drop in base.names:
            arms[f"{settings.base}−{drop}"] = base.without(drop)
    else:
        for text in settings.arms:
            ts = K.ToggleSet.parse(text)
            arms[text if text in ("engine",) or text.startswith("engine") else str(ts)] = ts
    arms.pop(GOLDEN, None)
    return arms, list(base.names)


def _mk_arms(label_sets: dict, profile="reference") -> list[Arm]:
    return [Arm(label, ts.numerics(profile), frozenset(ts.names)) for label, ts in label_sets.items()]


def run_ab(weights, settings: ABSettings, out_dir="reports", run_id: str | None = None,
           progress=print, tokenizer=None) -> dict:
    t_start = time.time()
    cfg = weights.cfg
    prompts = builtin_prompts(cfg, settings.lengths, settings.prompts_per_length, settings.seed,
                              tokenizer)
    label_sets, toggles = design(settings)
    golden = Arm(GOLDEN, Numerics("reference"), frozenset(), role="golden")
    floors = [Arm(FLOOR, Numerics("exact"), frozenset(), role="floor"),
              Arm(FLOOR_ORDER, Numerics("reference", torch.float32), frozenset(), role="floor")]
    arms = [golden] + floors + _mk_arms(label_sets)
    progress(f"stage 1: {len(arms)} arms × {len(prompts)} prompts, mode {settings.mode}")
    res = _run(weights, arms, prompts, settings, progress)

    sets = {a.name: a.toggles for a in arms if a.role == "arm"}
    longest = f"L{max(settings.lengths)}"
    outcomes = A.prompt_outcomes(pd.DataFrame(res.kld), group=longest)
    table = A.outcome_matrix(outcomes, sets, GOLDEN)

    # stage 2: full factorial over the toggles with the largest single or leave-one-out effect
    top = _top_toggles(toggles, table, settings.shapley_top)
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
            extra = _run(weights, [golden] + _mk_arms(new), prompts, settings, progress)
            res.drift += extra.drift
            res.kld += extra.kld
            res.events += extra.events
            sets.update({k: frozenset(v.names) for k, v in new.items()})
            outcomes = A.prompt_outcomes(pd.DataFrame(res.kld), group=longest)
            table = A.outcome_matrix(outcomes, sets, GOLDEN)

    drift = A.with_floor_multiple(pd.DataFrame(res.drift), FLOOR)
    kld = pd.DataFrame(res.kld)
    attr = _attribution(toggles, top, table, settings)
    floor_vals = outcomes[outcomes.arm == FLOOR].sort_values("prompt").kld.to_numpy()
    fmean, flo, fhi = bootstrap_mean_ci(floor_vals, settings.n_boot, settings.seed)
    verdict = A.verdict(attr, fhi, "noise floor (reference vs exact)")
    per_length = _per_length_attr(kld, sets, toggles, settings)
    firsts = [f for a in sets if (f := A.first_divergence(drift, a, FLOOR_ORDER, settings.floor_k))]
    summary = _summary_table(drift, kld, sets)
    manifest = {
        "run_id": run_id, "config": cfg.to_dict(), "config_hash": cfg.config_hash(),
        "checkpoint": settings.checkpoint, "settings": asdict(settings),
        "arms": {k: sorted(v) for k, v in sets.items()}, "golden": GOLDEN, "floor": FLOOR,
        "prompts": [{"id": p.id, "length": p.length, "group": p.group} for p in prompts],
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "numpy": np.__version__, "pandas": pd.__version__},
        "seconds": round(time.time() - t_start, 1),
    }
    result = {"manifest": manifest, "verdict": verdict, "noise_floor": {"mean": fmean, "lo": flo, "hi": fhi},
              "first_divergence": firsts, "events": res.events}
    if out_dir is not None:
        path = write_report(out_dir, run_id or time.strftime("ab-%Y%m%d-%H%M%S"), drift, kld, attr,
                            per_length, summary, result, sets, res)
        result["path"] = str(path)
    result.update(drift=drift, kld=kld, attribution=attr, summary=summary)
    return result


def _run(weights, arms, prompts, settings, progress) -> LockstepResult:
    return LockstepRunner(weights, arms, settings.mode, settings.decode_steps, settings.taps,
                          settings.keep, progress=progress).run(prompts)


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
    for group in sorted(kld.group.unique(), key=lambda g: int(g[1:])):
        t = A.outcome_matrix(A.prompt_outcomes(kld, group=group), sets, GOLDEN)
        for r in attribute(toggles, t, max(200, settings.n_boot // 5), settings.seed):
            if r["method"] != "shapley":
                rows.append({"group": group, **r})
    return pd.DataFrame(rows)


def _summary_table(drift, kld, sets) -> pd.DataFrame:
    """Per arm: final-logit KLD summary (prefill, all buckets) and decode KLD."""
    d = drift[(drift.tap == "logits") & (drift.bucket == "all")]
    rows = []
    for arm in [FLOOR, FLOOR_ORDER] + list(sets):
        p = d[(d.arm == arm) & (d.phase == "prefill")]
        dec = kld[(kld.arm == arm) & (kld.phase == "decode")]
        if p.empty:
            continue
        rows.append({"arm": arm, "kld_mean": p.kld_mean.mean(), "kld_p99": p.kld_p99.mean(),
                     "kld_max": p.kld_max.max(), "same_top1": p.same_top1.mean(),
                     "dp_mean": p.dp_mean.mean(),
                     "decode_kld_mean": dec.kld.mean() if len(dec) else np.nan})
    return pd.DataFrame(rows)


def write_report(out_dir, run_id, drift, kld, attr, per_length, summary, result, sets, res):
    w = ReportWriter(out_dir, run_id)
    try:
        w.table("drift", drift, gzip=True)
        w.table("kld", kld, gzip=True)
        w.table("attribution", attr)
        w.table("attribution_by_length", per_length)
        w.table("summary", summary)
        w.table("events", pd.DataFrame(res.events, columns=["prompt", "arm", "phase", "step", "layer",
                                                            "event", "detail"]))
        w.json("manifest", {"manifest": result["manifest"], "verdict": result["verdict"],
                            "noise_floor": result["noise_floor"],
                            "first_divergence": result["first_divergence"]})
        if res.kept:
            torch.save({"|".join(map(str, k)): v for k, v in res.kept.items()}, w.tmp / "kept_taps.pt")
        arm_names = list(sets)
        singles = [a for a in arm_names if len(sets[a]) == 1]
        fhi = result["noise_floor"]["hi"]
        base = [a for a in arm_names if len(sets[a]) > 1 and not any(sets[a] < sets[b] for b in arm_names)]
        w.figure(plots.drift_vs_layer(drift, FLOOR, [FLOOR, FLOOR_ORDER] + singles + base), "drift_vs_layer",
                 "Drift vs layer", "Relative L2 of the residual stream after each layer vs golden "
                 "(prefill, mean over prompts) for each single toggle and the full arm(s); grey "
                 "band: reference-vs-exact noise floor; other arms are in drift.csv.gz.")
        if singles:
            w.figure(plots.toggle_layer_heatmap(drift, singles), "toggle_layer_heatmap",
                     "Toggle × layer", "log10 relative L2 of each single-toggle arm per layer.")
        if not attr.empty:
            w.figure(plots.attribution_bars(attr, fhi), "attribution", "Attribution of final-logit KLD",
                     "Bars: point estimate; whiskers: 95% bootstrap CI over prompts; red: clears the floor.")
        w.figure(plots.kld_distribution(kld, [FLOOR] + arm_names), "kld_distribution",
                 "KLD distribution per arm", "Per-position KLD(golden ‖ arm) of the final logits, prefill.")
        w.figure(plots.topk_recall_vs_position(drift, [FLOOR, FLOOR_ORDER] + singles + base), "topk_recall",
                 "Indexer top-k recall vs context position", "Fraction of golden's selected compressed "
                 "entries the arm also selects, by query position bucket.")
        w.figure(plots.decode_drift(kld, [FLOOR] + arm_names), "decode_drift", "Decode-step drift",
                 "Teacher-forced decode on golden's greedy tokens.")
        md = _markdown(result, summary, attr)
        w.text("summary.md", md)
        w.html("dsv4-fidelity A/B report", f"<p class='verdict'>{result['verdict']['sentence']}</p>",
               [("Arms", df_to_html(summary)), ("Attribution", df_to_html(attr)),
                ("First divergence", df_to_html(pd.DataFrame(result["first_divergence"]))),
                ("Events", df_to_html(pd.DataFrame(res.events)) if res.events else "<p>none</p>"),
                ("Run", f"<pre>{_manifest_text(result['manifest'])}</pre>")])
        import matplotlib.pyplot as plt
        plt.close("all")
        return w.commit()
    except BaseException:
        w.abort()
        raise


def _manifest_text(m) -> str:
    import json
    return json.dumps({k: v for k, v in m.items() if k != "config"}, indent=1, default=str)


def _markdown(result, summary, attr) -> str:
    m = result["manifest"]
    nf = result["noise_floor"]
    lines = ["# dsv4-fidelity A/B report", "", f"**Verdict.** {result['verdict']['sentence']}", "",
             f"Model config `{m['config_hash']}` ({m['checkpoint']}), mode `{m['settings']['mode']}`, "
             f"{len(m['prompts'])} prompts at lengths {sorted({p['length'] for p in m['prompts']})}, "
             f"{m['settings']['decode_steps']} decode steps, seed {m['settings']['seed']}. "
             f"Noise floor (reference vs exact, mean final-logit KLD at the longest length): "
             f"{nf['mean']:.3g} [{nf['lo']:.3g}, {nf['hi']:.3g}].", "",
             "## Arms", "", df_to_markdown(summary), "", "## Attribution (Δ mean final-logit KLD)", "",
             df_to_markdown(attr), "", "## First divergent layer", "",
             f"First tap, in forward order, where an arm's drift exceeds "
             f"{m['settings']['floor_k']}× the reduction-order floor ({FLOOR_ORDER}: the same "
             f"reference numerics with fp32 instead of fp64 accumulation).", ""]
    fd = result["first_divergence"]
    lines += [df_to_markdown(pd.DataFrame(fd)) if fd else "No arm exceeds the floor anywhere.", ""]
    if result["events"]:
        lines += ["## Events", "", df_to_markdown(pd.DataFrame(result["events"])), ""]
    lines += ["Plots and full tables: `index.html`, `*.png`, `drift.csv.gz`, `kld.csv.gz`, `attribution.csv`.", ""]
    return "\n".join(lines)
