"""The verdict on the same runs, before and after a change: which toggles each case names,
by which method, and under which schedule. Cases (all `run_ab` on the embedded model):

- rare: tests/mutations/rare_bugs.py's page-table bug on the default 18 prompts (breaks 2);
- serving: the planted serving bugs under the schedules that expose them, two of them also
  one-shot (lengths 200, 3 prompts);
- same-as-one-shot: routed_scaling_double one-shot, under prefix_hit(130) and decode_from(150)
  (its effect is the same everywhere: the finding is the toggle's, not a schedule's);
- nulls: golden under every schedule (chunked(64), prefix_hit(130), decode_from(150),
  batch(8)) on the default 18 prompts: nothing may be named;
- length-conditional: tests/mutations/residue_bugs.py's two bugs (acting only at lengths 3
  and 1 mod 4) on the default grid (250, 511: no length is 1 mod 4), 3 prompts per length:
  the first acts at 511 only, the second never (untested, not clean);
- periods: residue_bugs.py's bugs tied to other periods of the config (a multiple of the
  window 32, of the ratio 128, length 384 alone) and the 3-mod-4 one, at the lengths the
  verdict suggests for a toggle that acted at 384 only (384, 385 and 384 + each period):
  each read as its own period;
- selection: tests/mutations/bugs.py's mut_index_drop_last_pick (the indexer's k-th pick
  replaced by the (k+1)-th) on the default 18 prompts: a mechanism finding, and what the
  selection tests could see.

Run it on two checkouts, each writing its own column:
    git worktree add /tmp/before <commit>
    python bench/bench_verdict_cases.py --label before --root /tmp/before
    python bench/bench_verdict_cases.py --label after
The results file keeps both (bench/results/verdict_cases.md)."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
RESULTS = HERE / "bench" / "results"
SERVING = ["chunk_stale_index_keys@chunked(64)", "restore_drops_compressor_pending@prefix_hit(130)",
           "restore_window_one_off@prefix_hit(130)", "restore_saved_one_token_later@prefix_hit(130)",
           "restore_drops_compressor_pending", "restore_window_one_off"]
CASES = {
    "rare": dict(arms=["rare_index_page_7"]),
    "serving": dict(arms=SERVING, lengths=(200,), prompts_per_length=3, decode_steps=1),
    "same-as-one-shot": dict(arms=["routed_scaling_double", "routed_scaling_double@prefix_hit(130)",
                                   "routed_scaling_double@decode_from(150)"],
                             lengths=(200,), prompts_per_length=3, decode_steps=1),
    "nulls": dict(arms=["golden@chunked(64)", "golden@prefix_hit(130)", "golden@decode_from(150)",
                        "golden@batch(8)"]),
    "length-conditional": dict(arms=["mut_ape_shift_len3", "mut_ape_shift_len1"], prompts_per_length=3,
                               decode_steps=2),
    "periods": dict(arms=["mut_ape_shift_mult32", "mut_ape_shift_mult128", "mut_ape_shift_at384",
                          "mut_ape_shift_len3"], lengths=(384, 385, 388, 416, 448, 512), prompts_per_length=1,
                    decode_steps=1),
    "selection": dict(arms=["mut_index_drop_last_pick"]),
}
PLUGINS = ("rare_bugs.py", "residue_bugs.py", "bugs.py")


def run_case(settings: dict) -> dict:
    from fidelity.ab.design import ABSettings
    from fidelity.ab.run import ReportTarget, RunSite, run_ab
    from fidelity.weights.source import load_tokenizer_for, load_weights
    w, _ = load_weights(None)
    t0 = time.perf_counter()
    res = run_ab(w, ABSettings.of(shapley_top=0, n_boot=500, **settings), ReportTarget(None), RunSite(),
                 tokenizer=load_tokenizer_for(None))
    v = res["verdict"]
    named = [f"{n['toggle']} ({n['method']}{', under ' + n['schedule'] if n.get('schedule') else ''})"
             for n in v["named"]]
    return {"named": named, "mechanism": [f["toggle"] for f in v.get("mechanism", [])],
            "never_acted": v.get("never_acted", []), "acted_only_at": v.get("acted_only_at", {}),
            "periods": _periods(v.get("acted_only_at", {}), settings, w.cfg),
            "power": v.get("power_sentence", ""),
            "small_certain": [d["arm"] for d in v.get("small_certain") or []],
            "broken": _broken_counts(res), "sentence": v["sentence"],
            "seconds": round(time.perf_counter() - t0, 1)}


def _broken_counts(res: dict) -> dict:
    """arm -> [broken prompts in the residue table, in the verdict's answer-KLD tail] (the
    one definition of broken: the two must agree); {} on a checkout without the table."""
    try:
        from fidelity.ab.report import residues
        from fidelity.verdict.signals import SCHEDULE_FACTOR
    except ImportError:
        return {}
    table, _ = residues(res["signals"], res["manifest"])
    att = res["signal_attribution"]
    tail = att[(att.method == "tail") & (att.signal == "answer_kld")]
    out = {}
    for arm, factors in res["manifest"]["arms"].items():
        toggles = [f for f in factors if not f.startswith(SCHEDULE_FACTOR)]
        sched = ", ".join(sorted(f[len(SCHEDULE_FACTOR):] for f in factors if f.startswith(SCHEDULE_FACTOR)))
        row = tail[(tail.toggle == (toggles[0] if len(toggles) == 1 else None)) & (tail.schedule.fillna("") == sched)]
        if len(row):
            out[arm] = [int(table[table.arm == arm].breaks.sum()), int(row.b.iloc[0])]
    return out


def _periods(acted: dict, settings: dict, cfg) -> dict:
    """toggle -> the config's periods its acting lengths fit (fidelity.design.lengths.fits; {} on a
    checkout without it)."""
    try:
        from fidelity.design.lengths import Boundaries, fits
    except ImportError:
        return {}
    from fidelity.ab.design import PromptPlan
    tried = list(settings.get("lengths", PromptPlan.lengths))
    return {t: fits(L, tried, Boundaries.of(cfg)) for t, L in acted.items()}


def write(label: str | None, got: dict) -> Path:
    """Adds `label`'s column to the results (None: none, the table only rendered again)."""
    path = RESULTS / "verdict_cases.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    if label is not None:                     # merged: bench_spec_kinds.py's `spec` case stays
        data.setdefault(label, {}).update(got)
    path.write_text(json.dumps(data, indent=1))
    labels = list(data)
    lines = ["# The verdict on the same runs, before and after", "",
             "Generated by `bench/bench_verdict_cases.py` (see its docstring): per case, the toggles "
             "the outcome verdict names (method, schedule) and those named as mechanism findings; the toggles "
             "that never acted or acted at some lengths only (with the config's period their lengths read as); "
             "selection losses seen but too few to name. The `spec` row is `bench/bench_spec_kinds.py`'s: the "
             "kind the spec family names for each planted speculative bug, and a flagged arm's first-draft "
             "acceptance against the lossless arm at the same drafts per verify. Columns: the checkout each "
             "was run from.", "",
             "| case | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for case in CASES:
        cells = []
        for lab in labels:
            r = data[lab].get(case)
            if r is None:
                cells.append("")
                continue
            out = "; ".join(r["named"]) or "nothing"
            mech = ", ".join(r["mechanism"])
            said = [f"never acted: {', '.join(r['never_acted'])}"] if r.get("never_acted") else []
            said += [f"{t} acted only at {', '.join(map(str, L))}" + _period_words(r, t)
                     for t, L in (r.get("acted_only_at") or {}).items()]
            if r.get("power", "").startswith("Selection losses"):     # a loss seen, too few to name
                said.append(f"*{r['power']}*")
            if r.get("small_certain"):
                said.append(f"small but certain: {', '.join(r['small_certain'])}")
            if r.get("broken"):
                off = {a: c for a, c in r["broken"].items() if c[0] != c[1]}
                said.append("broken prompts, residue table vs verdict: " + (
                    "; ".join(f"{a} {c[0]} vs {c[1]}" for a, c in off.items()) if off else
                    f"equal on all {len(r['broken'])} arms ({sum(c[1] for c in r['broken'].values())} broken)"))
            cells.append(f"outcome: {out}" + (f"; mechanism: {mech}" if mech else "")
                         + "".join(f"; {x}" for x in said) + f" ({r['seconds']} s)")
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    if any("spec" in data[lab] for lab in labels):     # bench_spec_kinds.py: the spec family's kinds
        cells = []
        for lab in labels:
            r = data[lab].get("spec")
            acc = "; ".join(f"{a} first-draft acceptance {x}" for a, x in (r or {}).get("acceptance", {}).items())
            cells.append("" if r is None else "; ".join(f"{a}: {k}" for a, k in r["kinds"].items())
                         + (f"; {acc}" if acc else "") + f" ({r['seconds']} s)")
        lines.append("| spec (bench_spec_kinds.py) | " + " | ".join(cells) + " |")
    md = RESULTS / "verdict_cases.md"
    md.write_text("\n".join(lines) + "\n")
    return md


def _period_words(r: dict, t: str) -> str:
    if "periods" not in r:
        return ""
    p = r["periods"].get(t, [])
    if len(r["acted_only_at"][t]) == 1 and not p:
        return " (that length alone)" if f"length {r['acted_only_at'][t][0]} alone" in r.get("sentence", "") else ""
    return f" (period {' or '.join(map(str, p))})" if p else ""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", help="column name (e.g. before, after)")
    p.add_argument("--render", action="store_true", help="only write the table again from the stored results")
    p.add_argument("--root", default=str(HERE), help="checkout whose fidelity/ is scored")
    a = p.parse_args()
    if a.render:
        print(write(None, {}))
        return 0
    if not a.label:
        p.error("--label is required (or --render)")
    import torch
    torch.set_num_threads(1)
    sys.path.insert(0, a.root)
    from kernel_toggles.plugins import load_plugins
    load_plugins([str(HERE / "tests" / "mutations" / f) for f in PLUGINS])
    got = {case: run_case(s) for case, s in CASES.items()}
    print(write(a.label, got))
    return 0


if __name__ == "__main__":
    sys.exit(main())
