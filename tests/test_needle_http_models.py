"""`fidelity needle` against one real `fidelity serve` process serving two arms whose
answers differ (golden, and `engine` = a plugin toggle that moves every logit to the next
token id), reached through a proxy that records and spoils requests: each endpoint arm
queries its own model (chat and /tokenize), rows say which model answered, an arm that
names no served model fails naming them; and prompt building needs far fewer /tokenize
calls than doubling-then-bisecting, with exact lengths by the server's own count."""
import json
from collections import Counter

import httpx
import pytest

from fidelity.cli import main
from infra.http import ModelChoiceError
from needle.haystack import HaystackSpec, PromptFormat, _Builder
from needle.http import HttpRunner
from needle.results import latest, read_rows
from needle.sweep import SweepConfig
from reference_model.tokenizer import load_tokenizer

from fault_proxy import FaultProxy
from needle_util import served

PLUGIN = """
import torch
from kernel_toggles import toggle
@toggle("logits_rolled", kernel="lm_head", category="known-bug", wraps=True,
        description="Test arm: every logit moved to the next token id (answers change).")
def _rolled(golden, x, w):
    return torch.roll(golden.lm_head(x, w), 1, -1)
"""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    plug = tmp_path_factory.mktemp("plugin") / "rolled.py"
    plug.write_text(PLUGIN)
    with served("golden", extra=("--plugin", str(plug), "--arm", "golden=golden",
                                 "--arm", "engine=logits_rolled")) as (u,):
        yield u


def _needle(tmp_path, *args):
    return main(["needle", *args, "--temperature", "0", "--max-tokens", "12", "--retries", "3",
                 "--out", str(tmp_path), "--no-plots", "--quiet"])


def test_two_endpoint_arms_on_one_server_query_their_own_models(url, tmp_path):
    with FaultProxy(url) as px:
        rc = _needle(tmp_path, "--endpoint", f"golden={px.url}/v1", "--endpoint", f"engine={px.url}/v1",
                     "--lengths", "400", "--depths", "25,75")
        chats = px.bodies("/v1/chat/completions")
        toks = px.bodies("/tokenize")
    assert rc == 0
    header, rows = read_rows(tmp_path / "needle" / "results.jsonl")
    rows = latest(rows)
    assert [a["model"] for a in header["arms"]] == ["golden", "engine"]
    assert Counter(b["model"] for b in chats) == {"golden": 2, "engine": 2}
    assert toks and all(b["model"] == "golden" for b in toks)     # prompts sized once, first arm
    assert len(rows) == 4 and all(r["model"] == r["model_requested"] == r["arm"] for r in rows)
    # each row holds its own model's answer: the same requests sent straight to the server
    direct = set()
    for b in chats:
        r = httpx.post(url + "/v1/chat/completions", json=b, timeout=600).json()
        direct.add((r["model"], r["choices"][0]["message"]["content"]))
    assert {(r["arm"], r["response"]) for r in rows} == direct
    by_trial = {}
    for r in rows:
        by_trial.setdefault(r["trial_id"], {})[r["arm"]] = r["response"]
    assert all(v["golden"] != v["engine"] for v in by_trial.values())   # the arms really differ


def test_an_arm_naming_no_served_model_fails_naming_them(url, tmp_path, capsys):
    rc = _needle(tmp_path, "--endpoint", f"a={url}/v1", "--endpoint", f"b={url}/v1",
                 "--lengths", "400", "--depths", "50")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "endpoint 'a': the server serves 2 models (golden, engine) and none is named 'a'" in err
    assert HttpRunner("b", url + "/v1", model="engine").discover_model() == "engine"
    with pytest.raises(ModelChoiceError, match=r"model 'nope' is not served \(served: golden, engine\)"):
        HttpRunner("b", url + "/v1", model="nope").discover_model()
    rc = _needle(tmp_path, "--endpoint", f"a={url}/v1", "--model", "c=golden", "--lengths", "400")
    assert rc == 2 and "--model 'c=golden': expected ARM=MODEL" in capsys.readouterr().err


def _doubling_bisection_calls(cfg: SweepConfig, tok) -> int:
    """Counts the earlier search made for the same prompts (an independent re-statement:
    f(0), doubling from 16 words, then bisection; then the same character search)."""
    total = 0
    for t in cfg.plan():
        b = _Builder(cfg.spec, cfg.fmt, t.depth, t.seed)
        seen = {}

        def f(w):
            if w not in seen:
                seen[w] = tok.count(b.render(w).text)
            return seen[w]
        f(0)
        lo, hi = 0, 16
        while f(hi) <= t.length:
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if f(mid) <= t.length else (lo, mid)
        total += len(seen)
    return total


def test_prompt_building_needs_few_tokenize_calls_even_through_faults(url, tmp_path):
    cfg = SweepConfig(lengths=[400, 800], depths=[0, 50, 100], spec=HaystackSpec(), fmt=PromptFormat())
    with FaultProxy(url, {"/tokenize": ["500", "drop", "ok", "ok", "502"]}) as px:
        rc = _needle(tmp_path, "--endpoint", f"golden={px.url}/v1", "--lengths", "400,800",
                     "--depths", "0,50,100")
        calls = px.count("/tokenize")
    assert rc == 0
    _, rows = read_rows(tmp_path / "needle" / "results.jsonl")
    # the server's own usage.prompt_tokens says every prompt has the requested length
    assert len(rows) == 6 and all(r["prompt_tokens_reported"] == r["length"] and r["exact_length"]
                                  for r in rows)
    before = _doubling_bisection_calls(cfg, load_tokenizer())      # w search alone: a lower bound
    print(json.dumps({"tokenize_calls": calls, "doubling_bisection_word_search": before}))
    assert calls - 3 <= before / 2                                  # 3 faulty answers retried
