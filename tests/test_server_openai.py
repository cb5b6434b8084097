"""`fidelity serve` as a real process, talked to with the official `openai` client and raw
HTTP: models, completions with logprobs + echo (checked against an in-process forward),
chat with and without thinking, /tokenize-exact prompt lengths, and 400s for bad requests."""
import httpx
import openai
import pytest
import torch

from needle.haystack import HaystackSpec, PromptFormat, build_prompt
from needle.http import HttpRunner, TokenizeCounter
from fidelity.weights.target import load_target
from reference_model import Model, Numerics
from reference_model.tokenizer import load_tokenizer, render_chat



DEFAULT = load_target(None)          # what `fidelity serve` serves with no --checkpoint


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
    off = {"chat_template_kwargs": {"thinking": False}}
    r = client.chat.completions.create(model=DEFAULT.name, messages=msgs, max_tokens=2, temperature=0,
                                       seed=3, logprobs=True, top_logprobs=2, extra_body=off)
    m = r.choices[0].message
    assert isinstance(m.content, str) and (m.model_extra or {}).get("reasoning_content") is None
    assert r.usage.prompt_tokens == len(tok.encode(render_chat(msgs, thinking=False)))
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    # thinking not given: DeepSeek's default (on, effort high: the "Absolute maximum" preamble)
    r = client.chat.completions.create(model=DEFAULT.name, messages=msgs, max_tokens=2, temperature=0)
    m = r.choices[0].message
    assert isinstance(m.model_extra["reasoning_content"], str)   # no </think> yet: all reasoning
    assert r.usage.prompt_tokens == len(tok.encode(render_chat(msgs, thinking=None)))
    assert r.usage.prompt_tokens > len(tok.encode(render_chat(msgs, thinking=True, reasoning_effort="low")))


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
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=DEFAULT.name, prompt=[10 ** 6], max_tokens=1)
    assert "token id 1000000 is out of range" in e.value.message and e.value.param == "prompt"


# ---- streaming: the pieces add up to the non-streamed answer ------------------------------
def _chat_stream(client, **kw):
    chunks = list(client.chat.completions.create(model=DEFAULT.name, stream=True,
                                                 stream_options={"include_usage": True}, **kw))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
                        for c in chunks if c.choices)
    return chunks, content, reasoning


@pytest.mark.parametrize("thinking", [False, True])
def test_streamed_chat_equals_plain(client, thinking):
    kw = dict(messages=[{"role": "user", "content": "Where does the river run?"}], max_tokens=12,
              temperature=0, extra_body={"chat_template_kwargs": {"thinking": thinking}})
    plain = client.chat.completions.create(model=DEFAULT.name, **kw)
    chunks, content, reasoning = _chat_stream(client, **kw)
    m = plain.choices[0].message
    assert content == (m.content or "")
    assert reasoning == ((m.model_extra or {}).get("reasoning_content") or "")
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == plain.choices[0].finish_reason
    # the same usage, but for the prefix cache: the streamed request, sent second, may find the
    # plain one's prompt cached (whole 64-token pages of it; earlier tests' prompts may be too)
    def counts(u):
        d = u.model_dump()
        cached = (d.pop("prompt_tokens_details") or {}).get("cached_tokens") or 0
        return d, cached
    (streamed, hit), (want, first) = counts(chunks[-1].usage), counts(plain.usage)
    assert chunks[-1].choices == [] and streamed == want
    assert hit >= first and all(c % 64 == 0 and c < want["prompt_tokens"] for c in (hit, first))
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)


def test_streamed_chat_logprobs_one_per_token(client):
    chunks, _, _ = _chat_stream(client, messages=[{"role": "user", "content": "Hello river"}],
                                max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    ents = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(ents) == chunks[-1].usage.completion_tokens          # the stop token too
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in ents)


def test_streamed_completion_with_stop_and_raw_sse(url, client):
    body = dict(model=DEFAULT.name, prompt="The river keeps talking", max_tokens=12, temperature=0)
    plain = client.completions.create(**body).choices[0].text
    stop = plain[3:5]                                     # a stop string inside the answer
    want = client.completions.create(**body, stop=[stop]).choices[0]
    assert want.finish_reason == "stop" and want.text == plain[:plain.find(stop)]
    got = "".join(c.choices[0].text for c in client.completions.create(**body, stop=[stop], stream=True))
    assert got == want.text
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


# ---- errors real clients hit ---------------------------------------------------------------
def test_unknown_model_is_openai_not_found(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "x"}])
    assert e.value.code == "model_not_found" and "gpt-4o" in e.value.message
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=1)


@pytest.mark.parametrize("kw,field", [({"best_of": 2}, "best_of"), ({"suffix": "tail"}, "suffix"),
                                      ({"max_tokens": 1.5}, "max_tokens"),
                                      ({"logit_bias": {"99999": 5}}, "logit_bias"),
                                      ({"logit_bias": {"3": 500}}, "logit_bias")])
def test_unsupported_or_malformed_fields_name_themselves(url, kw, field):
    r = httpx.post(url + "/v1/completions", json={"model": DEFAULT.name, "prompt": "x", **kw}, timeout=60)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == field and field in err["message"]
    if field == "max_tokens":
        assert "integer" in err["message"] and "1.5" in err["message"]


def test_logit_bias_steers_greedy_decoding(client, tok):
    body = dict(model=DEFAULT.name, prompt="The river keeps talking", max_tokens=3, temperature=0,
                logprobs=1, extra_body={"return_token_ids": True})
    forced = tok.encode(" river")[0]
    r = client.completions.create(**body, logit_bias={str(forced): 100})
    assert r.choices[0].model_extra["token_ids"] == [forced] * 3
    plain = client.completions.create(**body).choices[0]
    first = plain.model_extra["token_ids"][0]
    banned = client.completions.create(**body, logit_bias={str(first): -100}).choices[0]
    assert banned.model_extra["token_ids"][0] != first
    assert banned.model_extra["prompt_token_ids"] == tok.encode("The river keeps talking")
    # reported logprobs stay raw: the same distribution, the bias only moves the choice
    assert banned.logprobs.top_logprobs[0] == plain.logprobs.top_logprobs[0]


@pytest.mark.parametrize("path,method,kw,status,frag", [
    ("/v1/nothing", "GET", {}, 404, "Not Found"),
    ("/v1/completions", "GET", {}, 405, "Method Not Allowed"),
    ("/v1/completions", "POST", {"content": b'{"prompt": "x"}', "headers": {"content-type": "text/plain"}},
     400, "Content-Type"),
    ("/v1/chat/completions", "POST", {"json": {"messages": [{"role": "user"}]}}, 400, "no content"),
    ("/v1/chat/completions", "POST", {"json": {"messages": [{"role": "user", "content": "x"}],
                                               "stream_options": {"include_usage": True}}}, 400,
     "stream_options"),
])
def test_every_error_has_openai_shape(url, path, method, kw, status, frag):
    r = httpx.request(method, url + path, timeout=60, **kw)
    err = r.json()["error"]
    assert r.status_code == status and frag in err["message"]
    assert set(err) == {"message", "type", "param", "code"}
