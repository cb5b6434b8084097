"""Real lm-evaluation-harness (`local-completions`, default tokenizer settings, batch size 4)
against a `fidelity serve` port equals the in-process truth of the golden arm, item by item
(bench/bench_lm_eval.py). lm-eval lives in its own venv, bench/out/evalvenv, which `make
test` does not create: without it this test is skipped."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LM_EVAL = ROOT / "bench" / "out" / "evalvenv" / "bin" / "lm_eval"


@pytest.mark.skipif(not LM_EVAL.exists(), reason="no lm-eval venv (bench/out/evalvenv): "
                    "python bench/bench_lm_eval.py creates it")
def test_lm_eval_on_the_golden_arm_equals_the_in_process_truth(tmp_path):
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_lm_eval.py"), "--arm", "golden",
                        "--out", str(tmp_path), "--results", ""], cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    r = json.loads((tmp_path / "summary.json").read_text())["golden"]
    assert r["tokenizer_backend"] == "remote" and r["n_items"] == 20
    assert r["acc"] == r["truth_acc"] and r["picks_equal"] and r["max_abs_ll_diff"] < 1e-6
    assert r["exact_match"] == r["truth_exact_match"] and r["gens_equal"]
    assert r["eos_after_gold"] > 0          # the items exercise the stop token in echo logprobs
