"""`fidelity serve` as a real process, talked to with the official `openai` client and raw
HTTP: models, completions with logprobs + echo (checked against an in-process forward),
chat with and without thinking, /tokenize-exact prompt lengths, and 400s for bad requests."""
import httpx
import openai
import pytest
import torch

from needle.haystack import HaystackSpec, PromptFormat, build_prompt
from needle.http import HttpRunner, TokenizeCounter
from fidelity.target import load_target
from reference_model import Model, Numerics
from reference_model.tokenizer import load_tokenizer, render_chat

from needle_util import served


DEFAULT = load_target(None)          # what `fidelity serve` serves with no --checkpoint


@pytest.fixture(scope="module")
def url():
    with served("golden") as (u,):
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="not-checked", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer()


def test_models(client):
    (m,) = client.models.list().data
    assert m.id == DEFAULT.name and m.model_extra["arm"] == "golden"


def test_completions_echo_logprobs_match_in_process_forward(client, tok):
    prompt = "The river keeps talking"
    ids = tok.encode(prompt)
    r = client.completions.create(model=DEFAULT.name, prompt=prompt, max_tokens=1, temperature=0,
                                  logprobs=3, echo=True)
    ch = r.choices[0]
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1
    assert ch.text.startswith(prompt) and ch.finish_reason == "length"
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    logits = Model(DEFAULT.weights, Numerics("reference")).prefill_logits(torch.tensor(ids))
    ref = torch.log_softmax(logits.double(), -1)
    for j in range(1, len(ids)):
        assert lp.token_logprobs[j] == pytest.approx(float(ref[j - 1, ids[j]]), abs=1e-9)
    nxt = int(ref[-1].argmax())                                  # greedy next token
    assert lp.token_logprobs[-1] == pytest.approx(float(ref[-1, nxt]), abs=1e-9)
    assert ch.text == prompt + tok.decode([nxt])
    assert max(lp.top_logprobs[-1].values()) == pytest.approx(float(ref[-1].max()), abs=1e-9)
    assert lp.text_offset[:2] == [0, len(lp.tokens[0])]


def test_chat_plain_and_thinking(client, tok):
    msgs = [{"role": "user", "content": "Where does the river run?"}]
    r = client.chat.completions.create(model=DEFAULT.name, messages=msgs, max_tokens=2,
                                       temperature=0, seed=3, logprobs=True, top_logprobs=2)
    m = r.choices[0].message
    assert isinstance(m.content, str) and (m.model_extra or {}).get("reasoning_content") is None
    assert r.usage.prompt_tokens == len(tok.encode(render_chat(msgs)))
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    r = client.chat.completions.create(model=DEFAULT.name, messages=msgs, max_tokens=2, temperature=0,
                                       extra_body={"chat_template_kwargs": {"thinking": True}})
    m = r.choices[0].message
    assert isinstance(m.model_extra["reasoning_content"], str)   # no </think> yet: all reasoning
    assert r.usage.prompt_tokens == len(tok.encode(render_chat(msgs, thinking=True)))


def test_prompts_exact_via_tokenize(url, tok):
    for api, mode in (("chat", "chat"), ("completions", "completion")):
        r = HttpRunner("s", url, api=api)
        c = r.counter()
        assert isinstance(c, TokenizeCounter) and c.exact
        for L in (383, 384, 513, 642):
            p = build_prompt(HaystackSpec(), PromptFormat(mode), c, L, 50, L)
            assert p.n_tokens == L and p.exact and len(tok.encode(p.text)) == L
        # one real request: the server's own usage agrees
        body = r.body(p, 0)
        body["max_tokens"] = 1
        path = "/chat/completions" if api == "chat" else "/completions"
        got = httpx.post(r.v1 + path, json=body, timeout=300).json()
        assert got["usage"]["prompt_tokens"] == 642


@pytest.mark.parametrize("body,frag", [
    ({"messages": [{"role": "user", "content": "x"}], "stream": True}, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n=1"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10 ** 7}, "maximum context"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": "x"}, "messages"),
])
def test_bad_requests_are_400(url, body, frag):
    r = httpx.post(url + "/v1/chat/completions", json={"model": DEFAULT.name, **body}, timeout=60)
    assert r.status_code == 400 and frag in r.json()["error"]["message"]


def test_bad_json_and_openai_error(url, client):
    r = httpx.post(url + "/v1/completions", content=b"{nope", timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=DEFAULT.name, prompt=[10 ** 6], max_tokens=1)
