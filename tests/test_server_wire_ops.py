"""`fidelity serve`'s SGLang captures (indexer top-k, routed experts), its tokenize and
detokenize endpoints and its ops routes against the documented wire formats
(tests/data/wire_formats.json; the logprob formats: tests/test_server_wire.py). A real
server subprocess."""
import base64
import math

import numpy as np
import pytest

from needle_util import ok
from wire_util import CAP, CHAT, GEN, OPS, SENTENCE, TOK, generate, is_type, sentence_ids


@pytest.fixture(scope="module")
def ids(http):
    return sentence_ids(http)


@pytest.fixture(scope="module")
def model_info(http):
    info = ok(http.get(OPS["model_info"]["route"]))
    missing = [k for k in OPS["model_info"]["keys"] if k not in info]
    assert not missing, f"/get_model_info lacks {missing}"
    return info


# ---- captures --------------------------------------------------------------------------------

def decode_capture(s: str, shape: tuple[int, ...]) -> np.ndarray:
    assert isinstance(s, str)
    raw = base64.b64decode(s, validate=True)
    a = np.frombuffer(raw, dtype=CAP["encoding"]["dtype"])
    assert a.size == math.prod(shape), f"{a.size} int32 values, expected shape {shape}"
    return a.reshape(shape)


def test_captures(http, ids, model_info):
    meta = generate(http, ids, **{CAP["indexer_topk"]["request_flag"]: True,
                                  CAP["routed_experts"]["request_flag"]: True})
    rows = meta["prompt_tokens"] + meta["completion_tokens"] - 1          # seqlen - 1
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] >= 1
    csa = [i for i, r in enumerate(model_info["compress_ratios"]) if r == CAP["indexer_topk"]["compress_ratio"]]
    assert model_info["indexer_layers"] == csa and csa, "indexer layers = the compress_ratio 4 layers"

    idx = decode_capture(meta[CAP["indexer_topk"]["meta_key"]],
                         (rows, len(model_info["indexer_layers"]), model_info["index_topk"]))
    check_indexer_topk(idx)
    exp = decode_capture(meta[CAP["routed_experts"]["meta_key"]],
                         (rows, model_info["num_hidden_layers"], model_info["num_experts_per_tok"]))
    check_routed_experts(exp, model_info["n_routed_experts"])


def check_indexer_topk(idx: np.ndarray) -> None:
    """(seqlen - 1, CSA layers, index_topk): distinct compressed-key indices the row's token
    can see, then -1 padding to the end of the row."""
    spec = CAP["indexer_topk"]
    pad, ratio = spec["padding"], spec["compress_ratio"]
    assert idx.min() >= pad
    padded = filled = 0
    for t in range(idx.shape[0]):
        bound = (t + 1) // ratio                        # compressed keys token t can see
        for row in idx[t]:
            vals = row[row != pad]
            n = len(vals)
            assert (row[:n] != pad).all() and (row[n:] == pad).all(), f"row {t}: -1 not only at the tail: {row}"
            assert len(set(vals.tolist())) == n, f"row {t}: repeated indices {row}"
            assert (vals < bound).all(), f"row {t}: index beyond the {bound} visible compressed keys: {row}"
            padded += n < len(row)
            filled += n > 0
    assert padded and filled, "the prompt should give both padded and non-empty indexer rows"


def check_routed_experts(exp: np.ndarray, n_experts: int) -> None:
    """(seqlen - 1, layers, experts per token): distinct expert ids in [0, n_routed_experts)."""
    assert exp.min() >= 0 and exp.max() < n_experts, (exp.min(), exp.max())
    for t in range(exp.shape[0]):
        for layer, row in enumerate(exp[t]):
            assert len(set(row.tolist())) == len(row), f"token {t} layer {layer}: repeated experts {row}"


# ---- tokenize and ops ------------------------------------------------------------------------

@pytest.mark.parametrize("route", TOK["routes"])
def test_tokenize(http, route):
    want = set(TOK["response_keys"])
    got = {}
    for field in TOK["inputs"]:
        body = {"messages": CHAT} if field == "messages" else {field: SENTENCE}
        out = ok(http.post(route, json=body))
        assert set(out) == want, f"{route} {field}: keys {sorted(out)}"
        assert isinstance(out["tokens"], list) and all(is_type(i, "integer") for i in out["tokens"])
        assert out["count"] == len(out["tokens"]) > 0
        assert is_type(out["max_model_len"], "integer") and out["max_model_len"] >= out["count"]
        got[field] = out["tokens"]
    assert got["prompt"] == got["text"]
    assert got["messages"] != got["prompt"]
    chat = ok(http.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 1, "temperature": 0}))
    assert got["messages"] and len(got["messages"]) == chat["usage"]["prompt_tokens"]  # as for a chat completion
    (opt, flag), = TOK["optional_keys"].items()
    out = ok(http.post(route, json={"prompt": SENTENCE, flag: True}))
    assert set(out) == want | {opt} and len(out[opt]) == out["count"]


def test_tokenize_matches_generate_text(http, ids):
    meta = ok(http.post(GEN["route"], json={"text": SENTENCE, "sampling_params": {"max_new_tokens": 1}}))
    assert meta["meta_info"]["prompt_tokens"] == len(ids)


def test_detokenize_round_trip(http, ids):
    d = OPS["detokenize"]
    for text in (SENTENCE, "Rain fell on the old town."):
        toks = ok(http.post("/tokenize", json={"prompt": text}))["tokens"]
        assert ok(http.post(d["route"], json={d["request_key"]: toks}))[d["response_key"]] == text
    assert ok(http.post(d["route"], json={d["request_key"]: ids}))[d["response_key"]] == SENTENCE


def values(node):
    if isinstance(node, dict):
        for v in node.values():
            yield from values(v)
    elif isinstance(node, list):
        for v in node:
            yield from values(v)
    else:
        yield node


def test_ops(http):
    v = ok(http.get(OPS["version"]["route"]))
    assert is_type(v[OPS["version"]["response_key"]], OPS["version"]["type"]) and v["version"]
    info = ok(http.get(OPS["server_info"]["route"]))
    assert "golden" in set(values(info)), "/get_server_info should name the served arm"
    r = http.get(OPS["health_generate"]["route"])
    assert r.status_code == OPS["health_generate"]["status"], r.text
