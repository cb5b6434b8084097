"""The boundary grid (fidelity.design.lengths) against hand-derived lengths, on the embedded
model's config and on DeepSeek-V4-Flash's shipped config shape; --lengths parsing and its
errors in ab, kld and needle; the per-residue tables of ab/kld and needle on
hand-built signals."""
import pandas as pd
import pytest

from fidelity.cli import main
from fidelity.design.lengths import (Boundaries, LengthsError, LengthSpec, boundary_grid, default_max,
                              label_length, needle_window_depths, parse_lengths, resolve)
from fidelity.verdict.residues import broken_residues, residue_table
from fidelity.weights.source import EMBEDDED, checkpoint_config
from needle.tables import by_residue, by_window
from reference_model.config import ModelConfig
from test_config import HF_FLASH


@pytest.fixture(scope="module")
def tiny():
    cfg = checkpoint_config(None)          # models/tiny-needle/config.json
    assert EMBEDDED.name == "tiny-needle"
    return cfg


@pytest.fixture(scope="module")
def flash():
    return ModelConfig.from_dict(HF_FLASH)


# ---- parsing -------------------------------------------------------------------------------
def test_parse_lengths():
    assert parse_lengths("250,511") == LengthSpec(lengths=(250, 511))
    assert parse_lengths("boundaries") == LengthSpec(boundaries=True)
    assert parse_lengths("boundaries:4096") == LengthSpec(boundaries=True, max_len=4096)
    assert str(parse_lengths("boundaries:4096")) == "boundaries:4096"


@pytest.mark.parametrize("text,says", [
    ("boundary", "comma-separated integers"), ("boundaries:", "MAX"), ("boundaries:x", "MAX"),
    ("boundaries:1", "MAX >= 2"), ("250,abc", "comma-separated integers"), ("", "no lengths"),
    ("250,1", "at least 2 tokens")])
def test_bad_lengths_are_named(text, says):
    with pytest.raises(LengthsError, match=says) as e:
        parse_lengths(text)
    assert "--lengths" in str(e.value)


@pytest.mark.parametrize("command", [["ab"], ["kld", "--arm", "golden=golden"], ["needle"]])
def test_commands_refuse_a_bad_lengths_value(command, capsys, tmp_path):
    with pytest.raises(SystemExit) as e:
        main([*command, "--lengths", "boundaries:abc", "--out", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "boundaries:MAX needs an integer MAX" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("command", [["ab"], ["kld"], ["needle"]])
def test_help_names_the_boundary_grid(command, capsys):
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    assert "boundaries:MAX" in capsys.readouterr().out


# ---- the grid on the embedded (tiny) config: window 32, ratios 4 and 128, index_topk 16 --------
def test_tiny_boundaries(tiny):
    b = Boundaries.of(tiny)
    assert (b.window, b.ratios, b.index_topk, b.index_ratios, b.modulus) == (32, (4, 128), 16, (4,), 4)
    assert b.index_capacities == [(4, 64)]                          # 16 entries x 4 tokens
    assert Boundaries.of(tiny.to_dict()) == b                       # ab's manifest config
    from dataclasses import asdict
    import json
    assert Boundaries.from_dict(json.loads(json.dumps(asdict(b)))) == b   # kld's and needle's


def test_tiny_grid_without_a_minimum(tiny):
    # cap 2 x 128 + 2 = 258; blocks A-1..A+2 around 4 (first CSA entry), 32 (window),
    # 128 and 256 (HCA groups), and 63..68 around 64 = index_topk x 4 (68: 17 entries > 16)
    assert default_max(Boundaries.of(tiny)) == 258
    pts, dropped = boundary_grid(tiny)
    assert [p.length for p in pts] == [3, 4, 5, 6, 31, 32, 33, 34, 63, 64, 65, 66, 67, 68,
                                       127, 128, 129, 130, 255, 256, 257, 258]
    assert dropped == []
    lab = {p.length: p.boundary for p in pts}
    assert lab[33] == "window 32+1" and lab[68] == "index_topk x4 64+4" and lab[255] == "2x128-1"
    assert lab[4] == "ratio 4"


def test_tiny_grid_above_the_shortest_haystack(tiny):
    # a tiny-model haystack needs ~170 tokens: cap 2 x 173 + 2 = 348, one block left
    lengths, pts, note = resolve(parse_lengths("boundaries"), tiny, min_len=173)
    assert lengths == [255, 256, 257, 258]
    assert [p.residue for p in pts] == [3, 0, 1, 2]
    assert "left out 18" in note and "31, 32, 33" in note


def test_explicit_cap_and_nothing_left(tiny):
    lengths, _, note = resolve(parse_lengths("boundaries:129"), tiny)
    assert lengths[-3:] == [127, 128, 129] and "130" in note      # a block cut by the cap is said
    with pytest.raises(LengthsError, match="no boundary length between 200"):
        resolve(parse_lengths("boundaries:190"), tiny, min_len=200)


# ---- the grid on V4-Flash's config.json: window 128, ratios 4 and 128, index_topk 512 -------
def test_flash_grid(flash):
    b = Boundaries.of(flash)
    assert (b.window, b.ratios, b.index_capacities) == (128, (4, 128), [(4, 2048)])
    lengths, pts, note = resolve(parse_lengths("boundaries"), flash, min_len=100)
    # cap 2 x 2048 + 2; 128 is both the window and the first HCA group; 2048 both
    # index_topk x 4 and 16 x 128
    assert lengths == [127, 128, 129, 130, 255, 256, 257, 258, 511, 512, 513, 514,
                       1023, 1024, 1025, 1026, 2047, 2048, 2049, 2050, 2051, 2052,
                       4095, 4096, 4097, 4098]
    assert note.endswith("3, 4, 5, 6")                             # below the shortest prompt
    lab = {p.length: p.boundary for p in pts}
    assert lab[129] == "window 128+1; 1x128+1"
    assert lab[2052] == "index_topk x4 2048+4"                     # 513 entries > 512
    assert lab[2047] == "index_topk x4 2048-1; 16x128-1"
    assert lengths == [L for L in lengths if L <= 4098]
    assert resolve(parse_lengths("boundaries:1024"), flash, 100)[0][-2:] == [1023, 1024]


def test_every_block_covers_every_residue(flash, tiny):
    for cfg in (flash, tiny):
        pts, _ = boundary_grid(cfg)
        for A in (128, 256) if cfg is tiny else (128, 512, 2048, 4096):
            assert {p.residue for p in pts if A - 1 <= p.length <= A + 2} == {0, 1, 2, 3}


def test_labels_of_the_default_lengths(tiny):
    b = Boundaries.of(tiny)
    assert label_length(250, b) == "" and label_length(511, b) == "4x128-1"
    assert label_length(1023, b) == "8x128-1"


# ---- needle depths around the window edge ---------------------------------------------------
def test_needle_window_depths():
    # 60 tokens without filler, 20 follow the needle at depth 100: at 2048 tokens the
    # filler is 1988; inside = 96 tokens from the end -> 100 (1 - 76/1988) = 96.2,
    # outside = 160 -> 100 (1 - 140/1988) = 93.0
    assert needle_window_depths(2048, 128, 60, 20) == [(96.2, "inside"), (93.0, "outside")]
    # the tiny model: 47 tokens follow the needle, more than the 32-token window
    assert needle_window_depths(300, 32, 160, 47) == [(100.0, "outside")]
    # too little filler to get outside: only inside (needle at the context start)
    assert needle_window_depths(130, 128, 60, 20) == [(0.0, "inside")]


# ---- per-residue tables ---------------------------------------------------------------------
def _sig(values: dict) -> pd.DataFrame:
    return pd.DataFrame([{"arm": a, "prompt": p, "signal": "answer_kld", "where": "final logits",
                          "value": v} for (a, p), v in values.items()])


def test_residue_table_counts_the_prompts_the_verdict_counts():
    """A prompt breaks at 10x the largest floor on it (fidelity.verdict.tail.broken), in the
    table as in the verdict's tail test: 5x is not a break, and the two counts agree."""
    from fidelity.verdict.tail import tail_tests
    lengths = {"a": 255, "b": 256, "c": 511, "d": 257, "e": 259}
    v = {("floor:x", "a"): 0.01, ("floor:x", "b"): 0.02, ("floor:x", "c"): 0.01, ("floor:x", "d"): 0.0,
         ("floor:y", "a"): 0.03, ("floor:y", "b"): 0.0, ("floor:y", "c"): 0.0, ("floor:y", "d"): 0.0,
         ("floor:x", "e"): 0.01, ("floor:y", "e"): 0.0,
         ("bug", "a"): 0.5, ("bug", "b"): 0.01, ("bug", "c"): 0.2, ("bug", "d"): 0.0, ("bug", "e"): 0.05}
    sig = _sig(v)
    t = residue_table(sig, lengths, ["bug"], ["floor:x", "floor:y"], Boundaries(32, (4, 128), 16, (4,)))
    row = t.set_index("residue").loc["3 mod 4"]
    assert (row.lengths, row.prompts, row.breaks) == ("255,259,511", 3, 2)   # 16.7x, 20x; 5x is not
    assert row.floor_max == pytest.approx(0.03) and row["max"] == pytest.approx(0.5)
    assert t.set_index("residue").loc["0 mod 4"].breaks == 0          # 0.01 < 0.02
    assert t.set_index("residue").loc["1 mod 4"].breaks == 0          # 0 on a floor of 0: no break
    assert broken_residues(t, "bug") == ["3 mod 4"]                   # 2 of its 3 prompts
    tail = tail_tests(sig, {"bug": frozenset({"bug"})}, ["floor:x", "floor:y"])
    assert int(tail.set_index("signal").loc["answer_kld", "b"]) == int(t.breaks.sum()) == 2


def test_a_scheduled_arm_breaks_against_the_serving_floors_and_its_one_shot_arm():
    """A scheduled arm is judged against the serving floors (every floor but QAT's) and its
    own one-shot arm on the same prompt, in the residue table as in the verdict's tail: the
    table once judged every arm against QAT's too (0 broken there, 2 in the verdict), and
    the tail once named a toggle under a schedule whose one-shot arm broke the same prompts'
    values 0 times against QAT (its serving floors are lower, not the schedule worse)."""
    from fidelity.verdict.signals import QAT_FLOOR, SCHEDULE_FACTOR
    from fidelity.verdict.tail import tail_tests
    lengths = {"a": 255, "b": 259, "c": 256}
    v = {(QAT_FLOOR, p): 0.5 for p in lengths} | {("floor:x", p): 0.001 for p in lengths}
    v |= {("t@S", "a"): 0.1, ("t@S", "b"): 0.2, ("t@S", "c"): 0.005, ("t", "a"): 0.1, ("t", "b"): 0.2, ("t", "c"): 0.0,
          ("u@S", "a"): 0.1, ("u@S", "b"): 0.2, ("u@S", "c"): 0.005, ("u", "a"): 0.0, ("u", "b"): 0.001, ("u", "c"): 0.0}
    sig = _sig(v)
    s = SCHEDULE_FACTOR + "chunked(64)"
    arms = {"t@S": frozenset({"t", s}), "t": frozenset({"t"}), "u@S": frozenset({"u", s}), "u": frozenset({"u"})}
    floors = [QAT_FLOOR, "floor:x"]
    t = residue_table(sig, lengths, arms, floors, Boundaries(32, (4, 128), 16, (4,))).set_index(["arm", "residue"])
    tail = tail_tests(sig, arms, floors, serving=["floor:x"]).set_index(["toggle", "schedule"])
    # u: 0.1 and 0.2 against 0.001 (serving) and u's own 0 and 0.001 one-shot: 2 broken under S
    assert t.loc[("u@S", "3 mod 4")].breaks == int(tail.loc[("u", "chunked(64)"), "b"]) == 2
    # t: the same values as its one-shot arm's, so nothing breaks *under* the schedule
    assert t.loc[("t@S", "3 mod 4")].breaks == int(tail.loc[("t", "chunked(64)"), "b"]) == 0
    assert t.loc[("t", "3 mod 4")].breaks == int(tail.loc[("t", ""), "b"]) == 0   # one-shot: QAT's floor
    assert tail.loc[("t", "chunked(64)"), "floor_arm"] == "t"          # the floor holding it is named


def test_a_floor_is_never_a_lone_prompt_near_zero_and_a_clamp_says_so():
    """Each prompt's floor is at least the floors' median over prompts (a prompt where the
    floors happened to land near 0 cannot turn a small value into a break), and only when
    every floor is bit-identical is it FLOOR_EPS, labelled as a clamp."""
    from fidelity.verdict.signals import FLOOR_EPS
    from fidelity.verdict.tail import prompt_floors
    wide = pd.DataFrame({"floor:x": [1e-5, 2e-5, 0.0, 1e-9], "floor:y": [0.0, 1e-5, 0.0, 0.0]},
                        index=list("abcd"))
    value, arm = prompt_floors(wide, ["floor:x", "floor:y"], "answer_kld")
    m = (1e-9 + 1e-5) / 2                                              # median of 1e-5, 2e-5, 0, 1e-9
    assert list(value) == pytest.approx([1e-5, 2e-5, m, m])
    assert list(arm) == ["floor:x", "floor:x", "floors' median over prompts", "floors' median over prompts"]
    zero = pd.DataFrame({"floor:x": [0.0, 0.0]}, index=list("ab"))
    value, arm = prompt_floors(zero, ["floor:x"], "answer_kld")
    assert list(value) == [FLOOR_EPS["answer_kld"]] * 2 and arm.iloc[0].startswith("clamp 1e-06")


def test_needle_residue_and_window_tables():
    rows = [{"arm": "a", "length": L, "outcome": o, "recall": float(o == "correct"),
             "n_tokens": L, "value_token_positions": [L - 1 - d]}
            for L, o, d in ((255, "wrong", 10), (259, "wrong", 40), (256, "correct", 40),
                            (257, "correct", 31), (258, "correct", 32))]
    t = {r["residue"]: r for r in by_residue(rows)}
    assert t["3 mod 4"]["recall"] == 0 and t["3 mod 4"]["lengths"] == "255,259"
    assert t["0 mod 4"]["recall"] == 1 and t["3 mod 4"]["n_scored"] == 2
    w = {r["side"]: r for r in by_window(rows, 32)}
    assert (w["inside"]["n_scored"], w["inside"]["distance_max"]) == (2, 31)   # 10 and 31 <= 31
    assert (w["outside"]["n_scored"], w["outside"]["distance_min"]) == (3, 32)


def test_v41_grid_has_an_anchor_per_indexer_ratio():
    """DeepSeek-V4.1's tiny config: window 16, ratios 2 and 1, index_topk 8, indexers on
    ratio-2 and ratio-1 layers: residues mod 2, capacities 8 x 2 = 16 and 8 x 1 = 8."""
    from reference_model.v41.config import tiny_v41
    b = Boundaries.of(tiny_v41())
    assert (b.modulus, b.index_capacities) == (2, [(2, 16), (1, 8)])
    # blocks A-1..A (mod 2) at 2 and the window 16, A-1..A+2 at each capacity; no larger
    # ratio, so no multiples; length 1 is below the 2-token minimum
    pts, dropped = boundary_grid(tiny_v41())
    assert [p.length for p in pts] == [2, 7, 8, 9, 10, 15, 16, 17, 18] and dropped == [1]


def test_a_length_is_labelled_by_every_period_it_is_a_multiple_of():
    """384 sits on three periods at once (two ratios and the window), 288 on the window and
    ratio 4 only: the per-length table says so, so "0 mod 4" is not read as the only cause."""
    from fidelity.design.lengths import period_label
    from fidelity.verdict.residues import grid_frame
    b = Boundaries(32, (4, 128), 16, (4,))
    assert period_label(384, b) == "3x128 = 6x64 (index_topk x4) = 12x32 (window) = 96x4"
    assert period_label(288, b) == "9x32 (window) = 72x4" and period_label(255, b) == ""
    g = grid_frame([288, 255, 384], b).set_index("length")
    assert g.loc[288, "residue"] == g.loc[384, "residue"] == "0 mod 4" and g.loc[384, "periods"].startswith("3x128")


def test_separating_lengths_and_the_period_they_read():
    """A toggle that acted at 384 only on the boundary grid: the suggested lengths put 384 + p
    beside it for each period (same residue mod p and every period dividing p, another mod the
    larger ones), so the lengths it acts at on the next run name its period. Hand-derived on
    window 32, ratios 4 and 128, index_topk x4 = 64."""
    from fidelity.design.lengths import period_reading, periods, separating_lengths
    b = Boundaries(32, (4, 128), 16, (4,))
    assert periods(b) == [4, 32, 64, 128]
    run = separating_lengths([384], b)
    assert run == [384, 385, 388, 416, 448, 512]
    # each hypothesis acts at its own subset of those lengths; the reading names it
    for p, acts in ((4, [384, 388, 416, 448, 512]), (32, [384, 416, 448, 512]), (64, [384, 448, 512]),
                    (128, [384, 512])):
        said = period_reading(acts, run, b)
        assert f"period {p}" in said and f"0 mod {p}" in said, (p, said)
    said = period_reading([384], run, b)            # none of them: that length alone
    assert said.startswith("length 384 alone") and "4, 32, 64, 128 did not act" in said
    assert "not ruled out" not in said
    # on a grid where nothing shares 384's residue mod 128, period 128 stays open
    said = period_reading([384], [320, 384, 385], b)     # 320 = 5x64: 0 mod 4, 32, 64, not 128
    assert "residue mod 4, 32, 64 did not act" in said and "a period of 128 is not ruled out" in said
    # a residue that is not 0: 255, 259 and 287 act, 256-258 do not -> 3 mod 4 (not 31 mod 32)
    assert "every length 3 mod 4 of this run" in period_reading([255, 259, 287], [255, 256, 257, 258, 259, 287], b)
    assert period_reading([255, 259], [255, 256, 257, 258, 259, 287], b) == ""   # 287 is 3 mod 4 and did not act
    assert period_reading([255, 256], [255, 256, 257], b) == ""          # mixed residues: silent


def test_the_verdict_suggests_the_separating_run(tiny):
    from fidelity.verdict.findings import with_never_acted
    b = Boundaries.of(tiny)
    v = with_never_acted({"sentence": ""}, [], {"t": [384]}, [250, 384, 511], b)
    assert v["separating_lengths"]["t"][0] == 384 and "--lengths 384," in v["never_acted_sentence"]
    # 384 and 512 acted, 448 not tried: periods 64 and 128 both fit -> not settled, asked for
    v = with_never_acted({"sentence": ""}, [], {"t": [384, 512]}, [384, 385, 388, 416, 512], b)
    assert "period 64" in v["never_acted_sentence"] and "or 128: this run cannot tell" in v["never_acted_sentence"]
    assert 448 in v["separating_lengths"]["t"]
    v = with_never_acted({"sentence": ""}, [], {"t": [384, 512]}, [384, 385, 388, 416, 448, 512], b)
    assert v["separating_lengths"] == {} and "a condition with period 128" in v["never_acted_sentence"]
