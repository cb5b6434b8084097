"""The A/B harness end to end on the tiny model: planted bugs are found, the null test
names no culprit, the report is complete and atomic, `fidelity check` gates, the notebook
runs on the result."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from fidelity.ab.design import ABSettings
from fidelity.ab.lockstep import LockstepArm, LockstepRunner, Prompt, RunnerSettings
from fidelity.ab.run import ReportTarget, RunSite, run_ab
from reference_model import Numerics, random_weights, tiny

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def weights():
    return random_weights(tiny(), 0)


def _settings(**kw):
    base = dict(lengths=(96,), prompts_per_length=3, decode_steps=1, n_boot=200, shapley_top=0)
    base.update(kw)
    return ABSettings.of(**base)


def _engine_plus(bug):
    """Arms for a planted-bug run: engine, engine + bug, and engine + bug minus each toggle."""
    from kernel_toggles.arms import ToggleSet
    arm = ToggleSet.parse(f"engine,{bug}")
    return ["engine", f"engine,{bug}"] + [str(arm.without(t)) for t in arm.names], f"engine,{bug}"


@pytest.fixture(scope="module")
def small_report(weights, tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    arms, base = _engine_plus("routed_scaling_double")
    res = run_ab(weights, _settings(arms=arms, base=base, lengths=(160,)), ReportTarget(out, "run1"),
                 RunSite())
    return out, res


def test_planted_bug_ranked_first_with_ci_above_floor(small_report):
    """engine + routed_scaling_double: leave-one-out over the arm's 11 toggles ranks the bug
    first, its CI clears the reference-vs-exact floor, and against the engine arm it first
    diverges where it first acts: the MoE output of layer 0."""
    from fidelity.ab.drift import first_divergence
    _, res = small_report
    attr = res["attribution"]
    loo = attr[attr.method == "leave_one_out"].sort_values("value", ascending=False)
    assert loo.iloc[0].toggle == "routed_scaling_double"
    assert loo.iloc[0].lo > res["noise_floor"]["hi"]
    assert res["verdict"]["culprit"] == "routed_scaling_double"
    fd = first_divergence(res["drift"], "engine,routed_scaling_double", "engine", 2.0)
    assert (fd["layer"], fd["tap"]) == (0, "ffn.out")


def test_planted_q_only_hadamard_is_ranked_first(weights):
    """engine + index_hadamard_q_only (ROCm/ATOM #1507): ranked first with a CI above zero.
    On the random-weight model its KLD stays below the QAT floor, so no verdict is asserted."""
    arms, base = _engine_plus("index_hadamard_q_only")
    res = run_ab(weights, _settings(arms=arms, base=base, lengths=(160,)), ReportTarget(None), RunSite())
    loo = res["attribution"][res["attribution"].method == "leave_one_out"].sort_values("value", ascending=False)
    assert loo.iloc[0].toggle == "index_hadamard_q_only" and loo.iloc[0].lo > 0
    from fidelity.ab.drift import first_divergence
    fd = first_divergence(res["drift"], base, "engine", 2.0)
    assert fd["layer"] == 1          # the first CSA layer: where the indexer first acts


def test_null_golden_vs_golden_names_no_culprit(weights, tmp_path):
    res = run_ab(weights, _settings(arms=["lm_head_bf16"], base="lm_head_bf16", seed=7),
                 ReportTarget(None), RunSite())
    assert res["verdict"]["culprit"] is None
    assert "No toggle stands out" in res["verdict"]["sentence"]


def test_report_files_and_manifest(small_report):
    out, res = small_report
    d = out / "run1"
    for f in ("drift.csv.gz", "kld.csv.gz", "attribution.csv", "summary.csv", "manifest.json",
              "summary.md", "index.html", "drift_vs_layer.png", "attribution.png",
              "kld_distribution.png", "topk_recall.png", "decode_drift.png"):
        assert (d / f).exists(), f
    m = json.loads((d / "manifest.json").read_text())
    assert m["schema_version"] == 1 and m["manifest"]["config_hash"] == tiny().config_hash()
    ar = m["manifest"]["arithmetic"]                  # what float32 floors depend on, machine to machine
    assert ar["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability() and ar["threads"] >= 1
    assert "@ 60d8d707" in m["manifest"]["reference"]        # the reference revision the golden follows
    assert f"The golden follows {m['manifest']['reference']}." in (d / "summary.md").read_text()
    assert (out / "latest").resolve() == d.resolve()
    assert "data:image/png;base64," in (d / "index.html").read_text()
    assert not [p for p in out.iterdir() if p.name.startswith(".")]       # no temp leftovers


def test_check_gate(small_report):
    out, _ = small_report
    cmd = [sys.executable, "-m", "fidelity.cli", "check", str(out / "run1")]
    ok = subprocess.run(cmd + ["--arm", "engine", "--max-kld", "0.1"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    bad = subprocess.run(cmd + ["--max-kld", "0.1"], capture_output=True, text=True)
    assert bad.returncode == 1 and "engine,routed_scaling_double: kld_mean" in bad.stdout
    missing = subprocess.run(cmd + ["--arm", "nope", "--max-kld", "1"], capture_output=True, text=True)
    assert missing.returncode == 2 and "not in the report" in missing.stderr


def test_nan_arm_is_reported_not_fatal(weights):
    def nan_wo_a(golden, o, w):
        y = golden.wo_a(o, w)
        return y * float("nan") if o.shape[0] > 1 else y
    arms = [LockstepArm("golden", Numerics(), role="golden"),
            LockstepArm("nan", Numerics().with_kernels("nan", wo_a=nan_wo_a))]
    res = LockstepRunner(weights, arms, RunnerSettings(decode_steps=1)).run([Prompt("p", torch.arange(2, 66))])
    ev = [e for e in res.events if e["arm"] == "nan"]
    assert ev and ev[0]["event"] == "non-finite" and "layers.0.attn.out" in ev[0]["detail"]
    df = pd.DataFrame(res.drift)
    assert not df[(df.arm == "nan") & (df.tap == "logits")].finite.any()


def test_unknown_arm_is_an_error_listing_valid_names(weights):
    with pytest.raises(ValueError, match="valid"):
        run_ab(weights, _settings(arms=["no_such_toggle"]), ReportTarget(None), RunSite())


def test_interrupted_report_leaves_nothing(weights, tmp_path, monkeypatch):
    import fidelity.ab.report as report

    def boom(*a, **k):
        raise KeyboardInterrupt
    monkeypatch.setattr(report.plots, "decode_drift", boom)
    with pytest.raises(KeyboardInterrupt):
        run_ab(weights, _settings(arms=["lm_head_bf16"], base="lm_head_bf16"), ReportTarget(tmp_path, "r"),
               RunSite())
    assert list(tmp_path.iterdir()) == []


def test_notebook_executes_on_a_report_and_shows_its_plots(small_report):
    """Executed in a real kernel against a fresh report (B: the committed example), every
    cell that draws a figure must carry an image/png output: a notebook whose plots go to
    a non-interactive backend shows a user tables only."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat
    out, _ = small_report
    nb = nbformat.read(ROOT / "notebooks" / "layer_drift.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code"), "outputs must be stripped"
    prompt = pd.read_csv(out / "run1" / "kld.csv.gz").prompt.iloc[0]
    env = {"DSV4_REPORT": str(out / "run1"), "DSV4_REPORT_B": str(ROOT / "reports" / "example"),
           "DSV4_PROMPT": prompt}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        for k in env:
            del os.environ[k]
    said = "".join(o.get("text", "") for o in nb.cells[2].outputs)
    assert f"prompt: {prompt}" in said, said                      # the plots narrowed to one prompt
    scatter = next(c for c in nb.cells if c.cell_type == "code" and "REPORT_B is None" in c.source)
    assert "annotate" in scatter.source                            # the moved points carry their arm
    plotting = [c for c in nb.cells if c.cell_type == "code" and "plt.show()" in c.source]
    assert len(plotting) >= 5
    for c in plotting:
        kinds = {k for o in c.outputs for k in o.get("data", {})}
        assert "image/png" in kinds, c.source[:80]


def test_lockstep_propagated_equals_standalone_and_isolated_feeds_golden(weights):
    """Propagated: an arm's numbers equal its own standalone forward bit for bit.
    Isolated: layer 0 sees the same input either way, later layers see golden's input,
    so an arm that only changes the lm head has zero drift at every layer."""
    toks = torch.arange(2, 90)
    f32 = Numerics("reference", torch.float32)
    arms = [LockstepArm("golden", Numerics(), role="golden"), LockstepArm("fp32", f32)]
    keep = ("layers.4.out",)
    res = LockstepRunner(weights, arms, RunnerSettings("propagated", 2, keep=tuple(keep))).run([Prompt("p", toks)])
    from reference_model import Model, Taps
    from fidelity.ab.metrics import kld_per_position
    t = Taps(list(keep))
    golden, arm = Model(weights, Numerics()), Model(weights, f32)
    lg_arm, st = arm.extend(toks, logits="all", taps=t)
    assert torch.equal(res.kept[("p", "fp32", "prefill", -1, "layers.4.out")], t["layers.4.out"])
    # teacher-forced decode on golden's greedy tokens, positions advancing like extend()
    lg_gold, gst = golden.extend(toks, logits="last")
    kl = pd.DataFrame(res.kld)
    for step in range(2):
        nxt = torch.tensor([int(lg_gold[-1].argmax())])
        t = Taps(list(keep))
        lg_arm, st = arm.extend(nxt, st, taps=t)
        lg_gold, gst = golden.extend(nxt, gst)
        assert torch.equal(res.kept[("p", "fp32", "decode", step, "layers.4.out")], t["layers.4.out"])
        row = kl[(kl.arm == "fp32") & (kl.phase == "decode") & (kl.step == step)]
        assert row.position.item() == len(toks) + step
        assert row.kld.item() == pytest.approx(float(kld_per_position(lg_gold, lg_arm)[0]), rel=1e-12)

    def lm_bf16(golden, x, w):
        return golden.rs(golden.lm_head(x, w))
    arms = [LockstepArm("golden", Numerics(), role="golden"), LockstepArm("lm", Numerics().with_kernels("lm", lm_head=lm_bf16))]
    iso = pd.DataFrame(LockstepRunner(weights, arms, RunnerSettings("isolated", 1)).run([Prompt("p", toks)]).drift)
    layers = iso[(iso.arm == "lm") & (iso.tap == "out")]
    assert (layers.rel_l2 == 0).all()
    assert (iso[(iso.arm == "lm") & (iso.tap == "logits")].kld_mean > 0).all()


def test_builtin_prompts_with_a_tokenizer_are_exact_length_haystacks():
    from fidelity.design.prompts import builtin_prompts
    from reference_model.tokenizer import load_tokenizer
    tok = load_tokenizer(None)
    ps = builtin_prompts(tiny(), (250, 301), 2, seed=0, tokenizer=tok)
    assert [p.length for p in ps] == [250, 250, 301, 301]
    text = tok.decode(ps[0].tokens.tolist())
    assert "special magic" in text
    assert not torch.equal(ps[0].tokens, ps[1].tokens)


def test_check_gate_relative_to_floors_by_default(small_report):
    """No threshold given: each arm against the report's worst floor (KLD <= 3x, recall and
    expert agreement >= floor - 0.05). The engine arm passes, engine + the planted bug
    fails on KLD; the floors pass themselves."""
    out, res = small_report
    cmd = [sys.executable, "-m", "fidelity.cli", "check", str(out / "run1")]
    ok = subprocess.run(cmd + ["--arm", "engine"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    floors = subprocess.run(cmd + ["--arm", "floor:exact", "--arm", "floor:tie-order"],
                            capture_output=True, text=True)
    assert floors.returncode == 0, floors.stdout
    bad = subprocess.run(cmd + ["--arm", "engine,routed_scaling_double"], capture_output=True, text=True)
    assert bad.returncode == 1 and "kld_mean" in bad.stdout and "x worst floor" in bad.stdout
    s = res["summary"].set_index("arm")
    assert s.loc["engine,routed_scaling_double", "kld_mean"] > 3 * s.loc[list(s.index[:3]), "kld_mean"].max()


def test_verdict_warns_with_too_few_prompts():
    from fidelity.verdict import judge as J
    attr = pd.DataFrame([{"signal": "kld_mean", "where": "final logits", "toggle": "t", "method": "one_at_a_time",
                          "value": 0.5, "lo": 0.4, "hi": 0.6}])
    floors = pd.DataFrame([{"signal": "kld_mean", "where": "final logits", "floor_hi": 0.01, "floor_arm": "f"}])
    few, _ = J.verdict(attr, floors, 2)
    many, _ = J.verdict(attr, floors, 6)
    assert few["culprit"] == many["culprit"] == "t"
    assert few.get("few_prompts") and "only 2 prompt(s)" in few["sentence"]
    assert "Caution" not in many["sentence"] and not many.get("few_prompts")


def test_a_toggle_that_never_acted_is_untested_not_clean(weights):
    """chunk_stale_index_keys acts only at a chunk boundary, which one-shot 96-token prompts
    never have: its arm is the golden bit for bit, so the verdict says it never acted (not
    that it is clean) and the factorial stage spends no arm on it."""
    res = run_ab(weights, _settings(arms=["chunk_stale_index_keys", "wo_a_fp8", "lm_head_bf16"], shapley_top=3),
                 ReportTarget(None), RunSite())
    v = res["verdict"]
    assert v["never_acted"] == ["chunk_stale_index_keys"]
    assert "Never acted: chunk_stale_index_keys" in v["sentence"] and "--lengths boundaries" in v["sentence"]
    arms = res["manifest"]["arms"]
    assert "lm_head_bf16,wo_a_fp8" in arms or "wo_a_fp8,lm_head_bf16" in arms      # the factorial ran
    assert not [a for a, s in arms.items() if "chunk_stale_index_keys" in s and len(s) > 1]


def test_never_acted_reads_every_one_toggle_arm():
    import pandas as pd
    from fidelity.verdict.findings import never_acted
    kld = pd.DataFrame({"arm": ["a", "a", "a@s", "b", "b@s", "ab"], "kld": [0.0, 0.0, 0.0, 0.0, 1e-9, 0.0]})
    sets = {"a": frozenset({"a"}), "a@s": frozenset({"a", "@chunked(4)"}), "b": frozenset({"b"}),
            "b@s": frozenset({"b", "@chunked(4)"}), "ab": frozenset({"a", "b"}), "c": frozenset({"c"})}
    assert never_acted(kld, sets) == ["a"]          # b acts under its schedule; c has no rows


def test_acted_only_at_names_the_lengths_a_toggle_moved():
    import pandas as pd
    from fidelity.verdict.findings import acted_only_at, acted_only_sentence
    kld = pd.DataFrame({"arm": ["a", "a", "a", "b", "b", "c", "c"], "length": [250, 256, 511, 250, 511, 250, 511],
                        "kld": [0.0, 3e-3, 0.0, 1e-9, 2e-9, 0.0, 0.0]})
    sets = {"a": frozenset({"a"}), "b": frozenset({"b"}), "c": frozenset({"c"})}
    got = acted_only_at(kld, sets)
    assert got == {"a": [256]}                       # b acts everywhere; c never (never_acted's)
    said = acted_only_sentence(got, [250, 256, 511])
    assert "a only at length 256" in said and "(250, 256, 511)" in said


def test_the_arms_table_names_its_floors_and_does_not_colour_them(small_report):
    """The QAT floor's size against the other floors is not a finding: its row in the Arms
    table says which floor it is and carries no ratio colour; the arms' rows keep theirs."""
    from fidelity.ab.report import SUMMARY_SIGNALS, summary_ratios
    out, res = small_report
    summary = pd.read_csv(Path(res["path"]) / "summary.csv")
    r = summary_ratios(summary, pd.read_csv(Path(res["path"]) / "signal_summary.csv"),
                       pd.DataFrame(res["floors"]))
    floors = summary.arm.str.startswith("floor:").to_numpy()
    assert floors.any() and r[floors].isna().all().all()
    assert r[~floors][list(SUMMARY_SIGNALS)].notna().any().any()
    html = (Path(res["path"]) / "index.html").read_text()
    assert "floor:exact (QAT floor)" in html.split(">Arms<", 1)[1]


def test_the_headline_multiple_is_the_suspects_tables(small_report):
    """One number per finding: the headline's "N× the highest floor" is the suspects table's
    x_floor (value / floor) for the same row, and the lower end it quotes is x_floor_ci_low."""
    import re
    from fidelity.verdict.board import headline, suspects
    _, res = small_report
    v = res["verdict"]
    sus = suspects(pd.read_csv(Path(res["path"]) / "signal_attribution.csv"))
    row = sus[sus.toggle == v["culprit"]].iloc[0]
    head = headline(v)
    x, lo = (float(m) for m in re.search(r"([\d.e+-]+)× the highest floor .*?, ([\d.e+-]+)× at its 95% interval", head).groups())
    assert f"{x:.3g}" == f"{row.x_floor:.3g}" and f"{lo:.3g}" == f"{row.x_floor_ci_low:.3g}", (head, row.to_dict())
    assert row.x_floor > row.x_floor_ci_low > 1
    # the value is named by what it is: an effect added to the engine is not the bug's own KLD
    if v["named"][0]["method"] == "added_to_base":
        assert "added to the base arm, it raises" in head, head
