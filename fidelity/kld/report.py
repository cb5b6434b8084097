"""The `fidelity kld` / `fidelity engines` report, in `fidelity ab`'s format: a verdict
sentence, llama.cpp-style KLD statistics per arm and context-position bucket (KL lower
bound with the baseline mass it did not cover, same top-1, Δp of the actual next token,
quantiles, bootstrap CIs over prompts), the decode ladder, captures, floors, attribution,
selection margins of the needle entry (fidelity.kld.margins), plots and the run's
manifest (each arm's own view of itself included)."""
from __future__ import annotations

import shlex

import numpy as np
import pandas as pd

import matplotlib.pyplot as plt

from fidelity.verdict.attribution import bootstrap_mean_ci
from fidelity.verdict.board import SUSPECTS_CAPTION, named_suspects, signal_board, suspects
from fidelity.verdict.findings import findings_table, verdict_lines
from fidelity.verdict.judge import golden_follows
from infra.report_page import Page, Section, Table
from infra.report_writer import ReportWriter

from .health import incomplete
from .margins import margin_summary
from .settings import KldSettings
from .twin import verdict_headline

BUCKET0 = 128                   # position buckets [0,128), [128,512), [512,2048), ...
EXACT_BELOW = 1e-9               # baseline mass left uncovered below which a position's KL is exact


def _bucket(pos: pd.Series) -> pd.Series:
    edges = [0, BUCKET0]
    while edges[-1] <= int(pos.max()):
        edges.append(edges[-1] * 4)
    labels = [f"[{a},{b})" for a, b in zip(edges[:-1], edges[1:])]
    return pd.cut(pos, edges, right=False, labels=labels).astype(str)


def kld_table(pos: pd.DataFrame, s: KldSettings) -> pd.DataFrame:
    """Per arm and position bucket (and 'all'): llama.cpp's statistics over prefill
    positions; the mean's CI is a bootstrap over prompts (each prompt's mean)."""
    pre = pos[pos.phase == "prefill"].copy()
    pre["bucket"] = _bucket(pre.position)
    rows = []
    for bucket in ["all"] + sorted(pre.bucket.unique(), key=lambda b: int(b[1:].split(",")[0])):
        d = pre if bucket == "all" else pre[pre.bucket == bucket]
        for arm, g in d.groupby("arm", sort=False):
            per_prompt = g.groupby("prompt").kl_lb.mean().to_numpy()
            m, lo, hi = bootstrap_mean_ci(per_prompt, s.n_boot, s.seed)
            dp = g.dp.dropna().astype(float)
            rows.append({"arm": arm, "bucket": bucket, "positions": len(g), "kld_mean": m,
                         "kld_lo": lo, "kld_hi": hi, "kld_median": g.kl_lb.median(),
                         "kld_p99": g.kl_lb.quantile(0.99), "kld_max": g.kl_lb.max(),
                         "uncovered_mean": g.uncovered_p.mean(), "uncovered_max": g.uncovered_p.max(),
                         "same_top1": g.same_top1.astype(float).mean(),
                         "dp_mean": dp.mean(), "dp_rms": float(np.sqrt((dp ** 2).mean())),
                         "dp_maxabs": dp.abs().max(), "rkl_mean": g.rkl_lb.mean()})
    return pd.DataFrame(rows)


def ladder_table(pos: pd.DataFrame, ladder: pd.DataFrame) -> pd.DataFrame:
    dec = pos[pos.phase == "decode"]
    rows = []
    for arm, g in ladder.groupby("arm", sort=False):
        fd = g.first_divergence
        k = dec[dec.arm == arm].groupby("step").kl_lb.mean()
        rows.append({"arm": arm, "prompts": len(g), "diverged": float(fd.notna().mean()),
                     "first_divergence_median": fd.median() if fd.notna().any() else np.nan,
                     "ladder_kld_mean": dec[dec.arm == arm].kl_lb.mean(),
                     "ladder_kld_by_step": " ".join(f"{v:.3g}" for v in k.to_numpy())})
    return pd.DataFrame(rows)


def _position_plot(pos: pd.DataFrame):
    pre = pos[pos.phase == "prefill"].copy()
    pre["bucket"] = _bucket(pre.position)
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for arm, g in pre.groupby("arm", sort=False):
        m = g.groupby("bucket").kl_lb.mean()
        order = sorted(m.index, key=lambda b: int(b[1:].split(",")[0]))
        ax.plot(order, np.maximum(m[order].to_numpy(), 1e-12), marker="o", label=arm)
    ax.set_yscale("log")
    ax.set_xlabel("context position")
    ax.set_ylabel("mean KL(baseline ‖ arm), lower bound")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _ladder_plot(pos: pd.DataFrame):
    dec = pos[pos.phase.isin(["decode"])]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for arm, g in dec.groupby("arm", sort=False):
        m = g.groupby("step").kl_lb.mean()
        ax.plot(m.index, np.maximum(m.to_numpy(), 1e-12), marker=".", label=arm)
    ax.set_yscale("log")
    ax.set_xlabel("greedy decode step (while both arms' tokens agree)")
    ax.set_ylabel("mean KL lower bound")
    if len(dec):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def write(out_dir, run_id: str, tables: dict, judged: dict, manifest: dict, arms: list[str],
          latest: bool = True):
    w = ReportWriter(out_dir, run_id)
    try:
        kt = kld_table(tables["positions"], KldSettings(**manifest["settings"]))
        lt = ladder_table(tables["positions"], tables["ladder"])
        for name in ("positions", "signals"):
            w.table(name, tables[name], gzip=True)
        for name in ("ladder", "captures"):
            w.table(name, tables[name])
        if len(tables.get("coverage", ())):
            w.table("capture_coverage", tables["coverage"])
        ms = margin_summary(tables.get("margins"))
        if len(ms):
            w.table("margins", tables["margins"])
            w.table("margin_summary", ms)
        w.table("kld_by_position", kt)
        w.table("ladder_summary", lt)
        w.table("signal_summary", judged["summary"])
        w.table("signal_attribution", judged["attribution"])
        w.json("manifest", {"manifest": manifest, "verdict": judged["verdict"],
                            "floors": judged["floors"].to_dict("records")})
        w.figure(_position_plot(tables["positions"]), "kld_vs_position", "KL vs context position",
                 "Mean over prompts of KL(baseline ‖ arm) per position bucket; a lower bound from "
                 "each side's top-k (exact where the uncovered baseline mass is 0).")
        w.figure(_ladder_plot(tables["positions"]), "decode_ladder", "Decode ladder",
                 "KL per greedy decode step, up to the step where the arm's greedy token departs.")
        if len(judged["summary"]):
            floors = {a["name"] for a in manifest.get("arms", []) if a.get("role") == "floor"}
            w.figure(signal_board(judged["summary"], judged["attribution"], arms, floors), "signals",
                     "Signals vs their floors", "Each arm's mean of each signal over the highest "
                     "floor's upper 95% bound: white within it, red by how far above (log scale); the floors' "
                     "own rows in grey, hatched no data.")
        by_res = residues(tables["signals"], manifest)
        if by_res is not None:
            w.table("residues", by_res[0])
        pos = tables["positions"]
        covered = bool(len(pos)) and bool((pos.uncovered_p.fillna(1.0) < EXACT_BELOW).all())
        w.page(build_page(manifest, judged, kt, lt, tables.get("coverage"), ms, by_res, covered))
        plt.close("all")
        return w.commit(latest)
    except BaseException:
        w.abort()
        raise


def _incomplete_lines(cov) -> list[str]:
    """Capture signals computed on fewer prompts than the run has: said in the verdict,
    never left for the reader to notice in a table."""
    if cov is None or not len(cov):
        return []
    return [f"**Incomplete:** `{r.arm}` {r.captures} ({r.signals}) on {r.prompts} of {r['of']} prompts"
            + (f": {r.missing_because}" if r.missing_because else "") for _, r in incomplete(cov).iterrows()]


def _retry_lines(m) -> list[str]:
    return [f"- `{a}`: {v['total']} (" + ", ".join(f"{r} {n}" for r, n in v["routes"].items()) + ")"
            for a, v in (m.get("retries") or {}).items()]


def _arm_flag(a: dict) -> str | None:
    """How `fidelity kld` would be told about this arm again: its URL, else its arm spelling
    (in-process, or the toggles an engines spec gave a stand-in); None for a live engine
    that is not running now (no URL kept)."""
    if a.get("url"):
        return f"--endpoint {shlex.quote(a['name'] + '=' + a['url'])}"
    spelling = a.get("arm") or a.get("toggles")
    if spelling is None and "spec" in a:
        return None
    return f"--arm {shlex.quote(a['name'] + '=' + str(spelling or a['name']))}"


def _next_steps(m: dict, sus: pd.DataFrame, covered: bool = False) -> list[str]:
    """Commands spelled as the CLI parses them (tests/test_report_pages.py parses each); no
    --exact rerun when the KL is already exact everywhere (`covered`)."""
    s = m["settings"]
    arms = {a["name"]: a for a in m["arms"]}
    base = arms.get(m["baseline"])
    if base is None:
        return []
    out = []
    others = [a for n, a in arms.items() if n != m["baseline"] and a.get("role", "arm") not in ("floor", "twin")]
    if not s.get("exact") and not covered and others:
        flags = [_arm_flag({**a, "spec": m["spec"]} if "spec" in m else a) for a in [base] + others]
        if None not in flags:
            out.append(f"fidelity kld {' '.join(flags)} --exact   # exact KL instead of a top-{s['k']} lower bound")
        else:
            out.append(f"fidelity engines run {shlex.quote(m['spec'])} --fresh   # with exact = true under "
                       f"[run.kld]: exact KL instead of a top-{s['k']} lower bound")
    named = named_suspects(sus)
    for _, r in named.head(2).iterrows():
        a = arms.get(r.toggle)
        if a is not None and a.get("url"):
            q = shlex.quote
            out.append(f"fidelity needle --endpoint {q(m['baseline'] + '=' + base.get('url', ''))} "
                       f"--endpoint {q(a['name'] + '=' + a['url'])}   # does {a['name']} cost recall?"
                       if base.get("url") else
                       f"fidelity needle --arm golden=golden --endpoint {q(a['name'] + '=' + a['url'])}"
                       f"   # does {a['name']} cost recall?")
    return out


def _readings(m: dict) -> str:
    """How arms whose prompt positions were not read from one prefill were read (llama.cpp:
    teacher-forced prefixes through its decode path), so no one reads them as prefill."""
    lines = [f" Arm `{a['name']}`: {a['reading']}." for a in m["arms"] if a.get("reading")]
    return "".join(lines)


def residues(signals: pd.DataFrame, m: dict) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """Answer KLD per arm and length residue (fidelity.verdict.residues) and each length's
    boundary, when the manifest says the model's boundaries (runs before it did not)."""
    if not m.get("boundaries"):
        return None
    from ..design.lengths import Boundaries
    from ..verdict.residues import grid_frame, residue_table
    b = Boundaries.from_dict(m["boundaries"])
    lengths = {p["id"]: p["length"] for p in m["prompts"]}
    roles = {a["name"]: a["role"] for a in m["arms"]}
    return (residue_table(signals, lengths, [a for a, r in roles.items() if r == "arm"],
                          [a for a, r in roles.items() if r == "floor"], b),
            grid_frame(lengths.values(), b))


def build_page(m: dict, judged: dict, kt: pd.DataFrame, lt: pd.DataFrame, cov,
               margins: pd.DataFrame | None = None, by_residue=None, covered: bool = False) -> Page:
    """The page; `covered`: every position's KL is already exact (no baseline mass uncovered,
    e.g. top-512 of a 512-token vocabulary), so no --exact rerun is suggested."""
    s = m["settings"]
    others = [a["name"] for a in m["arms"] if a["name"] != m["baseline"]]
    compared = (f"Baseline `{m['baseline']}` vs {', '.join(f'`{a}`' for a in others)} on "
                f"{len(m['prompts'])} prompts: top-{s['k']} logprobs per position"
                f"{' + the baseline’s own top ids (exact mode)' if s['exact'] else ''}, "
                f"{s['steps']}-step greedy decode ladder. KL values are lower bounds; `uncovered` is the "
                "baseline mass outside the ids both sides reported (0 = exact)." + golden_follows(m))
    sus = suspects(judged["attribution"])
    named = pd.DataFrame(judged["verdict"].get("named", []))
    allk = kt[kt.bucket == "all"].reset_index(drop=True)
    sections = [
        Section("KLD vs baseline (all positions)", "llama.cpp's statistics over the prompt's positions; "
                "the mean's interval is a bootstrap over prompts." + _readings(m),
                [Table(allk, fold=False)], ["decode_ladder"]),
        Section("By context position", "", [Table(kt[kt.bucket != "all"].reset_index(drop=True),
                                                  summary="per arm and position bucket")]),
        Section("Decode ladder", "", [Table(lt)]),
        Section("Outcome: named by the verdict", "", [Table(named)]),
        Section("Mechanism: what the arms change inside", "Capture signals (indexer picks, expert "
                "sets) judged against the floors; the needle's indexer entry counted over prompts × "
                "layers and tested exactly.", [Table(findings_table(judged["verdict"].get("mechanism", [])))]),
        Section("Floors per signal", "Upper 95% bound of the highest floor, per signal and place.",
                [Table(judged["floors"])]),
    ]
    if by_residue is not None:
        from ..verdict.residues import CAPTION, GRID_CAPTION
        sections.insert(4, Section("By length residue", CAPTION, [
            Table(by_residue[0]), Table(by_residue[1], caption=GRID_CAPTION)]))
    if margins is not None and len(margins):
        sections.append(Section(
            "Selection margins", f"At the last prompt position, per CSA layer: the baseline "
            f"`{m['baseline']}`'s margin of the needle's compressed entry to the top-k boundary "
            "(its own indexer scores; prompts with a needle), the arm's implied score "
            "perturbation ε from its picks alone (a dropped pick outscoring an added one by d "
            "needs a max-norm score change ≥ d/2: a lower bound, 0 when the picks agree) and "
            "the share of prompts whose |margin| < 2ε (fragile). Not a verdict signal; per "
            "prompt in `margins.csv`.", [Table(margins)]))
    if judged["verdict"].get("twins"):
        sections.insert(0, _twin_section(judged["verdict"]))
    if m.get("twin"):
        t = m["twin"]
        sections.insert(0, Section("The twin", f"`{m['baseline']}` is `{t['arm']}`, the in-process arm "
                                   f"{', '.join(t['of'])}'s settings map to ({t['source']}). Floors: the "
                                   "twin's own reduction- and tie-order variants and each engine scored "
                                   f"again against itself (`~repeat`). The judgement against the golden: "
                                   f"[{t['report_of']}](../{t['report_of']}/index.html)."))
    retries = _retry_lines(m)
    sections.append(Section("Requests retried", "\n".join(retries) if retries else "None."))
    if cov is not None and len(cov):
        sections.append(Section("Capture coverage", "Prompts each capture signal was computed on "
                                "(baseline and arm both captured).",
                                [Table(cov.drop(columns=["missing_because"]).reset_index(drop=True))]))
    sections.append(Section("Arms", "", [Table(pd.DataFrame(m["arms"]))]))
    lead = ["signals", "kld_vs_position"] if len(judged["summary"]) else ["kld_vs_position"]
    return Page("dsv4-fidelity KLD report", compared,
                [*(t["sentence"] for t in judged["verdict"].get("twins", [])),
                 *(t["by_design"] for t in judged["verdict"].get("twins", [])),
                 *verdict_lines(judged["verdict"]), *_incomplete_lines(cov)],
                lead, Table(sus, ratio=sus[["x_floor"]], fold=False, caption=SUSPECTS_CAPTION) if len(sus) else None,
                _next_steps(m, sus, covered), sections, m, headline=verdict_headline(judged["verdict"]))


def _twin_section(v: dict) -> Section:
    """Each engine judged against its twin: the unexplained finding or the match, the gap
    the twin explains, and its own report."""
    rows = pd.DataFrame([{"twin": t["name"], "engines": ", ".join(t["engines"]), "arm": t["twin"], "derived from": t["source"],
                          "unexplained": t["unexplained"], "report": t["report"]} for t in v["twins"]])
    text = "\n".join(f"- {t['sentence']} {t['by_design']} [Its report]({'../' + t['report'] + '/index.html'})."
                     for t in v["twins"])
    return Section("Against the twin: unexplained vs by design",
                   "Each engine judged a second time against its twin, the in-process arm its "
                   "settings map to, with floors that are noise on both sides (no QAT floor):\n" + text,
                   [Table(rows, fold=False)])
