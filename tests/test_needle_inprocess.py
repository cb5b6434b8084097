"""In-process runner: the mechanism (indexer picks and rank of the needle's compressed
entries at the question position) against an independent full-prefill forward, greedy
and seeded decoding, and a small in-process sweep with its report."""
import json

import pytest
import torch

from fidelity.design.arms import parse_arm
from fidelity.needle_run.runner import InProcessRunner
from fidelity.weights.target import load_target
from needle.haystack import HaystackSpec, PromptFormat, build_prompt
from needle.report import write_report
from needle.sweep import SweepConfig, run_sweep
from reference_model import Model, Numerics, Taps
from reference_model.generate import Sampling, Scoring, generate


@pytest.fixture(scope="module")
def target():
    return load_target()


@pytest.fixture(scope="module")
def golden(target):
    return InProcessRunner("golden", target, parse_arm("golden"), max_tokens=1)


def test_mechanism_against_full_prefill(target, golden):
    p = build_prompt(HaystackSpec(), PromptFormat(), golden.counter(), 300, 30, 3)
    row = golden.run(p, 0)
    ids = target.tokenizer.encode(p.text)
    assert row["prompt_tokens"] == len(ids) == 300
    # the value's tokens, found independently: its 7 digits are 7 consecutive tokens
    digits = [target.tokenizer.encode(ch)[0] for ch in p.expected[0]]
    starts = [i for i in range(len(ids) - 6) if ids[i:i + 7] == digits]
    assert len(starts) == 1 and row["value_token_positions"] == list(range(starts[0], starts[0] + 7))
    # independent forward: one full prefill (no split at the last token), default numerics
    taps = Taps(["layers.*.attn.index.topk"])
    logits, _ = Model(target.weights, Numerics("reference")).extend(torch.tensor(ids), None, "last", taps)
    assert row["response"] == target.tokenizer.decode([int(logits[-1].argmax())]) or \
        row["response"].startswith(target.tokenizer.decode([int(logits[-1].argmax())]))
    visible = len(ids) // 4
    own = {t // 4 for t in row["value_token_positions"]}
    held = sorted(j for j in own | {j + 1 for j in own} if j < visible)
    csa = [i for i, r in enumerate(target.cfg.compress_ratios) if r == 4]
    assert [m["layer"] for m in row["mechanism"]] == csa
    for m in row["mechanism"]:
        picks = taps[f"layers.{m['layer']}.attn.index.topk"][-1]
        picks = {int(j) for j in picks if j >= 0}
        assert set(m["picks"]) == picks and len(picks) == target.cfg.index_topk
        assert m["entries"] == held and m["n_visible"] == visible
        assert m["in_topk"] == any(j in picks for j in held)
        assert (m["best_rank"] <= m["topk"]) == m["in_topk"]      # scores' rank agrees with picks


def test_sampled_decoding_is_seeded(target):
    m = Model(target.weights, Numerics("reference"))
    ids = target.tokenizer.encode("The river keeps talking through the night.")
    a = generate(m, ids, 2, Sampling(1.0, seed=42))
    b = generate(m, ids, 2, Sampling(1.0, seed=42))
    assert a.tokens == b.tokens and len(a.tokens) == 2 and a.finish_reason == "length"
    g = generate(m, ids, 1, Sampling(0.0), Scoring.of_logprobs(3))
    assert g.top_logprobs[0][0][0] == g.tokens[0]                  # greedy = top-1


def test_inprocess_sweep_golden_vs_engine(target, tmp_path):
    runners = [InProcessRunner("golden", target, parse_arm("golden"), max_tokens=1),
               InProcessRunner("engine", target, parse_arm("engine"), max_tokens=1)]
    cfg = SweepConfig(lengths=[259], depths=[100], reps=1)
    rows = run_sweep(cfg, runners, tmp_path / "r.jsonl", quiet=True)
    assert sorted(r["arm"] for r in rows) == ["engine", "golden"]
    assert rows[0]["prompt_sha256"] == rows[1]["prompt_sha256"]           # paired: same prompt
    assert all(r["n_tokens"] == r["prompt_tokens_reported"] == 259 for r in rows)
    assert all(len(r["mechanism"]) == 2 for r in rows)
    assert not any("model_requested" in r for r in rows)     # in-process arms request no model
    out = write_report(rows, tmp_path / "report", {"note": "test"}, with_plots=False)
    t = json.loads((out / "summary.json").read_text())
    assert t["schema_version"] == 1
    assert [(m["arm_b"], m["layer"]) for m in t["tables"]["mechanism_pairs"]] == [
        ("engine", 1), ("engine", 3), ("engine", "all")]
    pooled = t["tables"]["mechanism_pairs"][-1]
    assert pooled["n"] == sum(m["n"] for m in t["tables"]["mechanism_pairs"][:2])


def test_arms_parsing_and_env():
    from fidelity.design.arms import ArmError, arm_from_env, as_arm, engine_arm
    import kernel_toggles as K
    assert parse_arm("").name == parse_arm("golden").name == "golden"
    assert arm_from_env({}).name == "golden"
    assert arm_from_env({"DSV4_FIDELITY_ARM": "engine"}).name == str(K.engine())
    assert engine_arm().name == str(K.engine())
    with pytest.raises(ArmError, match="DSV4_FIDELITY_ARM"):
        arm_from_env({"DSV4_FIDELITY_ARM": "no_such_toggle"})
    ts = K.ToggleSet.parse("lm_head_bf16")
    a = as_arm(ts)
    assert a.name == "lm_head_bf16" and a.numerics().replaced == ts.numerics().replaced
    f = as_arm(lambda profile="reference": Numerics(profile))
    assert isinstance(f.numerics(), Numerics)
