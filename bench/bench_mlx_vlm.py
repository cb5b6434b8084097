"""mlx-vlm (MLX's DeepSeek-V4, the pinned release) against the golden, measured here: each way
a program can drive it (route x weights) served by fidelity's harness and scored by the
toolkit's own commands.

Configurations: the generation path (decode: one token per call) and one-call prefill, each
with DeepSeek's native FP8/FP4 weights (mlx-vlm's own loader: MXFP8 attention, MXFP4 experts,
bf16 activations) and with our exact float32 dequantisation. Per configuration:
  kld      `fidelity kld`, golden + floors in-process vs the harness, judged against the golden
           and against its twin (the exact profile computed in the same calls)
and once: `fidelity mlxvlm explain` (f32; every route, its replay and causality probe).
`--needle`: recall vs context across HISA's switch (index_keep x index_block entries, ~4K tokens
at ratio 4): mlx-vlm with HISA on (its default) and off (index_block 0) over HTTP, the golden,
its twin with HISA and without in-process (with the needle entry's fate per CSA layer); the
report is reports/mlx-vlm-hisa/ (committed).
`--history`: `fidelity mlxvlm history` over PyPI's releases (resumes from the committed ledger,
reports/mlxvlm-history/), its table and change points into docs/mlx-vlm.md.
Writes bench/results/mlx_vlm.json and docs/mlx-vlm.md's measured tables (`--render`: the
tables again from the stored JSON). Needs `make mlx-vlm`. About 20 minutes on 2 cores, the
needle sweep more (its own time is written down with it)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pandas as pd


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fidelity.mlxvlm import paths  # noqa: E402
from fidelity.mlxvlm.server import serving  # noqa: E402
from engine_bench import fidelity, kld_row  # noqa: E402

MODEL = ROOT / "models" / "tiny-needle-v2"
OUT = Path("/tmp/bench-mlx")
# needle results where the committed page can name them (repo-relative, git-ignored)
NEEDLE_RESULTS = Path("bench") / "out" / "needle-hisa.jsonl"
RESULTS = ROOT / "bench" / "results" / "mlx_vlm.json"
DOC = ROOT / "docs" / "mlx-vlm.md"
KLD_LENGTHS, KLD_REPS = "256,511,1023", 2
NEEDLE_LENGTHS, NEEDLE_DEPTHS, NEEDLE_REPS = "2048,4608,8192", "10,50,90", 1   # below, just past and twice the switch
# the twins alone (in-process, minutes where mlx-vlm over HTTP takes hours) further past the switch
LONG_LENGTHS, LONG_DEPTHS = "8192,16384", "10,30,50,70,90"
HISA_REPORT = ROOT / "reports" / "mlx-vlm-hisa"
HISTORY = ROOT / "reports" / "mlxvlm-history"
HISTORY_ARGS = ("--releases", "spread:6", "--lengths", "256", "--reps", "1")
CONFIGS = {"native, decode": ("native", "decode"), "native, prefill": ("native", "prefill"),
           "f32, decode": ("f32", "decode"), "f32, prefill": ("f32", "prefill")}


def kld(name: str, url: str, weights: str, route: str) -> dict:
    """One kld run: the arm against the golden (with the golden's floors) and against its twin.
    One output folder per route (its twin and the twin's floors are the route's, scored once
    for both weights); the endpoint named by its weights."""
    arm, run_id = f"mlx-{weights}", "kld-" + name.replace(", ", "-")
    out = OUT / route.replace(":", "")
    fidelity("kld", "--arm", "golden=golden", "--endpoint", f"{arm}={url}", "--checkpoint", str(MODEL),
             "--lengths", KLD_LENGTHS, "--reps", str(KLD_REPS), "--decode-steps", "4", "--exact", "--no-captures",
             "--out", str(out), "--quiet", "--run-id", run_id)
    return kld_row(out, run_id, arm)


def explain() -> dict:
    r = fidelity("mlxvlm", "explain", "--checkpoint", str(MODEL), "--out", str(OUT))
    e = json.loads((OUT / "mlxvlm-explain" / "findings.json").read_text())
    return {"sentence": e["sentence"], "twin_floor_kl": e["twin_floor_kl"], "tokens": e["tokens"],
            "routes": [{k: x[k] for k in ("route", "kl_mean", "kl_max", "same_top1", "x_floor", "departs")}
                       | {"causal": x["causality"]["first_moved"] is None} for x in e["routes"]],
            "exit": r.returncode}


def needle() -> dict:
    """The recall sweep across HISA's switch; the report copied to reports/mlx-vlm-hisa."""
    import shutil
    import time
    t0 = time.time()
    with serving(MODEL, OUT / "harness-hisa.log", "native", "decode", name="mlx") as on, \
            serving(MODEL, OUT / "harness-nohisa.log", "native", "decode", name="mlx-nohisa", index_block=0) as off:
        fidelity("needle", "--arm", "golden=golden", "--arm", "twin=exact:hisa", "--arm", "twin-nohisa=exact:",
                 "--endpoint", f"mlx={on}", "--endpoint", f"mlx-nohisa={off}", "--checkpoint", str(MODEL),
                 "--lengths", NEEDLE_LENGTHS, "--depths", NEEDLE_DEPTHS, "--reps", str(NEEDLE_REPS),
                 "--temperature", "0", "--out", str(OUT), "--run-id", "hisa", "--results", str(NEEDLE_RESULTS),
                 # the harness answers one request at a time: queued requests would time out at 8K
                 "--concurrency", "1", "--timeout", "1800", "--quiet")
    src = OUT / "needle" / "hisa"
    shutil.rmtree(HISA_REPORT, ignore_errors=True)
    shutil.copytree(src, HISA_REPORT)
    s = json.loads((src / "summary.json").read_text())["tables"]
    cells = pd.DataFrame(s["cells"])
    by_len = cells.groupby(["arm", "length"]).apply(lambda g: g.correct.sum() / max(g.n_scored.sum(), 1))
    rows = trials(ROOT / NEEDLE_RESULTS)
    return {"recall": {a["arm"]: [a["recall"], a["ci_low"], a["ci_high"]] for a in s["arms"]},
            "by_length": {f"{a}@{n}": float(v) for (a, n), v in by_len.items()}, "seconds": time.time() - t0,
            "trial_seconds": trial_seconds(rows),
            "same_answer": {f"{a} vs {b}": same_answers(rows, a, b) for a, b in (("mlx", "twin"),
                                                                                  ("mlx-nohisa", "twin-nohisa"))}}


def trials(path: Path) -> list[dict]:
    """The latest row of each (arm, trial) of a needle results log."""
    got = {}
    for ln in path.read_text().splitlines():
        r = json.loads(ln) if ln.strip() else {}
        if "arm" in r and "trial_id" in r:
            got[r["arm"], r["trial_id"]] = r
    return list(got.values())


def trial_seconds(rows: list[dict]) -> dict:
    """Mean compute seconds of one trial per arm and length (a batch's time shared by its trials)."""
    out: dict = {}
    for r in rows:
        if r.get("outcome") != "server_error" and r.get("latency_s"):
            out.setdefault(f"{r['arm']}@{r['length']}", []).append(r["latency_s"] / (r.get("batch_trials") or 1))
    return {k: round(sum(v) / len(v), 1) for k, v in out.items()}


def same_answers(rows: list[dict], a: str, b: str) -> list[int]:
    """[trials where arms a and b gave the same answer, trials both answered]."""
    by = {(r["arm"], r["trial_id"]): r.get("response") for r in rows if r.get("outcome") != "server_error"}
    both = [t for (arm, t) in by if arm == a and (b, t) in by]
    return [sum(by[a, t] == by[b, t] for t in both), len(both)]


def needle_long() -> dict:
    """The twins with HISA and without, in-process, further past the switch and at more depths."""
    fidelity("needle", "--arm", "twin=exact:hisa", "--arm", "twin-nohisa=exact:", "--checkpoint", str(MODEL),
             "--lengths", LONG_LENGTHS, "--depths", LONG_DEPTHS, "--reps", "1", "--out", str(OUT), "--run-id",
             "hisa-long", "--results", str(OUT / "needle-hisa-long.jsonl"), "--quiet", "--no-plots")
    rows = trials(OUT / "needle-hisa-long.jsonl")
    out = {}
    for r in rows:
        m = {x["layer"]: x for x in r.get("mechanism") or []}
        out.setdefault(r["arm"], []).append({"length": r["length"], "depth": r["depth"], "outcome": r["outcome"],
                                            "layer1_in_topk": (m.get(1) or {}).get("in_topk"),
                                            "layer1_rank": (m.get(1) or {}).get("best_rank")})
    return {"trials": out, "trial_seconds": trial_seconds(rows)}


def main() -> int:
    install = paths.pinned()
    install.python()                                   # NotInstalled names `make mlx-vlm`
    OUT.mkdir(parents=True, exist_ok=True)
    if sys.argv[1:] == ["--history"]:
        r = fidelity("mlxvlm", "history", *HISTORY_ARGS, "--out", "reports")
        print(r.stdout[-3000:], r.stderr[-3000:], sep="\n")
        write_doc(json.loads(RESULTS.read_text()))
        return r.returncode
    if sys.argv[1:] in (["--needle"], ["--needle-long"]):
        res = json.loads(RESULTS.read_text())
        if sys.argv[1] == "--needle":
            res["needle"] = needle()
        else:
            res["needle_long"] = needle_long()
        RESULTS.write_text(json.dumps(res, indent=1, default=float))
        write_doc(res)
        return 0
    res = {"release": f"mlx-vlm=={install.version}", "mlx": paths.MLX, "configs": {}}
    for name, (weights, route) in CONFIGS.items():
        print(f"{name}: serving and scoring", flush=True)
        with serving(MODEL, OUT / f"harness-{weights}-{route}.log", weights, route, name=f"mlx-{weights}") as url:
            res["configs"][name] = {"weights": weights, "route": route, "kld": kld(name, url, weights, route)}
    print("explain", flush=True)
    res["explain"] = explain()
    RESULTS.write_text(json.dumps(res, indent=1, default=float))
    write_doc(res)
    return 0


def _table(head: list[str], rows: list[list]) -> str:
    return "\n".join(["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
                     + ["| " + " | ".join(str(c) for c in r) + " |" for r in rows])


def table(res: dict) -> str:
    """The doc's opening table: one row per configuration."""
    rows = []
    for name, c in res["configs"].items():
        k = c["kld"]
        judged = ("**unexplained**: " + k["twin_verdict"].split("): ", 1)[-1]) if k["twin_unexplained"] \
            else "matches its twin within the twin's floors"
        rows.append([f"{res['release']} ({name})",
                     f"{k['kld_mean']:.3g} [{k['kld_lo']:.3g}, {k['kld_hi']:.3g}] vs {k['floor_kld_hi']:.3g} "
                     f"({k['kld_mean'] / k['floor_kld_hi']:.2g}x)",
                     f"{k['same_top1']:.4f}", f"{k['vs_twin']:.3g} [{k['vs_twin_lo']:.3g}, {k['vs_twin_hi']:.3g}] "
                     f"(`{k['twin']}`)", judged])
    return "\n".join([
        f"mlx-vlm {res['release'].split('==')[1]} on mlx {res['mlx']} (CPU), served by fidelity's harness and measured "
        "by `bench/bench_mlx_vlm.py` on this machine. KLD: `fidelity kld --exact` (the whole vocabulary) over "
        f"{KLD_LENGTHS} tokens x 3 depths x {KLD_REPS}, mean [95% CI over prompts] against the golden's highest "
        "in-process floor's upper bound (the multiple in brackets); against its twin, the exact profile computed "
        "in the same calls as the route.", "",
        _table(["engine (weights, route)", "mean KLD vs golden [CI] vs floor", "same top-1",
                "mean KLD vs its twin", "verdict vs its twin (unexplained)"], rows)])


def explained(res: dict) -> str:
    e = res["explain"]
    rows = [[x["route"], f"{x['kl_mean']:.3g}", f"{x['kl_max']:.3g}", f"{x['same_top1']:.4f}",
             "yes" if x["departs"] else "no", "yes" if x["causal"] else "no"] for x in e["routes"]]
    return "\n".join(["`fidelity mlxvlm explain` (f32 weights, " + f"{e['tokens']} tokens), as it printed:", "",
                      *[f"> {s}" for s in e["sentence"]], "",
                      _table(["route", "mean KL vs twin", "max KL", "same top-1", "departs", "causal"], rows)])


def _between(text: str, tag: str, body: str) -> str:
    a, b = text.index(f"<!-- {tag}:start -->"), text.index(f"<!-- {tag}:end -->")
    return text[:a] + f"<!-- {tag}:start -->\n" + body + "\n" + text[b:]


def recall(res: dict) -> str:
    n = res.get("needle")
    if not n:
        return "(run `python bench/bench_mlx_vlm.py --needle`)"
    lengths = NEEDLE_LENGTHS.split(",")
    arms = list(n["recall"])
    rows = [[a, f"{n['recall'][a][0]:.2f} [{n['recall'][a][1]:.2f}, {n['recall'][a][2]:.2f}]"]
            + [f"{n['by_length'].get(f'{a}@{L}', float('nan')):.2f}" for L in lengths] for a in arms]
    same = "; ".join(f"{k}: {v[0]} of {v[1]}" for k, v in n["same_answer"].items())
    secs = ", ".join(f"{a} {n['trial_seconds'].get(f'{a}@{lengths[-1]}', float('nan')):.0f} s" for a in arms)
    return "\n".join([f"`bench/bench_mlx_vlm.py --needle`: depths {NEEDLE_DEPTHS}, one needle each, every arm greedy; "
                      "the page with its pictures and the needle entry's fate per CSA layer: "
                      "[reports/mlx-vlm-hisa](../reports/mlx-vlm-hisa/index.html). Same answer as its twin, trial by "
                      f"trial (right or wrong): {same}. One trial at {lengths[-1]} tokens here: {secs}.", "",
                      _table(["arm", "recall [95% CI]"] + [f"{L}" for L in lengths], rows)])


def recall_long(res: dict) -> str:
    n = res.get("needle_long")
    if not n:
        return "(run `python bench/bench_mlx_vlm.py --needle-long`)"
    rows = []
    for arm, trials in n["trials"].items():
        for L in LONG_LENGTHS.split(","):
            t = [x for x in trials if str(x["length"]) == L]
            found = sum(x["outcome"] == "correct" for x in t)
            best_not_kept = sum(x["layer1_rank"] == 1 and x["layer1_in_topk"] is False for x in t)
            rows.append([arm, L, f"{found} of {len(t)}",
                         f"{sum(bool(x['layer1_in_topk']) for x in t)} of {len(t)}", f"{best_not_kept}"])
    secs = ", ".join(f"{k} {v:.0f} s" for k, v in n["trial_seconds"].items())
    return "\n".join([f"`bench/bench_mlx_vlm.py --needle-long`: the twins in-process at depths {LONG_DEPTHS}, one "
                      f"needle each; layer 1 is the first CSA layer. One trial here: {secs}.", "",
                      _table(["arm", "length", "needle found", "its entry picked at layer 1",
                              "ranked 1st by the exact score, yet not picked"], rows)])


def history() -> str:
    """The history's releases table and change points, from its committed page."""
    rep = HISTORY / "report"
    if not (rep / "builds.csv").is_file():
        return "Not run yet: `python bench/bench_mlx_vlm.py --history`."
    t = pd.read_csv(rep / "builds.csv").fillna("")
    cols = ["release", "status", "loads DeepSeek's checkpoint", "KLD vs golden [95% CI]", "golden floor",
            "KLD vs twin [95% CI]", "vs twin", "same top-1"]
    rows = [[r[c] if not isinstance(r[c], float) else f"{r[c]:.3g}" for c in cols] for _, r in t.iterrows()]
    from fidelity.history import report as R
    from fidelity.mlxvlm import history as H
    head = R.headline(H.History(HISTORY, H.Settings(MODEL), progress=lambda m: None))
    pairs = pd.read_csv(rep / "pairs.csv") if (rep / "pairs.csv").stat().st_size > 1 else pd.DataFrame()
    prow = [[r["from"], r["to"], r["kind"], r["mean KL [95% CI]"], r["twin's floor (mean, upper)"]]
            for _, r in pairs.iterrows()]
    return "\n\n".join(x for x in (
        f"`fidelity mlxvlm history {' '.join(HISTORY_ARGS)}` (`bench/bench_mlx_vlm.py --history`; page: "
        f"[reports/mlxvlm-history](../reports/mlxvlm-history/report/index.html)). " + head,
        _table(cols, rows),
        _table(["from", "to", "kind", "mean KL [95% CI]", "twin's floor (mean, upper)"], prow) if prow else "",
    ) if x)


def write_doc(res: dict) -> None:
    text = _between(_between(DOC.read_text(), "measured", table(res)), "explained", explained(res))
    text = _between(text, "history", history())
    DOC.write_text(_between(_between(text, "recall", recall(res)), "recall-long", recall_long(res)))


if __name__ == "__main__":
    if sys.argv[1:] == ["--render"]:
        write_doc(json.loads(RESULTS.read_text()))
        sys.exit(0)
    sys.exit(main())
