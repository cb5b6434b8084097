"""The first page of a `fidelity engines` run (index.html and summary.md at the run's
root): the KLD verdict in one sentence, the two sub-reports' lead plots, one line per arm
saying what was found on it (flagged or not, by which task) with links to its reports,
the arms as launched and where everything else is. Links are relative, so the run's
folder can be moved or mailed whole.

An arm's line leads with what its tasks flagged (the KLD verdict naming one of its
factors, a consistency condition flagged, a needle recall loss the paired test finds)
before the numbers, so a line whose numbers look quiet never reads as "fine" when a task
flagged the arm."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from fidelity.kld.twin import flagged as twin_flagged
from fidelity.kld.twin import matched as twin_matched
from fidelity.kld.twin import verdict_headline
from fidelity.verdict.board import headline as board_headline
from fidelity.verdict.board import signal_ratios
from fidelity.verdict.findings import verdict_lines
from infra.report_page import FigureStore, Page, Section, Table, render_html, render_markdown
from kernel_toggles import serving_settings as SS


def engines_page(spec, state, out: dict, findings: pd.DataFrame | None = None) -> Page:
    """The run's first page from the spec, state.json (State) and report()'s `out`; `findings`:
    arm_findings' table when the caller already has it."""
    root = Path(out["root"])
    v = out.get("verdict")
    compared = (f"Spec `{spec.path.name}`: " + ", ".join(f"`{a.name}` ({a.engine})" for a in spec.arms)
                + f"; tasks {', '.join(spec.tasks)}.")
    findings = arm_findings(spec, state, out) if findings is None else findings
    lead = ["signals"] if "kld" in out else ["recall_vs_length"]     # one lead plot, at full width
    return Page(f"fidelity engines: {spec.path.name}", compared, _verdict(out) or ["No task finished."], lead,
                Table(findings, fold=False, markup=True, caption=FINDINGS_CAPTION) if len(findings) else None,
                [], _named_section(v) + [Section("Reports", "\n".join(f"- {line}" for line in _links(out, root)))]
                + ([Section("Needle recall", "", [], ["recall_vs_length"])] if {"kld", "needle"} <= set(out) else [])
                + [Section("Arms as launched", "", [Table(_launched(spec, state), fold=False)])],
                headline=_headline(spec, v, findings) if v or len(findings) else "",
                suspects_title="Each arm in one line")


def _named_section(v: dict | None) -> list[Section]:
    """What the KLD verdict names, a row per toggle with the numbers its headline quotes (the
    same value, interval and floor, so the page says each number once, in a table too)."""
    named = (v or {}).get("named") or []
    if not named:
        return []
    rows = pd.DataFrame([{"toggle": n["toggle"], "method": n["method"], "signal": n["signal"], "where": n["where"],
                          "value": n["value"], "ci_low": n["lo"], "ci_high": n["hi"], "floor": n["floor_hi"],
                          "floor arm": n.get("floor_arm") or "–", "× floor": _times(n.get("x_floor")),
                          "× floor at ci_low": _times(n.get("x_floor_lo"))} for n in named])
    return [Section("Named by the KLD verdict", "", [Table(rows, fold=False)])]


def _times(x) -> str:
    """A multiple of a floor as the headline prints it ('–' where there is none: a zero floor)."""
    return f"{x:.3g}" if x is not None and np.isfinite(x) else "–"


FINDINGS_CAPTION = ("finding: **flagged** when a task flagged the arm (the KLD verdict names one of its "
                    "factors, a consistency condition is flagged, its needle recall is below the "
                    "baseline's by the paired test, or a needle reply carries BOS); **above floors** when "
                    "the KLD signals board has it above every floor somewhere but the verdict names none "
                    "of its factors (these arms "
                    "do not separate them); *differs (no noise floor)* when its only floors are "
                    "bit-identical repeats, so any difference, by design or not, is a difference and "
                    "nothing says how large is noise; **changes inside** when only a mechanism signal (indexer "
                    "picks, experts) moved; otherwise nothing flagged.")


def _verdict(out: dict) -> list[str]:
    """Every task's own words, folded under the headline: the KLD verdict, each arm's
    needle recall, each consistency line (naming its arm)."""
    lines = verdict_lines(out["verdict"]) if "verdict" in out else []
    for r in out.get("recall") or []:
        lines.append(f"`{r['arm']}` needle recall " + ("– (no scored trial)" if r["recall"] is None else
                     f"{r['recall']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] over {r['n_scored']} "
                     f"scored trials ({r['truncated']} truncated, {r['server_error']} server errors)"))
    for name, c in (out.get("consistency") or {}).items():
        lines += [f"Consistency: {line}" if line.startswith(f"`{name}`") else f"`{name}` consistency: {line}"
                  for line in c["verdict"]]
    return lines


def _headline(spec, v: dict | None, findings: pd.DataFrame) -> str:
    """The KLD verdict's one sentence, naming the arm(s) holding its culprit; without a
    KLD verdict, how many arms a task flagged."""
    if v:
        holders = [a.name for a in spec.arms if v.get("culprit") and v["culprit"] in a.factors]
        if holders and not twin_flagged(v):     # the golden names a culprit; every twin matches
            return f"`{', '.join(holders)}`: " + " ".join(filter(None, [board_headline(v), twin_matched(v)]))
        return (f"`{', '.join(holders)}`: " if holders else "") + verdict_headline(v)
    flagged = flagged_arms(findings)
    if flagged:
        return f"Flagged: {', '.join(f'`{a}`' for a in flagged)} (each arm's line says by which task)."
    return "No task flagged any arm."


def flagged_arms(findings: pd.DataFrame) -> list[str]:
    """The arms some task flagged, from arm_findings' table (the headline's list and the
    command's exit code, fidelity.errors)."""
    return findings[findings.finding.str.startswith(FLAGGED)].arm.tolist() if len(findings) else []


FLAGGED, ABOVE, INSIDE, QUIET, BASELINE, FLOOR = ("**flagged**", "**above floors**", "changes inside",
                                                  "nothing flagged", "baseline", "a floor (its role in the spec)")
DIFFERS = "differs (no noise floor)"      # only bit-identical repeat floors: nothing to judge it against


def arm_findings(spec, state, out: dict) -> pd.DataFrame:
    """One row per arm: what was found (flagged / changes inside / nothing flagged), the
    KLD, needle and consistency in a few words each, and links to its reports."""
    root = Path(out["root"])
    v = out.get("verdict") or {}
    named = {n["toggle"]: n for n in v.get("named", [])}
    inside = {f["toggle"] for f in v.get("mechanism", [])}
    kld = _kld_means(out)
    board = _board(out, [a.name for a in spec.arms])
    needle, loss = _needle_words(out)
    rows = []
    for a in spec.arms:
        c = (out.get("consistency") or {}).get(a.name)
        hit = sorted(set(a.factors) & set(named))
        flags = ([f"KLD names {', '.join(hit)}"] if hit else []) \
            + ([f"consistency: {', '.join(c['flagged'])}"] if c and c["flagged"] else []) \
            + ([loss[a.name]] if a.name in loss else [])
        above = board.get(a.name, "")
        what = BASELINE if a.role == "baseline" and not flags else FLOOR if a.role == "floor" and not flags \
            else FLAGGED if flags \
            else ABOVE if above.startswith("above") else DIFFERS if above \
            else INSIDE if set(a.factors) & inside else QUIET
        words = flags or ([above] if above and a.role == "arm" else [])
        rows.append({"arm": a.name, "finding": what + (": " + "; ".join(words) if words else ""),
                     "mean KLD [95% CI]": kld.get(a.name, "–"), "needle recall": needle.get(a.name, "–"),
                     "consistency": _consistency_words(c) if c else "–",
                     "reports": _arm_links(a.name, out, c, root)})
    return pd.DataFrame(rows)


def _board(out: dict, arms: list[str]) -> dict[str, str]:
    """Arm -> "above every floor at 10 of 13 signal places (worst kld_p99 @ logits)" from
    the KLD report's board (fidelity.verdict.board.signal_ratios); absent when none."""
    if "kld" not in out:
        return {}
    try:
        summary, attr = (pd.read_csv(Path(out["kld"]) / f) for f in ("signal_summary.csv", "signal_attribution.csv"))
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return {}
    if summary.empty or attr.empty:
        return {}
    ratios = signal_ratios(summary, attr, arms)
    out_words = {}
    for arm, r in ratios.iterrows():
        r = r.dropna()
        above = r[(r > 1) & np.isfinite(r)]
        zero = r[~np.isfinite(r)]             # a floor of exactly 0 divides nothing: said as what it is
        words = []
        if len(above):
            words.append(f"above every floor at {len(above)} of {len(r)} signal places "
                         f"(worst: {above.idxmax()}, {above.max():.3g}× its floor)")
        if len(zero):
            words.append(f"differs at {len(zero)} of {len(r)} signal places where every floor is "
                         "bit-identical on repeat (0: no noise measured to judge it against)")
        if words:
            out_words[arm] = "; ".join(words)
    return out_words


def _kld_means(out: dict) -> dict[str, str]:
    """Arm -> its mean final-logit KLD against the baseline with the interval, from the
    KLD report's signal summary."""
    if "kld" not in out:
        return {}
    try:
        s = pd.read_csv(Path(out["kld"]) / "signal_summary.csv")
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return {}
    s = s[(s.signal == "kld_mean") & (s["where"] == "final logits")]
    return {r.arm: f"{r['mean']:.3g} [{r.lo:.3g}, {r.hi:.3g}]" for _, r in s.iterrows()}


def _needle_words(out: dict) -> tuple[dict[str, str], dict[str, str]]:
    """Arm -> recall with its interval; and arm -> what the needle flags on it: the loss the
    paired test finds against the baseline (McNemar over all trials), BOS in its replies."""
    words = {r["arm"]: ("no scored trial" if r["recall"] is None else
                        f"{r['recall']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}] ({r['n_scored']} trials)")
             for r in out.get("recall") or []}
    loss = {}
    try:
        tables = json.loads((Path(out["needle"]) / "summary.json").read_text())["tables"] \
            if "needle" in out else {}
    except (FileNotFoundError, KeyError, json.JSONDecodeError):
        tables = {}
    for p in tables.get("pairs", []):
        if p["scope"] == "all" and p["significant"] and p["delta"] > 0:
            loss[p["arm_b"]] = (f"needle recall {p['recall_b']:.3f} vs {p['arm_a']}'s {p['recall_a']:.3f} "
                                f"(McNemar p = {p['p_value']:.2g})")
    for a in tables.get("arms", []):
        if a.get("bos_replies"):            # a NaN logits row's argmax in a reply: flagged whatever the recall
            bos = f"BOS in {a['bos_replies']} of {a['n']} needle replies (token 0: a NaN logits row's argmax)"
            loss[a["arm"]] = "; ".join(filter(None, [loss.get(a["arm"]), bos]))
    return words, loss


def _consistency_words(c: dict) -> str:
    if c["flagged"]:
        return f"**{len(c['flagged'])} of {c['conditions']} conditions flagged**: {', '.join(c['flagged'])}"
    return f"nothing flagged in {c['conditions']} conditions"


def _arm_links(name: str, out: dict, c: dict | None, root: Path) -> str:
    links = [f"[consistency]({c['path']}/index.html)"] if c else []
    if (root / "logs" / f"{name}.log").exists():
        links.append(f"[log](logs/{name}.log)")
    return ", ".join(links) or "–"


def _links(out: dict, root: Path) -> list[str]:
    """The sub-reports and the run's files as relative links."""
    lines = [f"[{what}]({Path(out[k]).relative_to(root)}/index.html)"
             for k, what in (("kld", "KLD report"), ("needle", "Needle report")) if k in out]
    lines += [f"[Consistency report: {name}]({c['path']}/index.html) ({len(c['flagged'])} of "
              f"{c['conditions']} conditions flagged)" for name, c in (out.get("consistency") or {}).items()]
    lines.append("Launch commands: [launch.sh](launch.sh); engine logs: [logs/](logs/); state: "
                 "[state.json](state.json).")
    return lines


def _launched(spec, state) -> pd.DataFrame:
    return pd.DataFrame([{"arm": a.name, "engine": a.engine, "role": a.role,
                          "toggles": a.toggles if a.toggles is not None else "-",
                          "serving": " ".join(f"{k}={SS.get(k).spell(v)}" for k, v in a.serving.items()) or "-",
                          "env": " ".join(f"{k}={v}" for k, v in a.env.items()) or "-",
                          "flags": " ".join(a.flags) or "-", "ready_s": state.arm(a.name).get("ready_s"),
                          "tasks_done": ", ".join(state.arm(a.name)["done"]) or "-"} for a in spec.arms])


def write_index(root: Path, page: Page, out: dict) -> None:
    """index.html and summary.md at the run's root (beside its state and logs), the lead
    plots taken from the KLD and needle reports; each file written whole, then renamed."""
    figs = []
    if "kld" in out:
        figs.append((f"{Path(out['kld']).relative_to(root)}/signals.png", "KLD: signals vs their floors",
                     "Each arm's mean of each signal over the highest floor (white within it, red above; "
                     "floors' rows in grey; crossed where every floor is exactly 0: no scale)."))
    if "needle" in out:
        figs.append((f"{Path(out['needle']).relative_to(root)}/recall_vs_length.png",
                     "Needle recall vs context length", "95% Wilson intervals; the baseline arm dashed."))
    store = FigureStore(root, [f for f in figs if (root / f[0]).exists()])
    for name, text in (("index.html", render_html(page, store)), ("summary.md", render_markdown(page, store))):
        tmp = root / f".{name}.tmp"
        tmp.write_text(text)
        tmp.replace(root / name)
