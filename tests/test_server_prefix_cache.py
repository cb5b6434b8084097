"""`fidelity serve`'s prefix cache, as a real process: a hit gives the golden arm the same
greedy tokens and output logprobs as a cold request (and as the in-process golden); the
cached prompt tokens are reported as the engines report them (0 cold, the page-aligned
prefix on a hit); a flush makes the next request cold; eviction keeps the cache under its
byte budget; a served arm with a planted restore bug answers as the golden cold and
differently on a hit; bad options are clear errors."""
import subprocess

import httpx
import pytest
import torch

from fidelity.weights.target import load_target
from reference_model import Model
from reference_model.generate import Scoring, generate

from needle_util import ROOT, fidelity_cmd, ok, served

PAGE = 40
DEFAULT = load_target(None)
GEN = torch.Generator().manual_seed(22)
A = [int(i) for i in torch.randint(3, 500, (200,), generator=GEN)]
B = A[:170] + [int(i) for i in torch.randint(3, 500, (30,), generator=GEN)]   # shares 170


@pytest.fixture(scope="module")
def url():
    with served("golden", extra=("--arm", "golden=golden", "--arm",
                                 "bug=restore_drops_compressor_pending", "--default-arm", "golden",
                                 "--page-size", str(PAGE))) as (u,):
        yield u


def _complete(url, model, ids, n=4):
    r = ok(httpx.post(url + "/v1/completions", json={
        "model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "logprobs": 2,
        "ignore_eos": True}, timeout=300))
    c = r["choices"][0]
    return (c["logprobs"]["tokens"], c["logprobs"]["token_logprobs"],
            r["usage"]["prompt_tokens_details"]["cached_tokens"])


def _flush(url):
    r = httpx.post(url + "/flush_cache", timeout=30)
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")


def _inprocess(ids, n=4):
    g = generate(Model(DEFAULT.weights), ids, n, scoring=Scoring.of_logprobs(2))
    return [DEFAULT.tokenizer.token_strs([t])[0] for t in g.output_ids], g.logprobs


def test_hit_equals_cold_and_inprocess_golden(url):
    _flush(url)
    ta, la, ca = _complete(url, "golden", A)
    assert ca == 0
    tb, lb, cb = _complete(url, "golden", B)            # B shares 170 tokens: 160 page-aligned
    assert cb == 160
    _flush(url)
    tb0, lb0, cb0 = _complete(url, "golden", B)
    assert cb0 == 0
    assert (tb, lb) == (tb0, lb0)                        # bit for bit
    assert _complete(url, "golden", A)[2] == 160         # B's pages (and A's first 4) are cached
    tok, lp = _inprocess(B)
    assert lb0 == lp


def test_sglang_meta_info_cached_tokens_and_vllm_reset(url):
    _flush(url)
    g = lambda: ok(httpx.post(url + "/generate", json={
        "model": "golden", "input_ids": A, "sampling_params": {"max_new_tokens": 2,
                                                                "temperature": 0}}, timeout=300))
    assert g()["meta_info"]["cached_tokens"] == 0
    hit = g()
    assert hit["meta_info"]["cached_tokens"] == 200 - PAGE       # shorter than the prompt
    r = httpx.post(url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200 and r.content == b""
    again = g()
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == hit["output_ids"]
    info = ok(httpx.get(url + "/get_server_info", timeout=30))["prefix_cache"]
    assert info["enabled"] and info["page_size"] == PAGE and info["bytes"] <= info["budget_bytes"]


def test_prompt_logprobs_bypass_the_cached_positions(url):
    _flush(url)
    body = {"model": "golden", "input_ids": A, "return_logprob": True, "logprob_start_len": 100,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    cold = ok(httpx.post(url + "/generate", json=body, timeout=300))["meta_info"]
    hit = ok(httpx.post(url + "/generate", json=body, timeout=300))["meta_info"]
    assert cold["cached_tokens"] == 0 and hit["cached_tokens"] == 80    # at most start_len
    assert hit["input_token_logprobs"] == cold["input_token_logprobs"]
    assert hit["output_token_logprobs"] == cold["output_token_logprobs"]
    echo = {"model": "golden", "prompt": A, "max_tokens": 1, "temperature": 0, "echo": True,
            "logprobs": 1}
    r = ok(httpx.post(url + "/v1/completions", json=echo, timeout=300))
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0   # echo: full bypass


def test_restore_bug_shows_on_hits_only(url):
    _flush(url)
    gold_a = _complete(url, "golden", A)
    gold_b = _complete(url, "golden", B)
    bug_a = _complete(url, "bug", A)                     # cold: the bug arm's cache is its own
    assert bug_a == gold_a
    bug_b = _complete(url, "bug", B)
    assert bug_b[2] == gold_b[2] == 160
    assert bug_b[1] != gold_b[1]                         # restored without compressor pending
    _flush(url)
    assert _complete(url, "bug", B)[:2] == _complete(url, "golden", B)[:2]   # cold again: equal


def test_eviction_keeps_the_cache_under_budget(url):
    page_bytes = ok(httpx.get(url + "/get_server_info", timeout=30))["prefix_cache"]["page_snapshot_bytes"]
    budget = 6 * page_bytes
    with served("golden", extra=("--page-size", str(PAGE), "--prefix-cache-bytes", str(budget))) as (u,):
        for s in range(3):
            ids = [int(i) for i in torch.randint(3, 500, (170,), generator=torch.Generator().manual_seed(s))]
            _complete(u, None, ids, 1)
            info = ok(httpx.get(u + "/get_server_info", timeout=30))["prefix_cache"]
            assert 0 < info["bytes"] <= budget
        assert info["evicted"] > 0 and info["budget_bytes"] == budget
        assert _complete(u, None, ids, 1)[2] == 160      # the newest prompt is still cached


def _fails(*extra) -> str:
    p = subprocess.run(fidelity_cmd("serve", "--port", "1", *extra), cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode != 0
    return p.stderr


def test_bad_options_are_clear_errors():
    assert "--page-size must be at least 1" in _fails("--page-size", "0")
    err = _fails("--prefix-cache-bytes", "1000")
    assert "below one page's snapshot" in err and "--page-size 64" in err and "bytes" in err
    assert "--chunked-prefill-size must be at least 1" in _fails("--chunked-prefill-size", "0")


def test_no_prefix_cache():
    with served("golden", extra=("--no-prefix-cache",)) as (u,):
        for _ in range(2):
            assert _complete(u, None, A, 1)[2] == 0
        assert ok(httpx.get(u + "/get_server_info", timeout=30))["prefix_cache"] == {"enabled": False}


def test_chat_hits_and_streamed_usage_reports_cached_tokens(url):
    _flush(url)
    msgs = [{"role": "user", "content": " ".join(["the river keeps talking to the old stone bridge"] * 30)}]
    body = {"model": "golden", "messages": msgs, "max_tokens": 3, "temperature": 0}
    cold = ok(httpx.post(url + "/v1/chat/completions", json=body, timeout=300))
    lines = []
    with httpx.stream("POST", url + "/v1/chat/completions", timeout=300,
                      json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ") and ln != "data: [DONE]"]
    import json
    usage = json.loads(lines[-1])["usage"]
    n = cold["usage"]["prompt_tokens"]
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert usage["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE > 0
    deltas = [d for x in lines for d in [(json.loads(x)["choices"] or [{}])[0].get("delta", {})]]
    got = ["".join(d.get(k) or "" for d in deltas) for k in ("reasoning_content", "content")]
    m = cold["choices"][0]["message"]
    assert got == [m.get("reasoning_content") or "", m.get("content") or ""]   # a hit: same answer


def test_chunked_prefill_size_reaches_the_serving_seam():
    """--chunked-prefill-size 64: the golden arm answers as the in-process golden (chunking
    is exact), a served arm with a stale-indexer-workspace bug answers differently -- the
    bug acts at chunk boundaries only, which a 200-token prompt has at 64, 128, 192."""
    with served("golden", extra=("--arm", "golden=golden", "--arm", "bug=chunk_stale_index_keys",
                                 "--default-arm", "golden", "--no-prefix-cache",
                                 "--chunked-prefill-size", "64")) as (u,):
        tg, lg, _ = _complete(u, "golden", A)
        tb, lb, _ = _complete(u, "bug", A)
    assert lg == _inprocess(A)[1]                         # bit for bit
    assert lb != lg


def test_served_window_restore_bug_end_to_end():
    """One server, a golden arm and an arm carrying `restore_window_one_off` (the window ring
    restored one row off), --page-size 64. Per arm: flush, a cold 300-token request C, then
    D = C's first 256 tokens + a tail of its own: a hit on 256 tokens (the window ring is
    full there, 256 = 8 windows of 32). Golden's hit answers exactly as a cold D after a
    flush (greedy tokens and every logprob, bit for bit); the bug arm's hit does not -- its
    first generated token's logprob already differs -- while its cold answers equal
    golden's: the bug lives in the restore only."""
    g = torch.Generator().manual_seed(2201)
    c = [int(i) for i in torch.randint(3, 500, (300,), generator=g)]
    tail = [int(i) for i in torch.randint(3, 500, (44,), generator=g)]
    tail[0] = tail[0] + 1 if tail[0] == c[256] else tail[0]              # diverge right at 256
    d = c[:256] + tail

    def ask(u, model, ids):
        r = ok(httpx.post(u + "/v1/completions", json={
            "model": model, "prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}, timeout=300))
        return r["choices"][0]["logprobs"], r["usage"]["prompt_tokens_details"]["cached_tokens"]

    got = {}
    with served("golden", extra=("--arm", "golden=golden", "--arm", "bug=restore_window_one_off",
                                 "--default-arm", "golden", "--page-size", "64")) as (u,):
        for arm in ("golden", "bug"):
            _flush(u)
            cold_c, n_c = ask(u, arm, c)
            hit_d, n_hit = ask(u, arm, d)
            _flush(u)
            cold_d, n_d = ask(u, arm, d)
            assert (n_c, n_hit, n_d) == (0, 256, 0), arm
            got[arm] = cold_c, hit_d, cold_d
    (gc, gh, gd), (bc, bh, bd) = got["golden"], got["bug"]
    assert gh == gd                                      # tokens, logprobs, top logprobs: bit for bit
    assert bh["token_logprobs"][0] != bd["token_logprobs"][0]
    assert (bc, bd) == (gc, gd)                          # cold, the bug arm is the golden
