"""What a port does for clients this project did not write: the rule for requests that
name no `model` (one arm: it; several: --default-arm, else a 400 naming the arms), one
--max-logprobs cap on every route, unknown request fields served but logged once per field
and route, vLLM's GET /tokenizer_info as lm-eval's remote tokenizer reads it. Real
`fidelity serve` processes."""
import contextlib
import os
import subprocess
import time

import httpx
import pytest

from fidelity.weights.target import load_target
from reference_model.tokenizer import BOS, EOS

from needle_util import ROOT, fidelity_cmd, free_port, served, stop, wait_healthy

T = load_target(None)
TWO = ("--arm", "golden=golden", "--arm", "engine=engine")
COMPLETION = {"prompt": "The river", "max_tokens": 2, "temperature": 0}


@contextlib.contextmanager
def server(*args, log=None):
    """One `fidelity serve` with its stderr in `log` (a file path) or discarded."""
    port = free_port()
    with open(log or os.devnull, "wb") as err:
        proc = subprocess.Popen(fidelity_cmd("serve", "--port", str(port), *args), cwd=ROOT,
                                env={**os.environ, "DSV4_FIDELITY_ARM": "golden"},
                                stdout=subprocess.DEVNULL, stderr=err)
        try:
            url = f"http://127.0.0.1:{port}"
            proc.stderr = open(log or os.devnull, "rb")     # wait_healthy reads it on a crash
            wait_healthy(url, proc)
            yield url
        finally:
            stop([proc])


@pytest.fixture(scope="module")
def one():
    with served("golden") as (u,):
        yield u


@pytest.fixture(scope="module")
def two():
    with served("golden", extra=TWO) as (u,):
        yield u


# ---- the no-model rule ---------------------------------------------------------------------
def test_one_arm_port_answers_without_model(one):
    r = httpx.post(one + "/v1/completions", json=COMPLETION, timeout=120)
    assert r.status_code == 200 and r.json()["model"] == T.name
    g = httpx.post(one + "/generate", json={"text": "The river", "sampling_params": {"max_new_tokens": 1}},
                   timeout=120)
    assert g.status_code == 200 and g.json()["meta_info"]["model"] == T.name
    assert httpx.get(one + "/get_server_info").json()["default_model"] == T.name


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", COMPLETION),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("/generate", {"text": "The river", "sampling_params": {"max_new_tokens": 1}}),
])
def test_two_arm_port_without_default_refuses_and_names_the_arms(two, path, body):
    r = httpx.post(two + path, json=body, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "model"
    assert "golden" in err["message"] and "engine" in err["message"] and "--default-arm" in err["message"]
    named = httpx.post(two + path, json={**body, "model": "engine"}, timeout=120)
    assert named.status_code == 200


def test_two_arm_port_with_default_arm_serves_it():
    with server(*TWO, "--default-arm", "engine") as url:
        r = httpx.post(url + "/v1/completions", json=COMPLETION, timeout=120).json()
        assert r["model"] == "engine"
        assert httpx.get(url + "/get_server_info").json()["default_model"] == "engine"
        # the same tokens as naming the arm (and the engine arm is the one that answered)
        named = httpx.post(url + "/v1/completions", json={**COMPLETION, "model": "engine", "logprobs": 1},
                           timeout=120).json()
        unnamed = httpx.post(url + "/v1/completions", json={**COMPLETION, "logprobs": 1}, timeout=120).json()
        assert unnamed["choices"][0]["logprobs"] == named["choices"][0]["logprobs"]


def test_default_arm_must_be_served():
    p = subprocess.run(fidelity_cmd("serve", "--port", str(free_port()), *TWO, "--default-arm", "nope"),
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--default-arm 'nope'" in p.stderr and "golden" in p.stderr


# ---- one logprob cap --------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, "logprobs"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, "top_logprobs"),
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
])
def test_max_logprobs_caps_every_route(one, path, body, field):
    r = httpx.post(one + path, json=body, timeout=120)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field
    assert f"{field} 21" in err["message"] and "max_logprobs 20" in err["message"]
    assert httpx.post(one + path, json={**body, field: 20}, timeout=120).status_code == 200


# ---- unknown fields: served, logged once per field and route --------------------------------
def test_unknown_fields_are_served_and_logged_once(tmp_path):
    log = tmp_path / "stderr.txt"
    with server(log=log) as url:
        for _ in range(2):
            r = httpx.post(url + "/v1/completions", json={**COMPLETION, "frobnicate": 1, "colour": "red"},
                           timeout=120)
            assert r.status_code == 200
        r = httpx.post(url + "/generate", json={"text": "x", "frobnicate": 1,
                                                "sampling_params": {"max_new_tokens": 1}}, timeout=120)
        assert r.status_code == 200
        known = httpx.post(url + "/v1/completions", json={**COMPLETION, "user": "me"}, timeout=120)
        assert known.status_code == 200
        time.sleep(0.5)                                   # let stderr reach the file
        text = log.read_text()
    lines = [ln for ln in text.splitlines() if "was ignored" in ln]
    assert len(lines) == 3, text
    assert sum("POST /v1/completions" in ln and "'frobnicate'" in ln for ln in lines) == 1
    assert sum("POST /v1/completions" in ln and "'colour'" in ln for ln in lines) == 1
    assert sum("POST /generate" in ln and "'frobnicate'" in ln for ln in lines) == 1


# ---- /tokenizer_info ----------------------------------------------------------------------------
def test_tokenizer_info_as_lm_eval_remote_tokenizer_reads_it(one):
    info = httpx.get(one + "/tokenizer_info").json()
    assert info["eos_token"] == EOS and info["bos_token"] == BOS and info["pad_token"] == EOS
    assert info["add_bos_token"] is False and "chat_template" not in info    # V4's encoding is code
    # lm-eval: eos_token_id = /tokenize(eos_token, add_special_tokens=False)[0]
    tok = T.tokenizer
    for s, want in ((info["eos_token"], tok.eos_id), (info["bos_token"], tok.bos_id)):
        r = httpx.post(one + "/tokenize", json={"prompt": s, "add_special_tokens": False}).json()
        assert r["tokens"] == [want]
    d = httpx.post(one + "/detokenize", json={"tokens": tok.encode("The river")}).json()
    assert d["prompt"] == "The river"


def test_serve_help_shows_every_default():
    p = subprocess.run(fidelity_cmd("serve", "--help"), cwd=ROOT, capture_output=True, text=True, timeout=120)
    text = " ".join(p.stdout.split())
    for frag in ("--port PORT TCP port to listen on (default 8000)", "--default-arm NAME",
                 "(default warning)", "top_logprobs_num"):
        assert frag in text, frag
