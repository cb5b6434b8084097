"""An engine that returns NaN or infinite logits is a finding, never a perfect score:
llama-server writes a non-finite log-prob as JSON null; read as NaN, its positions have no
KL bound (NaN, not 0), and the verdict names the arm by the `nonfinite` signal (found by
a planted YaRN bug whose llama-server returned nulls everywhere: KLD 0 against every arm)."""
import numpy as np
import pandas as pd

from fidelity.scores.bounds import Known, compare
from fidelity.servers.llamacpp import entry_known
from fidelity.verdict.judge import Bootstrap, Design, judge
from fidelity.verdict.signals import http_signals


def test_null_logprobs_are_non_finite_not_missing():
    tok, k = entry_known({"id": 3, "logprob": None, "top_logprobs": [{"id": 3, "logprob": None},
                                                                     {"id": 5, "logprob": None}]})
    assert tok == 3 and sorted(k.ids) == [3, 5] and np.isnan(k.logp).all()
    base = Known(np.arange(8), np.log(np.full(8, 1 / 8)))
    r = compare(base, k, 3)
    assert r["nonfinite"] and np.isnan(r["kl_lb"]) and r["same_top1"] is False
    ok = compare(base, base, 3)
    assert not ok["nonfinite"] and ok["kl_lb"] == 0.0


def test_the_verdict_names_an_arm_whose_logits_are_not_finite():
    rows = []
    for prompt in range(6):
        # the floor non-finite too at some positions (an engine scored again against itself
        # is as broken as the engine): no noise makes logits non-finite, its floor stays 0
        for arm in ("broken", "fine", "floor:x"):
            for pos in range(20):
                bad = arm == "broken" or (arm == "floor:x" and pos % 5 == 0)
                rows.append({"arm": arm, "prompt": f"p{prompt}", "phase": "prefill", "position": pos,
                             "kl_lb": np.nan if bad else 1e-6 * (1 + pos % 3), "same_top1": not bad,
                             "nonfinite": bad})
    sig = http_signals({"positions": pd.DataFrame(rows), "captures": pd.DataFrame()})
    v = judge(sig, Design("base", {"broken": frozenset({"broken"}), "fine": frozenset({"fine"})},
                          ["broken", "fine"], ["floor:x"]), Bootstrap(200, 0))["verdict"]
    assert [n["toggle"] for n in v["named"]] == ["broken"]
    assert "nonfinite" in v["named"][0]["signals"] and v["sentence"].startswith("broken breaks coherence")
    assert "above the highest floor's 0 (no noise makes logits non-finite)" in v["sentence"]
