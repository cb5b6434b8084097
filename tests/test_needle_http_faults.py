"""HTTP runner against a local misbehaving server: 500s, 429, timeouts, malformed JSON and
dropped connections are retried and, when retries run out, counted as server errors --
never as recall misses; 4xx is not retried; the API key is sent but never written.
Start-up requests (model list, /tokenize probe, calibration probes) are retried the same
way and, when retries run out, fail with one clear line naming endpoint, route and status."""
import asyncio
import hashlib
import logging

import pytest

from infra.http import RetryPolicy, StartupError, redact_url
from needle.haystack import HaystackSpec, PromptFormat, build_prompt
from needle.http import HttpRunner, RequestOptions
from needle.report import write_report
from needle.stub import StubServer
from needle.sweep import SweepConfig, run_sweep
from needle.tables import by_arm
from reference_model.tokenizer import load_tokenizer

# Attempts may wait long: only the "timeout" fault should ever time out, however busy the
# machine is (a healthy stub answer can take seconds on a loaded 2-core box).
FAST = dict(timeout=6.0, connect_timeout=6.0, backoff=0.01, backoff_max=0.05)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def _one(stub, tok, retries, api="chat"):
    r = HttpRunner("stub", stub.url, api=api, policy=RetryPolicy(retries=retries, **FAST))
    p = build_prompt(HaystackSpec(), PromptFormat("chat" if api == "chat" else "completion"),
                     r.counter(), 400, 50, 3)

    async def go():
        await r.aopen()
        try:
            return await r.arun(p, 1)
        finally:
            await r.aclose()
    return asyncio.run(go()), p


@pytest.mark.parametrize("api", ["chat", "completions"])
def test_every_fault_is_retried_then_succeeds(tok, api):
    faults = ["500", "malformed", "drop", "timeout", "429"]
    with StubServer(faults=faults, hang=9, tokenizer=tok, wrong_every=0) as s:
        res, p = _one(s, tok, retries=5, api=api)
        assert s.requests == 6
    assert res["error"] is None and res["attempts"] == 6
    assert p.expected[0] in res["response"]
    kinds = " | ".join(res["errors"])
    for frag in ("HTTP 500", "malformed", "RemoteProtocolError", "timeout", "HTTP 429"):
        assert frag in kinds


def test_exhausted_retries_are_server_errors(tok):
    with StubServer(faults=["500"] * 10, tokenizer=tok) as s:
        res, _ = _one(s, tok, retries=2)
        assert s.requests == 3
    assert res["attempts"] == 3 and res["error"].startswith("HTTP 500") and res["error_status"] == 500


def test_4xx_is_not_retried(tok):
    with StubServer(faults=["400", "ok"], tokenizer=tok) as s:
        res, _ = _one(s, tok, retries=4)
        assert s.requests == 1
    assert res["attempts"] == 1 and res["error_status"] == 400


def test_sweep_counts_faults_as_errors_not_misses(tok, tmp_path, monkeypatch):
    secret = "sk-test-" + "9" * 20
    monkeypatch.setenv("NEEDLE_TEST_KEY", secret)
    # 6 trials, 1 request each when healthy; the first two trials exhaust their retries
    faults = ["500", "500", "drop", "drop", "ok", "malformed"] + ["ok"] * 10
    with StubServer(faults=faults, tokenizer=tok, wrong_every=2) as s:
        r = HttpRunner("stub", s.url + "/", options=RequestOptions(), concurrency=1,
                       policy=RetryPolicy(retries=1, **FAST), api_key_env="NEEDLE_TEST_KEY")
        cfg = SweepConfig(lengths=[300, 420], depths=[0, 50, 100])
        rows = run_sweep(cfg, [r], tmp_path / "res.jsonl", quiet=True)
        assert s.auth_sha256 == {hashlib.sha256(f"Bearer {secret}".encode()).hexdigest()}
    out = [r["outcome"] for r in rows]
    assert out.count("server_error") == 2 and len(rows) == 6
    assert set(out) <= {"server_error", "correct", "wrong"}
    retried = [r for r in rows if r["outcome"] != "server_error" and r["attempts"] > 1]
    assert len(retried) == 1 and "malformed" in retried[0]["errors"][0]
    (arm,) = by_arm(rows)
    assert arm["server_error"] == 2 and arm["n_scored"] == 4     # errors are not recall trials
    assert arm["recall"] == out.count("correct") / 4
    rep = write_report(rows, tmp_path / "rep", {"results": "x"}, with_plots=False)
    for f in [tmp_path / "res.jsonl", *rep.iterdir()]:
        assert secret not in f.read_text()
    # resume: server errors are retried on the next run, finished trials are not
    with StubServer(tokenizer=tok, wrong_every=2) as s:
        r = HttpRunner("stub", s.url, concurrency=2, policy=RetryPolicy(**FAST),
                       api_key_env="NEEDLE_TEST_KEY")
        rows = run_sweep(cfg, [r], tmp_path / "res.jsonl", quiet=True)
        assert s.requests == 2
    assert [r["outcome"] for r in rows].count("server_error") == 0 and len(rows) == 6


def test_redact_url():
    assert redact_url("http://user:pw@127.0.0.1:8000/v1") == "http://127.0.0.1:8000/v1"


def test_no_tokenize_endpoint_calibrates_and_reports_residuals(tok, tmp_path):
    with StubServer(tokenizer=tok, tokenize=False, wrong_every=0) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=0, **FAST))
        rows = run_sweep(SweepConfig(lengths=[400, 800], depths=[0, 100]), [r],
                         tmp_path / "r.jsonl", quiet=True)
    assert all(not x["exact_length"] and x["count_source"].startswith("calibrated:") for x in rows)
    # the server's own count is recorded; a linear chars->tokens fit lands within a few %
    for x in rows:
        assert x["prompt_tokens_reported"] == x["length"] + x["token_residual"]
        assert abs(x["token_residual"]) <= 0.05 * x["length"]
    assert {x["outcome"] for x in rows} == {"correct"}


# ---- start-up requests -----------------------------------------------------------------
SMALL = SweepConfig(lengths=[300], depths=[0, 100])


def _retry_logs(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "needle.http"]


def test_models_list_5xx_at_startup_is_retried(tok, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="needle.http")
    with StubServer(models_faults=["500", "500"], tokenizer=tok, wrong_every=0) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=3, **FAST))
        rows = run_sweep(SMALL, [r], tmp_path / "r.jsonl", quiet=True)
        assert s.models_requests == 3                 # two 500s, then the list
    assert r.model == "stub" and r.startup_retries == 2
    assert all(e.startswith("GET /v1/models: HTTP 500") for e in r.startup_errors)
    logs = _retry_logs(caplog)
    assert len(logs) == 2 and all("GET /v1/models" in m and "HTTP 500" in m for m in logs)
    assert [x["outcome"] for x in rows] == ["correct", "correct"]
    assert all(x["exact_length"] for x in rows)


def test_calibration_probe_5xx_without_tokenize_is_retried(tok, tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="needle.http")
    # no /tokenize: the two calibration probes are the first generation requests
    with StubServer(faults=["502", "502", "ok", "502"], tokenizer=tok, tokenize=False,
                    wrong_every=0) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=2, **FAST))
        rows = run_sweep(SMALL, [r], tmp_path / "r.jsonl", quiet=True)
        assert s.tokenize_requests == 2               # /tokenize and /v1/tokenize: 404, not retried
        assert s.requests == 5 + 2                    # 2 probes + 3 retries, then the 2 trials
    assert r.startup_retries == 3
    assert all(e.startswith("POST /v1/chat/completions: HTTP 502") for e in r.startup_errors)
    assert len(_retry_logs(caplog)) == 3
    assert all(x["count_source"].startswith("calibrated:") for x in rows)
    assert {x["outcome"] for x in rows} == {"correct"}
    assert all(x["attempts"] == 1 for x in rows)      # the trials themselves saw no fault
    for x in rows:
        assert abs(x["token_residual"]) <= 0.05 * x["length"]


def test_tokenize_probe_5xx_is_retried_not_taken_for_absent(tok):
    with StubServer(tokenize_faults=["503", "drop"], tokenizer=tok) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=2, **FAST))
        c = r.counter()
        try:
            assert c.exact and c.path == "/tokenize" and r.startup_retries == 2
        finally:
            c.close()


def test_exhausted_calibration_probe_is_a_clear_error(tok, tmp_path):
    with StubServer(faults=["502"] * 10, tokenizer=tok, tokenize=False) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=1, **FAST))
        with pytest.raises(StartupError) as ei:
            run_sweep(SMALL, [r], tmp_path / "r.jsonl", quiet=True)
        assert s.requests == 2
    msg = str(ei.value)
    assert msg.startswith(f"endpoint 'stub' ({s.url[:-3]}): POST /v1/chat/completions "
                          "failed after 2 attempts: HTTP 502")
    assert ei.value.exhausted and ei.value.attempts == 2


def test_models_list_4xx_is_not_retried(tok):
    """A 4xx on the model list is final; a 400 hints at passing the model's name, a refused
    key (401) says it was the credentials, not a model name."""
    with StubServer(models_faults=["400"], tokenizer=tok) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=3, **FAST))
        with pytest.raises(StartupError, match=r"GET /v1/models failed \(not retried\): HTTP 400.*"
                                               r"pass a model name"):
            r.discover_model()
        assert s.models_requests == 1 and r.startup_retries == 0
    with StubServer(models_faults=["401"], tokenizer=tok) as s:
        r = HttpRunner("stub", s.url, policy=RetryPolicy(retries=3, **FAST))
        with pytest.raises(StartupError, match=r"HTTP 401: the server refused the request's credentials") as e:
            r.discover_model()
        assert "pass a model name" not in str(e.value) and s.models_requests == 1


def test_cli_reports_persistent_startup_5xx_in_one_line(tok, tmp_path, capsys, monkeypatch):
    from fidelity.cli import main
    monkeypatch.setenv("OMP_NUM_THREADS", "1")        # no torch import for an endpoint-only run
    with StubServer(models_faults=["500"] * 20, tokenizer=tok) as s:
        rc = main(["needle", "--endpoint", f"stub={s.url}", "--lengths", "300", "--depths", "0",
                   "--retries", "1", "--timeout", "5", "--out", str(tmp_path), "--no-plots",
                   "--quiet"])
        assert s.models_requests == 2 and s.requests == 0
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert (f"error: endpoint 'stub' (http://127.0.0.1:{s.port}): GET /v1/models failed after "
            "2 attempts: HTTP 500") in err


# ---- a 200 reply that says tokens were generated but carries none -------------------------
# Through the fault proxy in front of a real `fidelity serve`: the reply is malformed, so
# it is retried like any unusable answer and, when it stays so, a server error -- never
# an `empty` recall miss.

@pytest.fixture(scope="module")
def served_url():
    from needle_util import served
    with served("golden") as (u,):
        yield u


def _needle_cli(out, url, *extra):
    from fidelity.cli import main
    return main(["needle", "--endpoint", f"golden={url}/v1", "--lengths", "300", "--depths", "0,100",
                 "--temperature", "0", "--max-tokens", "12", "--concurrency", "1", "--retries", "2",
                 "--out", str(out), "--no-plots", "--quiet", *extra])


def _rows(out):
    from needle.results import latest, read_rows
    return sorted(latest(read_rows(out / "needle" / "results.jsonl")[1]), key=lambda r: r["trial_id"])


def test_reply_without_content_is_retried_then_a_server_error(served_url, tmp_path, capsys):
    from fault_proxy import FaultProxy
    assert _needle_cli(tmp_path / "clean", served_url) == 0
    clean = _rows(tmp_path / "clean")
    assert "server_error" not in {r["outcome"] for r in clean}
    capsys.readouterr()
    # once: retried, and the sweep is the clean one
    with FaultProxy(served_url, {"/v1/chat/completions": ["no_content"]}) as px:
        assert _needle_cli(tmp_path / "once", px.url) == 0
        assert px.count("/v1/chat/completions") == 3
    once = _rows(tmp_path / "once")
    assert [(r["outcome"], r["response"]) for r in once] == [(r["outcome"], r["response"]) for r in clean]
    assert sorted(r["attempts"] for r in once) == [1, 2]
    assert "no message in the choice (usage says" in " ".join(e for r in once for e in r["errors"] or [])
    # every attempt of one trial: a server error, not a scored miss
    capsys.readouterr()
    with FaultProxy(served_url, {"/v1/chat/completions": ["no_content"] * 3}) as px:
        assert _needle_cli(tmp_path / "always", px.url) == 0
    out = capsys.readouterr().out
    rows = _rows(tmp_path / "always")
    assert [r["outcome"] for r in rows] == ["server_error", clean[1]["outcome"]]    # trials in order
    assert rows[0]["attempts"] == 3 and "no message in the choice" in rows[0]["error"]
    assert "over 1 scored trials" in out and "server errors 1" in out


@pytest.mark.parametrize("choice,usage,ok", [
    ({"message": {"content": None}}, {"completion_tokens": 8}, False),
    ({"message": {"role": "assistant"}}, None, False),
    ({"finish_reason": "stop"}, {"completion_tokens": 0}, False),      # no message at all
    ({"message": {"content": ""}}, {"completion_tokens": 1}, True),   # an empty answer is an answer
    ({"message": {"content": None}}, {"completion_tokens": 0}, True),
    ({"message": {"content": None, "reasoning_content": "hm"}}, {"completion_tokens": 8}, True),
    ({"message": {"content": None, "tool_calls": [{"id": "x"}]}}, {"completion_tokens": 8}, True),
])
def test_which_chat_replies_carry_no_text(choice, usage, ok):
    import httpx
    from infra.http import RequestFailed
    from needle.http import completion_body
    r = httpx.Response(200, json={"choices": [choice], **({"usage": usage} if usage else {})})
    if ok:
        assert completion_body(r)["choices"][0] == choice
    else:
        with pytest.raises(RequestFailed, match="malformed response: no (message|content)") as ei:
            completion_body(r)
        assert ei.value.retryable


def test_completions_reply_without_text_is_malformed():
    import httpx
    from infra.http import RequestFailed
    from needle.http import completion_body
    with pytest.raises(RequestFailed, match=r"no text in the choice \(usage says 3 tokens"):
        completion_body(httpx.Response(200, json={"choices": [{}], "usage": {"completion_tokens": 3}}),
                        chat=False)
    assert completion_body(httpx.Response(200, json={"choices": [{"text": ""}]}), chat=False)


def test_sweep_through_faults_is_the_clean_sweep(served_url, tmp_path):
    """Faults on a third of the requests (5xx, dropped connections, truncated bodies,
    replies without content), on /tokenize and on the trials: the same rows as a clean run,
    trial for trial, with the faulted trials' retries recorded."""
    from fault_proxy import FaultProxy
    grid = ["--lengths", "300,420", "--depths", "0,50,100", "--retries", "4"]
    assert _needle_cli(tmp_path / "clean", served_url, *grid) == 0
    faults = {"/tokenize": ["500", "ok", "ok", "drop", "ok", "ok", "malformed"],
              "/v1/chat/completions": ["ok", "502", "ok", "no_content", "drop", "ok", "malformed",
                                       "ok", "500", "no_content"]}
    with FaultProxy(served_url, faults) as px:
        assert _needle_cli(tmp_path / "faulty", px.url, *grid) == 0
        assert not px.faults["/v1/chat/completions"] and not px.faults["/tokenize"]   # all used
    keys = ("trial_id", "outcome", "response", "prompt_tokens_reported", "exact_length")
    clean, faulty = _rows(tmp_path / "clean"), _rows(tmp_path / "faulty")
    assert len(clean) == 6 and [tuple(r[k] for k in keys) for r in faulty] == \
        [tuple(r[k] for k in keys) for r in clean]
    assert sum(r["attempts"] - 1 for r in faulty) == 6           # the trials' faults, each retried once
