"""A sampled stop token (EOS, or a `stop_token_ids` id) is returned as the engines return
it: in token ids and in every logprob list, its text left out, so logprob entries equal
`completion_tokens` at every place it can occur (echo with max_tokens 1 as lm-eval scores,
a normal generation, streaming, chat, SGLang /generate). Checked against the in-process
Decoder and, for the values, against a teacher-forced prefill of prompt + output (a second
path through the model). A real `fidelity serve` process."""
import json

import httpx
import pytest
import torch

from fidelity.design.arms import parse_arm
from fidelity.weights.target import load_target
from reference_model import Model
from reference_model.generate import Decoder, Sampling, Scoring
from reference_model.tokenizer import EOS, render_chat

from needle_util import ok

T = load_target(None)
TOK = T.tokenizer
MODEL = Model(T.weights, parse_arm("golden").numerics())
SYSTEM = {"role": "system", "content": "Answer in one word."}


def chat_ids(question: str) -> list[int]:
    return TOK.encode(render_chat([SYSTEM, {"role": "user", "content": question}], thinking=False))


EOS_NOW = chat_ids("What is the secret number?")        # greedy: EOS is the first token
EOS_LATER = chat_ids("Where does the river run?")       # greedy: some text, then EOS


def decode(ids, max_tokens, k=1, stop_ids=()):
    """The in-process golden answer (greedy, EOS + stop ids end it)."""
    return Decoder(MODEL, ids, max_tokens, Sampling(0.0), {TOK.eos_id, *stop_ids},
                   Scoring(top=k)).run()


def forced_logprobs(ids, out) -> list[float]:
    """log p(out[j] | ids + out[:j]) from one prefill of ids + out (fp64 log-softmax)."""
    logits = MODEL.prefill_logits(torch.tensor(list(ids) + list(out)))
    lp = torch.log_softmax(logits.double(), -1)
    return [float(lp[len(ids) - 1 + j, t]) for j, t in enumerate(out)]


def sse(http, path, body) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_the_prompts_end_in_eos_in_process():
    now, later = decode(EOS_NOW, 60), decode(EOS_LATER, 60)
    assert now.tokens == [] and now.stop_token == TOK.eos_id
    assert len(later.tokens) >= 3 and later.stop_token == TOK.eos_id
    assert later.output_ids == later.tokens + [TOK.eos_id] and len(later.logprobs) == len(later.output_ids)


def test_echo_max_tokens_1_scores_the_eos_as_lm_eval_reads_it(http):
    """lm-eval's loglikelihood request; it sums token_logprobs[ctxlen:-1]."""
    r = ok(http.post("/v1/completions", json={"prompt": EOS_NOW, "max_tokens": 1, "logprobs": 1,
                                              "echo": True, "temperature": 0}))
    ch, n = r["choices"][0], len(EOS_NOW)
    assert r["usage"]["completion_tokens"] == 1 and ch["finish_reason"] == "stop"
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 1
    assert lp["tokens"][-1] == EOS and ch["stop_reason"] is None
    assert ch["text"] == TOK.decode(EOS_NOW, skip_special_tokens=False)      # no EOS text
    full = forced_logprobs(EOS_NOW[:1], EOS_NOW[1:] + [TOK.eos_id])         # every position
    for got, want in zip(lp["token_logprobs"][1:], full):
        assert got == pytest.approx(want, abs=1e-6)
    ctxlen = n - 3                                                          # a 3-token continuation
    assert sum(lp["token_logprobs"][ctxlen:-1]) == pytest.approx(sum(full[ctxlen - 1:n - 1]), abs=1e-6)


def test_generation_ending_in_eos_non_streamed(http):
    g = decode(EOS_LATER, 60, k=2)
    r = ok(http.post("/v1/completions", json={"prompt": EOS_LATER, "max_tokens": 60, "logprobs": 2,
                                              "temperature": 0, "return_token_ids": True}))
    ch = r["choices"][0]
    n = r["usage"]["completion_tokens"]
    assert n == len(g.output_ids) == len(ch["token_ids"]) == len(ch["logprobs"]["token_logprobs"])
    assert ch["token_ids"] == g.output_ids and ch["token_ids"][-1] == TOK.eos_id
    assert ch["logprobs"]["token_logprobs"] == [s.logprob for s in g.scores]
    assert ch["logprobs"]["token_logprobs"] == pytest.approx(forced_logprobs(EOS_LATER, g.output_ids),
                                                             abs=1e-6)
    assert ch["logprobs"]["tokens"][-1] == EOS and len(ch["logprobs"]["top_logprobs"][-1]) == 2
    assert ch["text"] == TOK.decode(g.tokens) and EOS not in ch["text"]


def test_stop_token_id_is_returned_with_its_logprob(http):
    ids = TOK.encode("The river keeps talking")
    plain = decode(ids, 8)
    assert len(plain.tokens) == 8
    stop = plain.tokens[3]
    first = plain.tokens.index(stop)                     # it may occur earlier
    g = decode(ids, 8, stop_ids=[stop])
    assert g.output_ids == plain.tokens[:first + 1]
    r = ok(http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "logprobs": 1,
                                              "temperature": 0, "stop_token_ids": [stop],
                                              "return_token_ids": True}))
    ch = r["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["stop_reason"] == stop
    assert ch["token_ids"] == g.output_ids and r["usage"]["completion_tokens"] == first + 1
    assert ch["logprobs"]["token_logprobs"] == [s.logprob for s in g.scores]
    assert ch["text"] == TOK.decode(plain.tokens[:first])          # the stop token's text left out


def test_streamed_completion_carries_the_eos_in_its_last_chunk(http):
    g = decode(EOS_LATER, 60)
    body = {"prompt": EOS_LATER, "max_tokens": 60, "logprobs": 1, "temperature": 0,
            "stream_options": {"include_usage": True}}
    chunks = sse(http, "/v1/completions", body)
    usage = chunks[-1]["usage"]
    ents = [v for c in chunks[:-1] for ch in c["choices"] if ch["logprobs"]
            for v in ch["logprobs"]["token_logprobs"]]
    toks = [t for c in chunks[:-1] for ch in c["choices"] if ch["logprobs"] for t in ch["logprobs"]["tokens"]]
    assert len(ents) == usage["completion_tokens"] == len(g.output_ids)
    assert ents == [s.logprob for s in g.scores] and toks[-1] == EOS
    last = chunks[-2]["choices"][0]
    assert last["finish_reason"] == "stop" and last["text"] == "" and last["logprobs"]["tokens"] == [EOS]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == TOK.decode(g.tokens)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_include_the_eos(http, stream):
    g = decode(EOS_LATER, 60, k=2)
    body = {"messages": [SYSTEM, {"role": "user", "content": "Where does the river run?"}],
            "max_tokens": 60, "temperature": 0, "logprobs": True, "top_logprobs": 2,
            "chat_template_kwargs": {"thinking": False}}
    if stream:
        chunks = sse(http, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
        ents = [e for c in chunks[:-1] for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
        n = chunks[-1]["usage"]["completion_tokens"]
        assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    else:
        r = ok(http.post("/v1/chat/completions", json=body))
        ents, n = r["choices"][0]["logprobs"]["content"], r["usage"]["completion_tokens"]
        assert r["choices"][0]["message"]["content"] == TOK.decode(g.tokens)
    assert r_prompt_ok(http, body)
    assert len(ents) == n == len(g.output_ids)
    assert [e["logprob"] for e in ents] == [s.logprob for s in g.scores]
    assert ents[-1]["token"] == EOS and len(ents[-1]["top_logprobs"]) == 2


def r_prompt_ok(http, body) -> bool:
    """The chat route renders the same prompt the oracle decodes."""
    return ok(http.post("/tokenize", json={"messages": body["messages"],
                                           "chat_template_kwargs": {"thinking": False}}))["tokens"] == EOS_LATER


def test_sglang_generate_output_logprobs_include_the_eos(http):
    g = decode(EOS_LATER, 60, k=2)
    r = ok(http.post("/generate", json={"input_ids": EOS_LATER, "return_logprob": True,
                                        "top_logprobs_num": 2,
                                        "sampling_params": {"max_new_tokens": 60, "temperature": 0}}))
    m = r["meta_info"]
    assert r["output_ids"] == g.output_ids and m["completion_tokens"] == len(g.output_ids)
    assert m["finish_reason"] == {"type": "stop", "matched": TOK.eos_id}
    assert len(m["output_token_logprobs"]) == len(m["output_top_logprobs"]) == len(g.output_ids)
    assert [t[0] for t in m["output_token_logprobs"]] == [s.logprob for s in g.scores]
    assert m["output_token_logprobs"][-1][1] == TOK.eos_id
    assert r["text"] == TOK.decode(g.tokens)


# ---- batched completions prompts ------------------------------------------------------------
@pytest.mark.parametrize("as_ids", [False, True])
def test_batched_prompts_are_answered_one_by_one_in_order(http, as_ids):
    texts = ["The river keeps talking", "The old man walked", "Hello river"]
    prompts = [TOK.encode(t) for t in texts] if as_ids else texts
    body = {"max_tokens": 4, "temperature": 0, "logprobs": 1, "echo": True, "return_token_ids": True}
    r = ok(http.post("/v1/completions", json={**body, "prompt": prompts}))
    assert [c["index"] for c in r["choices"]] == [0, 1, 2]
    n_prompt = n_out = 0
    for t, ch in zip(texts, r["choices"]):
        ids = TOK.encode(t)
        g = Decoder(MODEL, ids, 4, Sampling(0.0), {TOK.eos_id}, Scoring(top=1, prompt_top=1, prompt_from=0)).run()
        assert ch["prompt_token_ids"] == ids and ch["token_ids"] == g.output_ids
        assert ch["logprobs"]["token_logprobs"] == [None] + [s.logprob for s in g.prompt_scores[1:]] + \
            [s.logprob for s in g.scores]                               # bit-identical to in-process
        single = ok(http.post("/v1/completions", json={**body, "prompt": ids}))["choices"][0]
        assert {**single, "index": ch["index"]} == ch
        n_prompt, n_out = n_prompt + len(ids), n_out + len(g.output_ids)
    assert r["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                          "total_tokens": n_prompt + n_out,
                          "prompt_tokens_details": {"cached_tokens": 0}}     # prompts < a page


def test_batched_prompts_stream_with_their_indices(http):
    texts = ["The river keeps talking", "Hello river"]
    chunks = sse(http, "/v1/completions", {"prompt": texts, "max_tokens": 3, "temperature": 0,
                                           "stream_options": {"include_usage": True}})
    plain = ok(http.post("/v1/completions", json={"prompt": texts, "max_tokens": 3, "temperature": 0}))
    for i in range(2):
        got = "".join(ch["text"] for c in chunks[:-1] for ch in c["choices"] if ch["index"] == i)
        assert got == plain["choices"][i]["text"]
    assert chunks[-1]["usage"] == plain["usage"]


@pytest.mark.parametrize("prompt,frag", [([], "prompt"), (["x", [1, 2]], "mixes"), ([1, "x"], "mixes"),
                                         ([[1, 2], []], "prompt[1]"), (["x", ""], "prompt[1]"),
                                         ([[1, 99999]], "prompt[0]")])
def test_bad_batches_name_the_prompt(http, prompt, frag):
    r = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
    assert r.status_code == 400 and frag in r.json()["error"]["message"], r.text
