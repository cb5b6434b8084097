"""The harder needle kinds (issue 21): multiquery (several keys, all asked for at once,
RULER's niah_multiquery) and multikey with near-duplicate distractor keys. Exact lengths,
placement, key properties, determinism, scoring, resume, and short sweeps in-process on
the embedded model and over HTTP against the stub server."""
import json
import random
import re

import pytest

from fidelity.cli import main
from needle import keys as K
from needle.haystack import (HaystackError, HaystackSpec, LocalCounter, PromptFormat, build_prompt,
                             query_text, trial_seed)
from needle.results import read_rows
from needle.scoring import SCORED, score
from needle.stub import StubServer
from needle.sweep import SweepConfig, run_sweep
from needle.tables import all_tables
from needle.words import ADJECTIVES, NOUNS
from reference_model.tokenizer import load_tokenizer

MQ = HaystackSpec("multiquery")
NEAR = HaystackSpec("multikey", distractors="near")
NEEDLE = re.compile(r"One of the special magic \w+ for ([a-z]+-[a-z]+) is: ([0-9a-z-]+)\.")


@pytest.fixture(scope="module")
def counter():
    return LocalCounter(load_tokenizer())


@pytest.mark.parametrize("mode", ["chat", "completion"])
@pytest.mark.parametrize("spec,short", [(MQ, 320), (HaystackSpec("multiquery", "uuid", "noise", n_keys=5, n_queries=3), 500),
                                        (NEAR, 300), (HaystackSpec("multikey", "word", "noise", distractors="near"), 330)])
def test_exact_lengths(counter, spec, short, mode):
    """Every prompt has exactly the requested token count and a span per expected value
    (`short`: just above the chat prompt's minimum; completion repeats the keys in the
    answer prefix)."""
    for L in (short + (90 if mode == "completion" else 0), 1000, 4000):
        for d in (0, 50, 100):
            p = build_prompt(spec, PromptFormat(mode), counter, L, d, trial_seed(spec.kind, L, d))
            assert len(counter.tok.encode(p.text)) == L == p.n_tokens and p.exact, (L, d)
            assert sorted(p.text[a:b] for a, b in p.value_spans) == sorted(p.expected)


def test_multiquery_prompt_asks_for_every_queried_key(counter):
    spec = HaystackSpec("multiquery", n_keys=6, n_queries=3)
    p = build_prompt(spec, PromptFormat("completion"), counter, 1200, 40, 9)
    assert len(p.keys) == len(p.expected) == 3 and len(p.distractor_keys) == len(p.distractors) == 3
    found = dict(NEEDLE.findall(p.text))
    assert sorted(found) == sorted(p.keys + p.distractor_keys)          # one needle per key
    assert [found[k] for k in p.keys] == p.expected
    assert [found[k] for k in p.distractor_keys] == p.distractors
    q = f"{p.keys[0]}, {p.keys[1]}, and {p.keys[2]}"
    assert p.key == q and f"What are all the special magic numbers for {q} mentioned in the provided text?" in p.text
    assert p.text.endswith(f"The special magic numbers for {q} mentioned in the provided text are")
    assert not any(K.overlaps(a, b) for a in found for b in found if a != b)
    assert query_text(["a-b"]) == "a-b" and query_text(["a-b", "c-d"]) == "a-b, and c-d"


@pytest.mark.parametrize("depth", [0, 50, 100])
def test_multiquery_needles_sit_around_the_depth(counter, depth):
    """The queried needles take the sentence boundaries nearest the depth, one each."""
    p = build_prompt(MQ, PromptFormat(), counter, 4000, depth, 3)
    assert len(p.needle_depths) == 4 and p.depth_chars == p.needle_depths[0]
    assert all(abs(x - depth / 100) < 0.05 for x in p.needle_depths), p.needle_depths
    ctx = p.user[p.user.index("\n") + 1:p.user.rindex("\n")]
    parts = NEEDLE.split(ctx)                       # filler, key, value, filler, ...
    between = parts[3:-1:3]
    assert between and all(s.strip() for s in between)   # filler between consecutive needles


def test_near_duplicate_keys_properties():
    rng = random.Random(0)
    for _ in range(300):
        key = K.random_key(rng)
        adj, noun = key.split("-")
        near = K.near_keys(key, 7, rng)
        assert len(set(near)) == 7 and key not in near
        assert not any(K.overlaps(key, k) for k in near)       # never inside one another
        for k in near:
            a, n = k.split("-")
            assert (a == adj) != (n == noun)                   # exactly one word differs
            other, mine = (n, noun) if a == adj else (a, adj)
            assert other in NOUNS + ADJECTIVES or _one_edit(other, mine), (key, k)
        fams = K.near_candidates(key)
        assert [next(i for i, f in enumerate(fams) if k in f) for k in near[:4]] == [0, 1, 2, 3]


def _one_edit(a: str, b: str) -> bool:
    """a and b differ by one substitution, insertion or adjacent swap."""
    if len(a) == len(b):
        diff = [i for i in range(len(a)) if a[i] != b[i]]
        return len(diff) == 1 or (len(diff) == 2 and diff[1] == diff[0] + 1 and
                                  a[diff[0]] == b[diff[1]] and a[diff[1]] == b[diff[0]])
    s, t = sorted((a, b), key=len)
    return len(t) == len(s) + 1 and any(t[:i] + t[i + 1:] == s for i in range(len(t)))


@pytest.mark.parametrize("vtype", ["number", "word", "uuid"])
def test_near_prompt_values_have_the_same_shape(counter, vtype):
    for seed in range(20):
        p = build_prompt(HaystackSpec("multikey", vtype, distractors="near", n_keys=5), PromptFormat(),
                         counter, 700, 50, seed)
        found = dict(NEEDLE.findall(p.text))
        assert sorted(found) == sorted(p.keys + p.distractor_keys) and len(found) == 5
        assert all(p.key not in k for k in p.distractor_keys)
        assert p.text.count(f"for {p.key} is:") == 1 and p.text.count(p.key) == 2   # needle + question
        assert {len(v) for v in p.distractors} == {len(p.expected[0])}
        assert len(set(p.distractors + p.expected)) == 5


def test_deterministic_and_recorded_in_trial_settings(counter):
    for spec in (MQ, NEAR):
        a = build_prompt(spec, PromptFormat(), counter, 600, 30, 77)
        b = build_prompt(spec, PromptFormat(), counter, 600, 30, 77)
        c = build_prompt(spec, PromptFormat(), counter, 600, 30, 78)
        assert (a.text, a.distractor_keys, a.value_spans) == (b.text, b.distractor_keys, b.value_spans)
        assert a.text != c.text
    # the earlier kinds' settings (and so their trial ids) do not mention the new options
    assert "n_queries" not in HaystackSpec("multikey").to_dict()
    assert "distractors" not in HaystackSpec("multikey").to_dict()
    assert MQ.to_dict()["n_queries"] == 4 and NEAR.to_dict()["distractors"] == "near"
    ids = [{t.trial_id for t in SweepConfig([400], [50], spec=s).plan()}
           for s in (HaystackSpec("multikey"), NEAR, MQ)]
    assert not (ids[0] & ids[1]) and not (ids[1] & ids[2])


def test_bad_options_are_clear_errors():
    with pytest.raises(HaystackError, match="near distractors are for kind multikey"):
        HaystackSpec("multiquery", distractors="near")
    with pytest.raises(HaystackError, match="n_queries <= n_keys"):
        HaystackSpec("multiquery", n_queries=5)
    with pytest.raises(HaystackError, match="distractors must be one of random, near"):
        HaystackSpec("multikey", distractors="close")


@pytest.mark.parametrize("content,outcome,recall", [
    ("1111111, 2222222, 3333333 and 4444444.", "correct", 1.0),
    ("They are 4444444 and 2222222.", "partial", 0.5),
    ("3333333", "partial", 0.25),
    ("It is 5555555.", "wrong", 0.0),                 # an unqueried needle's value
    ("I do not know.", "other", 0.0),
])
def test_multiquery_scoring(content, outcome, recall):
    s = score(["1111111", "2222222", "3333333", "4444444"], content, "stop", None, ["5555555"],
              "number", ["red-fox", "blue-owl", "tall-oak", "dry-elm", "wet-ash"])
    assert (s.outcome, s.recall) == (outcome, recall)


def test_near_scoring_a_distractors_value_is_wrong(counter):
    p = build_prompt(HaystackSpec("multikey", "word", distractors="near"), PromptFormat(), counter, 600, 50, 4)
    keys = p.keys + p.distractor_keys
    for d in p.distractors:
        s = score(p.expected, f"The word for {p.key} is {d}.", "stop", None, p.distractors, "word", keys)
        assert (s.outcome, s.recall) == ("wrong", 0.0)
    s = score(p.expected, f"It is {p.expected[0]}.", "stop", None, p.distractors, "word", keys)
    assert s.outcome == "correct"
    # naming a near-duplicate key is not naming a value
    s = score(p.expected, f"Maybe {p.distractor_keys[0]}?", "stop", None, p.distractors, "word", keys)
    assert s.outcome == "other"


@pytest.fixture(scope="module")
def golden():
    from fidelity.design.arms import parse_arm
    from fidelity.needle_run.runner import InProcessRunner
    from fidelity.weights.target import load_target
    return InProcessRunner("golden", load_target("models/tiny-needle"), parse_arm("golden"))


@pytest.mark.parametrize("spec", [MQ, NEAR], ids=["multiquery", "near"])
def test_inprocess_sweep_on_the_embedded_model(golden, spec, tmp_path):
    rows = run_sweep(SweepConfig([384, 449], [0, 100], spec=spec), [golden], tmp_path / "r.jsonl", quiet=True)
    assert len(rows) == 4 and all(r["outcome"] in SCORED for r in rows)
    assert all(r["n_tokens"] == r["prompt_tokens_reported"] == r["length"] and r["exact_length"] for r in rows)
    n = 4 if spec.kind == "multiquery" else 1
    for r in rows:
        assert r["kind"] == spec.kind and r["distractor_mode"] == spec.distractors
        assert len(r["expected"]) == len(r["keys"]) == len(r["needle_depths"]) == n
        assert len(r["value_token_positions"]) == 7 * n         # 7 digits, one token each
        for m in r["mechanism"]:
            assert m["n_values"] == n and 0 <= m["values_in_topk"] <= n
            assert m["in_topk"] == (m["values_in_topk"] > 0)
    header, _ = read_rows(tmp_path / "r.jsonl")
    assert header["trials"]["spec"]["kind"] == spec.kind
    t = all_tables(rows)
    assert [k["kind"] for k in t["kinds"]] == [spec.kind + ("/near" if spec.distractors == "near" else "")]
    for m in t["mechanism"]:
        assert m["all_values_in_topk_rate"] <= m["in_topk_rate"]
        assert n > 1 or m["all_values_in_topk_rate"] == m["in_topk_rate"]


def test_http_sweeps_resume_and_do_not_mix_kinds(tmp_path, capsys):
    """Over HTTP (the stub reads every asked key's needle back), through the CLI: exact
    lengths by /tokenize, all correct, resume runs nothing twice, another kind in the same
    results file is refused, and the report has a table per kind."""
    out = tmp_path / "o"
    base = ["--lengths", "384,449", "--depths", "0,100", "--out", str(out), "--no-plots", "--quiet"]
    with StubServer(tokenizer=load_tokenizer(), wrong_every=0) as s:
        assert main(["needle", "--endpoint", f"stub={s.url}", "--kind", "multiquery", *base]) == 0
        assert s.requests == 4
        assert main(["needle", "--endpoint", f"stub={s.url}", "--kind", "multiquery", *base]) == 0
        assert s.requests == 4                                   # resumed: nothing to run
        assert main(["needle", "--endpoint", f"stub={s.url}", "--kind", "multikey",
                     "--distractors", "near", *base]) == 2
        assert "different trial settings" in capsys.readouterr().err
        res = tmp_path / "near.jsonl"
        assert main(["needle", "--endpoint", f"stub={s.url}", "--kind", "multikey", "--distractors", "near",
                     "--n-keys", "5", "--results", str(res), *base]) == 0
    _, mq = read_rows(out / "needle" / "results.jsonl")
    header, near = read_rows(res)
    assert header["trials"]["spec"]["distractors"] == "near" and header["trials"]["spec"]["n_keys"] == 5
    for rows, n in ((mq, 4), (near, 1)):
        assert len(rows) == 4 and all(r["outcome"] == "correct" and r["recall"] == 1.0 for r in rows)
        assert all(r["token_residual"] == 0 and r["exact_length"] and len(r["expected"]) == n for r in rows)
    assert all(len(r["distractor_keys"]) == 4 for r in near)
    summary = json.loads((out / "needle" / "latest" / "summary.json").read_text())
    (kind,) = summary["tables"]["kinds"]
    assert (kind["kind"], kind["values_per_trial"], kind["all_found_rate"]) == ("multikey/near", 1, 1.0)
