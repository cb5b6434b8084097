"""Parsing each engine's scoring response (shapes from docs/research/engine-integration.md
§1.1 / §1.2, written by hand here) into per-position distributions, and the errors that
name what is wrong: a response shorter than the prompt, a different echoed sequence, no
prompt logprobs."""
import numpy as np
import pytest

from fidelity.scores.dialects import Request, ScoringError
from fidelity.servers.openai import parse as openai_parse
from fidelity.servers.sglang import parse as sglang_parse
from fidelity.servers.vllm import parse as vllm_parse

IDS = [5, 7, 9]
REQ = Request(k=2, steps=2)


def _sglang(ids=IDS):
    return {"meta_info": {
        "input_token_logprobs": [[None, ids[0], None], [-1.0, ids[1], None], [-0.5, ids[2], None]],
        "input_top_logprobs": [None, [[-0.2, 3, None], [-1.0, 7, None]], [[-0.5, 9, None], [-1.5, 4, None]]],
        "output_token_logprobs": [[-0.1, 11, None], [-0.3, 12, None]],
        "output_top_logprobs": [[[-0.1, 11, None], [-2.5, 2, None]], [[-0.3, 12, None], [-1.6, 1, None]]]}}


def test_sglang_positions_and_ladder():
    s = sglang_parse(_sglang(), IDS, REQ)
    assert len(s.known) == 3 and s.ladder_tokens == [11, 12] and len(s.ladder) == 2
    k0 = dict(zip(s.known[0].ids.tolist(), s.known[0].logp.tolist()))
    assert k0 == {3: -0.2, 7: -1.0}                        # predicts token 1 (=7), listed once
    assert dict(zip(s.known[2].ids.tolist(), s.known[2].logp.tolist())) == {11: -0.1, 2: -2.5}
    assert s.actual == [-1.0, -0.5, None] and s.known[2] is s.ladder[0]


@pytest.mark.parametrize("mutate,frag", [
    (lambda d: d["meta_info"]["input_token_logprobs"].pop(), "shorter than the prompt"),
    (lambda d: d["meta_info"]["input_token_logprobs"][1].__setitem__(1, 8), "position 1 is 8, sent 7"),
    (lambda d: d.pop("meta_info"), "logprob_start_len 0"),
])
def test_sglang_errors_name_the_problem(mutate, frag):
    d = _sglang()
    mutate(d)
    with pytest.raises(ScoringError, match=frag):
        sglang_parse(d, IDS, REQ)


def _vllm():
    return {"choices": [{"prompt_token_ids": IDS, "prompt_logprobs": [
        None, {"7": {"logprob": -1.0, "rank": 2, "decoded_token": "b"},
               "3": {"logprob": -0.2, "rank": 1, "decoded_token": "x"}},
        {"9": {"logprob": -0.5, "rank": 1, "decoded_token": "c"},
         "4": {"logprob": -1.5, "rank": 2, "decoded_token": "y"}}],
        "logprobs": {"tokens": ["token_id:11", "token_id:12"], "token_logprobs": [-0.1, -0.3],
                     "top_logprobs": [{"token_id:11": -0.1, "token_id:2": -2.5},
                                      {"token_id:12": -0.3, "token_id:1": -1.6}]}}]}


def test_vllm_matches_sglang_on_the_same_numbers():
    a, b = vllm_parse(_vllm(), IDS, REQ), sglang_parse(_sglang(), IDS, REQ)
    for x, y in zip(a.known + a.ladder, b.known + b.ladder):
        assert dict(zip(x.ids.tolist(), x.logp.tolist())) == dict(zip(y.ids.tolist(), y.logp.tolist()))
    assert a.ranks == [2, 1, None] and a.ladder_tokens == b.ladder_tokens


def test_vllm_errors():
    d = _vllm()
    d["choices"][0]["prompt_logprobs"] = None
    with pytest.raises(ScoringError, match="shorter than the prompt"):
        vllm_parse(d, IDS, REQ)
    d = _vllm()
    del d["choices"][0]["prompt_logprobs"][1]["7"]
    with pytest.raises(ScoringError, match="lacks the prompt token 7"):
        vllm_parse(d, IDS, REQ)
    d = _vllm()
    d["choices"][0]["prompt_token_ids"] = [5, 7, 8]
    with pytest.raises(ScoringError, match="position 2 is 8"):
        vllm_parse(d, IDS, REQ)
    with pytest.raises(ScoringError, match="--max-logprobs"):
        vllm_parse({"choices": [{"text": "x"}]}, IDS, REQ)


def test_openai_text_keys_mapped_and_ambiguous_dropped():
    pieces = {"a": 5, "b": 7, "c": 9, "x": 3, "y": 4, "n": 11, "m": 12}   # "z" is ambiguous: absent
    d = {"choices": [{"logprobs": {
        "tokens": ["a", "b", "c", "n", "m"], "token_logprobs": [None, -1.0, -0.5, -0.1, -0.3],
        "top_logprobs": [None, {"x": -0.2, "b": -1.0}, {"c": -0.5, "z": -1.5}, {"n": -0.1}, {"m": -0.3}]}}]}
    s = openai_parse(d, IDS, REQ, pieces)
    assert s.ladder_tokens == [11, 12]
    assert set(s.known[1].ids.tolist()) == {9}                 # "z" dropped, actual kept
    assert np.isclose(s.known[0].logp[s.known[0].ids == 3][0], -0.2)
    with pytest.raises(ScoringError, match="shorter than the prompt"):
        openai_parse({"choices": [{"logprobs": {"tokens": ["a"], "token_logprobs": [None],
                                                "top_logprobs": [None]}}]}, IDS, REQ, pieces)


def _mlx(ids=IDS, k=2):
    """A /score answer of fidelity's mlx-vlm harness, written by hand: top-k per position and
    per ladder step as base64 arrays (ids int32, log-probs float64)."""
    import base64

    def b64(a, dt):
        return base64.b64encode(np.asarray(a, dt).tobytes()).decode()
    return {"ids": list(ids), "k": k, "route": "decode", "calls": [1] * len(ids),
            "top_ids": b64([[7, 3], [9, 4], [11, 2]], np.int32),
            "top_logprobs": b64([[-0.1, -2.5], [-0.5, -1.5], [-0.1, -2.5]], np.float64),
            "actual": b64([-0.1, -0.5], np.float64), "ladder_tokens": [11, 12],
            "ladder_ids": b64([[11, 2], [12, 1]], np.int32), "ladder_logprobs": b64([[-0.1, -2.5], [-0.3, -1.6]], np.float64)}


def test_mlx_vlm_positions_and_ladder():
    from fidelity.servers.mlx_vlm import parse as mlx_parse
    s = mlx_parse(_mlx(), IDS)
    assert len(s.known) == 3 and s.ladder_tokens == [11, 12] and len(s.ladder) == 2
    assert dict(zip(s.known[0].ids.tolist(), s.known[0].logp.tolist())) == {7: -0.1, 3: -2.5}
    assert s.actual == [-0.1, -0.5, None] and s.known[1].get(9) == -0.5
    assert dict(zip(s.ladder[1].ids.tolist(), s.ladder[1].logp.tolist())) == {12: -0.3, 1: -1.6}


@pytest.mark.parametrize("mutate,frag", [
    (lambda d: d.__setitem__("ids", [5, 7, 8]), "does not echo the prompt's ids"),
    (lambda d: d.pop("top_logprobs"), "`top_logprobs` is missing"),
    (lambda d: d.__setitem__("k", 3), "`top_ids` is missing or is not an int32 array of shape (3, 3)"),
    (lambda d: d.pop("ladder_tokens"), "lacks `k` or `ladder_tokens`"),
])
def test_mlx_vlm_errors_name_the_problem(mutate, frag):
    from fidelity.servers.mlx_vlm import parse as mlx_parse
    d = _mlx()
    mutate(d)
    with pytest.raises(ScoringError, match=frag.replace("(", r"\(").replace(")", r"\)")):
        mlx_parse(d, IDS)
