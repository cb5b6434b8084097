"""`fidelity serve` under several clients, as a real process: a client that disconnects
frees the server within one decode step; requests interleave (a short one is answered
while a long one runs); a full server answers 429 with Retry-After; several arms behind one
port each answer as the in-process model of that arm, captures included, bit for bit."""
import base64
import time

import httpx
import numpy as np
import openai
import pytest
import torch

from fidelity.design.arms import parse_arm
from fidelity.weights.target import load_target
from reference_model import Model
from reference_model.taps import Taps

from needle_util import served

DEFAULT = load_target(None)
LONG = {"prompt": "The river", "max_tokens": 3000, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def url():
    with served("golden", extra=("--arm", "golden=golden", "--arm", "engine=engine",
                                 "--max-queue", "3")) as (u,):
        yield u


def _sched(url) -> dict:
    return httpx.get(url + "/get_server_info", timeout=30).json()["scheduler"]


def _idle(url, timeout=20.0) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        s = _sched(url)
        if s["active"] == 0:
            return s
        time.sleep(0.05)
    raise AssertionError(f"server still busy after {timeout} s: {s}")


def _short(url) -> float:
    t = time.perf_counter()
    r = httpx.post(url + "/v1/completions", json={"model": "golden", "prompt": "The river",
                                                  "max_tokens": 2, "temperature": 0}, timeout=60)
    assert r.status_code == 200
    return time.perf_counter() - t


def _open_stream(client: httpx.Client, url, chunks=3):
    """A long streamed generation, read until `chunks` events arrived (it is running).
    The line iterator is returned with it: dropping the iterator closes the connection."""
    cm = client.stream("POST", url + "/v1/completions", json={"model": "golden", "stream": True, **LONG})
    it = cm.__enter__().iter_lines()
    n = 0
    while n < chunks:
        n += next(it).startswith("data: ")
    return cm, it


def test_disconnect_frees_the_server_within_one_step(url):
    base = min(_short(url) for _ in range(3))
    before = _idle(url)
    with httpx.Client(timeout=60) as c:                      # streamed: the client goes away
        cm, _ = _open_stream(c, url)
        cm.__exit__(None, None, None)
    s = _idle(url)
    assert s["cancelled"] == before["cancelled"] + 1 and s["cancel_lag_steps_max"] <= 1
    with pytest.raises(httpx.ReadTimeout):                   # not streamed: it times out
        httpx.post(url + "/v1/completions", json={"model": "golden", **LONG}, timeout=0.5)
    s = _idle(url)
    assert s["cancelled"] == before["cancelled"] + 2 and s["cancel_lag_steps_max"] <= 1
    # each abandoned request had ~3000 steps left (minutes); the next one is not behind them
    after = _short(url)
    assert after < base + 2.0, (base, after, s["step_seconds_mean"])


def test_short_request_is_answered_while_a_long_one_runs(url):
    _idle(url)
    with httpx.Client(timeout=60) as c:
        cm, lines = _open_stream(c, url)                     # kept open: not read meanwhile
        _short(url)
        assert _sched(url)["active"] == 1                    # the long one is still generating
        cm.__exit__(None, None, None)
    _idle(url)


def test_full_server_answers_429_with_retry_after(url):
    _idle(url)
    clients = [httpx.Client(timeout=60) for _ in range(3)]
    streams = [_open_stream(c, url, 1) for c in clients]
    try:
        r = httpx.post(url + "/v1/completions", json={"model": "golden", "prompt": "x", "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "--max-queue" in r.json()["error"]["message"]
        oc = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.RateLimitError):
            oc.completions.create(model="golden", prompt="x", max_tokens=1)
    finally:
        for (cm, _), c in zip(streams, clients):
            cm.__exit__(None, None, None)
            c.close()
    _idle(url)
    assert _short(url) > 0                                   # serving again


def _decode(b64: str, *shape) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(b64), "<i4").copy()).reshape(*shape)


@pytest.mark.parametrize("arm", ["golden", "engine"])
def test_each_arm_answers_as_its_in_process_model_with_captures(url, arm):
    models = httpx.get(url + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in models] == ["golden", "engine"]
    info = httpx.get(url + "/get_model_info", timeout=30).json()
    ids = DEFAULT.tokenizer.encode(" ".join(f"Rain falls on the old stone bridge {k} at night."
                                            for k in range(12)))
    assert len(ids) // 4 > info["index_topk"]               # the indexer must choose
    r = httpx.post(url + "/generate", timeout=120, json={
        "model": arm, "input_ids": ids, "return_logprob": True, "logprob_start_len": 0,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
        "return_indexer_topk": True, "return_routed_experts": True}).json()
    out = r["output_ids"]
    m = Model(DEFAULT.weights, parse_arm(arm).numerics())
    taps = Taps(["layers.*.attn.index.topk", "layers.*.ffn.router.experts"])
    logits, st = m.extend(torch.tensor(ids), None, "all", taps)
    lps = [torch.log_softmax(logits.double(), -1)]
    for t in out[:-1]:
        lg, st = m.extend(torch.tensor([t]), st, "last", taps)
        lps.append(torch.log_softmax(lg.double(), -1))
    lp = torch.cat(lps)
    assert out == [int(lp[len(ids) - 1 + j].argmax()) for j in range(3)]
    got = [e[0] for e in r["meta_info"]["input_token_logprobs"]][1:] + \
          [e[0] for e in r["meta_info"]["output_token_logprobs"]]
    want = [float(lp[j, t]) for j, t in enumerate(ids[1:] + out)]
    assert got == want                                       # bit for bit, prompt and output
    rows, csa = len(ids) + 2, info["indexer_layers"]
    idx = torch.stack([taps[f"layers.{i}.attn.index.topk"] for i in csa], 1)
    assert int(idx[-1, 0].max()) >= info["index_topk"]      # picks beyond the first 16 entries
    assert torch.equal(_decode(r["meta_info"]["indexer_topk"], rows, len(csa), info["index_topk"]), idx)
    exp = torch.stack([taps[f"layers.{i}.ffn.router.experts"] for i in range(info["num_hidden_layers"])], 1)
    assert torch.equal(_decode(r["meta_info"]["routed_experts"], rows, info["num_hidden_layers"],
                               info["num_experts_per_tok"]), exp)
