"""A planted bug that acts only at prompt lengths 3 mod 4 (tests/mutations/residue_bugs.py,
after vllm #55927): `fidelity ab --lengths boundaries` places it at residue 3 and nowhere
else; the default grid (250, 511) has one length per residue it covers (2 and 3) and no
length at residues 0 or 1, so a residue-1 twin of the bug never acts there. The measured
runs behind docs/lengths.md are the same commands at default settings."""
from pathlib import Path

import json

import pandas as pd
import pytest
import torch

from fidelity.ab.design import ABSettings, PromptPlan
from fidelity.ab.report import residues
from fidelity.ab.run import ReportTarget, RunSite, run_ab
from fidelity.cli import main
from fidelity.design.lengths import parse_lengths, resolve, shortest_haystack
from fidelity.verdict.residues import broken_residues
from fidelity.weights.source import load_tokenizer_for, load_weights
from kernel_toggles.plugins import load_plugins
from needle.haystack import LocalCounter
from needle_util import kld_exit
from reference_model import Numerics

BUGS = Path(__file__).parent / "mutations" / "residue_bugs.py"
LEN3, LEN1 = "mut_ape_shift_len3", "mut_ape_shift_len1"


@pytest.fixture(scope="module")
def plugin():
    load_plugins([str(BUGS)])


def test_planted_bug_acts_only_on_a_prefill_ending_at_its_residue(plugin):
    """The kernel is golden's, bit for bit, unless a prefill of 2+ tokens ends at a length
    3 mod 4 and the ratio is 4 (decode steps and ratio-128 compressors untouched)."""
    from kernel_toggles import ToggleSet
    bug = ToggleSet.parse(LEN3).numerics("reference")
    gold = Numerics("reference")
    g = torch.Generator().manual_seed(0)
    ape = torch.randn(4, 8, generator=g, dtype=torch.float64)
    for n, ratio in ((255, 4), (256, 4), (257, 4), (258, 4), (255, 128), (1, 4)):
        pos = torch.arange(n) if n > 1 else torch.tensor([254])
        score = torch.randn(len(pos), 8, generator=g, dtype=torch.float64)
        a = ape if ratio == 4 else torch.randn(128, 8, generator=g, dtype=torch.float64)
        same = torch.equal(bug.compress_score_bias(score, a, pos, ratio),
                           gold.compress_score_bias(score, a, pos, ratio))
        assert same == (not (n == 255 and ratio == 4)), (n, ratio)


def _table(out: Path) -> pd.DataFrame:
    return pd.read_csv(next(out.glob("*/residues.csv")))


@pytest.mark.slow           # a minute or more on a busy 2-core machine: CI runs it in make test-slow
def test_ab_boundary_grid_places_the_bug_at_residue_3(plugin, capsys, tmp_path):
    """`fidelity ab --lengths boundaries` on the embedded model: lengths 255..258 (the
    haystack needs ~170 tokens; 256 = 2 x 128), and the residue table breaks at 3 mod 4
    only (every other residue bit-identical to golden)."""
    rc = main(["ab", "--plugin", str(BUGS), "--arm", LEN3, "--lengths", "boundaries",
               "--reps", "1", "--decode-steps", "2", "--shapley-top", "0",
               "--n-boot", "200", "--out", str(tmp_path), "--run-id", "b"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "answer KLD by length residue" in cap.out and "left out" in cap.err   # 31..130 too short
    t = _table(tmp_path)
    assert sorted(t.lengths.astype(str)) == ["255", "256", "257", "258"]
    mine = t[(t.arm == LEN3) & (t.residue == "3 mod 4")].iloc[0]
    others = t[(t.arm == LEN3) & (t.residue != "3 mod 4")]
    assert mine["max"] > 0 and (others["max"] == 0).all() and (others.breaks == 0).all()
    # one prompt per length: 255's may stay below 10x its floor; the table then counts no break
    # and the verdict names nothing -- and says the toggle acted at 255 only
    v = json.loads((tmp_path / "b" / "manifest.json").read_text())["verdict"]
    assert v["acted_only_at"] == {LEN3: [255]}
    assert f"{LEN3} only at length 255" in v["sentence"]
    assert (mine.breaks == 0) == ("no toggle breaks a prompt" in v["sentence"])   # table and verdict agree
    page = (tmp_path / "b" / "summary.md").read_text()
    assert "By length residue" in page and "2x128-1" in page


@pytest.mark.slow           # a minute or more on a busy 2-core machine: CI runs it in make test-slow
def test_boundary_grid_vs_default_grid(plugin):
    """Both grids with the residue-3 bug and its residue-1 twin. Boundary grid: each is
    placed at its residue. Default grid (250, 511): the residue-3 bug breaks at 511 only
    (the grid's one length 3 mod 4, indistinguishable there from 'the longer prompts'),
    the residue-1 twin never acts (bit-identical to golden on every prompt, not named)."""
    w, _ = load_weights(None)
    tok = load_tokenizer_for(None)
    grid, _, _ = resolve(parse_lengths("boundaries"), w.cfg, shortest_haystack(LocalCounter(tok)))
    assert grid == [255, 256, 257, 258]

    def run(lengths):
        s = ABSettings.of(arms=[LEN3, LEN1], lengths=tuple(lengths), prompts_per_length=2,
                          decode_steps=2, shapley_top=0, n_boot=300)
        res = run_ab(w, s, ReportTarget(None), RunSite(), tokenizer=tok)
        return res, residues(res["signals"], res["manifest"])[0]

    _, t = run(grid)
    print(t.to_string())
    assert broken_residues(t, LEN3) == ["3 mod 4"] and broken_residues(t, LEN1) == ["1 mod 4"]
    for arm, r in ((LEN3, "3 mod 4"), (LEN1, "1 mod 4")):
        assert (t[(t.arm == arm) & (t.residue != r)]["max"] == 0).all()

    res, t = run(PromptPlan.lengths)
    print(t.to_string())
    print(res["verdict"]["sentence"])
    assert set(t.residue) == {"2 mod 4", "3 mod 4"}                # no length at residues 0, 1
    assert broken_residues(t, LEN3) == ["3 mod 4"]
    assert t.set_index(["arm", "residue"]).loc[(LEN3, "3 mod 4"), "lengths"] == "511"
    assert (t[t.arm == LEN1]["max"] == 0).all()                     # never acts
    assert res["verdict"]["never_acted"] == [LEN1]                  # ... and is said untested
    assert res["verdict"]["acted_only_at"] == {LEN3: [511]}         # the one length it acted at
    assert f"{LEN3} only at length 511" in res["verdict"]["sentence"]
    # one length cannot say which period: the verdict asks for the lengths that can
    assert res["verdict"]["separating_lengths"][LEN3] == [511, 512, 515, 543, 575, 639]
    named = {n["toggle"] for n in res["verdict"]["named"]} | {f["toggle"] for f in res["verdict"]["mechanism"]}
    assert LEN1 not in named


@pytest.mark.slow           # a few minutes on a busy 2-core machine: CI runs it in make test-slow
def test_the_suggested_lengths_name_each_bugs_period(plugin):
    """Bugs tied to other periods of the config than 4 -- a multiple of the window (32), of
    the larger ratio (128), the one length 384 -- and the residue-3 bug, run at the lengths
    the verdict suggests for a toggle that acted at 384 only (384 and 384 + each period):
    each is read as its own period, the one-length bug as that length alone."""
    from fidelity.design.lengths import Boundaries, separating_lengths
    w, _ = load_weights(None)
    lengths = separating_lengths([384], Boundaries.of(w.cfg))
    assert lengths == [384, 385, 388, 416, 448, 512]
    bugs = ["mut_ape_shift_mult32", "mut_ape_shift_mult128", "mut_ape_shift_at384", LEN3]
    s = ABSettings.of(arms=bugs, lengths=tuple(lengths), prompts_per_length=1, decode_steps=1,
                      shapley_top=0, n_boot=200)
    v = run_ab(w, s, ReportTarget(None), RunSite(), tokenizer=load_tokenizer_for(None))["verdict"]
    print(v["never_acted_sentence"])
    assert v["acted_only_at"] == {"mut_ape_shift_mult32": [384, 416, 448, 512],
                                  "mut_ape_shift_mult128": [384, 512], "mut_ape_shift_at384": [384]}
    assert LEN3 in v["never_acted"]                     # no length of these is 3 mod 4
    said = v["never_acted_sentence"]
    assert "a condition with period 32 (the window)" in said
    assert "a condition with period 128 (compress ratio 128)" in said
    assert "length 384 alone: lengths sharing its residue mod 4, 32, 64, 128 did not act" in said
    assert v["separating_lengths"] == {}                # this run settles all three


@pytest.mark.slow           # a minute or more on a busy 2-core machine: CI runs it in make test-slow
def test_kld_boundary_grid_places_the_bug_at_residue_3(plugin, capsys, tmp_path):
    """`fidelity kld --lengths boundaries`: the same grid, the residue table in the report
    and on stdout, breaking at 3 mod 4 only."""
    rc = main(["kld", "--plugin", str(BUGS), "--arm", "golden=golden", "--arm",
               f"bug={LEN3}", "--lengths", "boundaries", "--depths", "50", "--decode-steps", "2",
               "--out", str(tmp_path), "--run-id", "k", "--quiet"])
    cap = capsys.readouterr()
    assert rc == kld_exit(tmp_path / "kld" / "k"), cap.err       # 1: the verdict names the bug
    assert "answer KLD by length residue" in cap.out
    t = pd.read_csv(tmp_path / "kld" / "k" / "residues.csv")
    assert sorted(t.lengths) == [255, 256, 257, 258]
    assert broken_residues(t, "bug") == ["3 mod 4"]
    assert (t[t.residue != "3 mod 4"]["max"] == 0).all()
    assert "By length residue" in (tmp_path / "kld" / "k" / "summary.md").read_text()


def test_needle_boundary_grid_with_window_edge_depths(capsys, tmp_path):
    """`fidelity needle --lengths boundaries`: lengths 255..258 and, per length, the depth
    that puts the needle just outside the 32-token window (on the tiny model the text after
    a needle placed right before the question is already longer than the window, so 'just
    inside' cannot be built and is left out); recall
    per residue and inside/outside the window in the report."""
    rc = main(["needle", "--arm", "golden", "--lengths", "boundaries", "--depths", "50",
               "--out", str(tmp_path), "--run-id", "n", "--no-plots", "--quiet"])
    cap = capsys.readouterr()
    assert rc == 0, cap.err
    assert "window-edge needle depths (window 32" in cap.err
    rows = [json.loads(x) for x in (tmp_path / "needle" / "results.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "arm" in r]
    assert sorted({(r["length"], r["depth"]) for r in rows}) == [
        (L, d) for L in (255, 256, 257, 258) for d in (50.0, 100.0)]
    t = json.loads((tmp_path / "needle" / "n" / "summary.json").read_text())["tables"]
    assert [r["residue"] for r in t["residues"]] == ["0 mod 4", "1 mod 4", "2 mod 4", "3 mod 4"]
    assert [r["side"] for r in t["window"]] == ["outside"] and t["window"][0]["distance_min"] >= 32
    assert t["window"][0]["n_scored"] == len(rows)


def test_needle_boundaries_without_a_config_is_a_named_error(capsys, tmp_path):
    rc = main(["needle", "--endpoint", "x=http://127.0.0.1:9/v1", "--lengths", "boundaries",
               "--out", str(tmp_path)])
    assert rc == 2 and "give --checkpoint" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
