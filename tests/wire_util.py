"""The wire formats `fidelity serve` is checked against (tests/data/wire_formats.json,
written from docs/research/engine-integration.md and docs/research/engine-divergences.md) and what
tests/test_server_wire*.py share: the spec's sections, the prompt they tokenize, the type
words of the spec, and one SGLang /generate call."""
import json
from pathlib import Path

from needle_util import ok

SPEC = json.loads((Path(__file__).parent / "data" / "wire_formats.json").read_text())
GEN, VLLM, CAP, TOK, OPS = (SPEC[k] for k in ("sglang_generate", "vllm_prompt_logprobs", "captures",
                                             "tokenize", "ops"))
TRIPLE = SPEC["triple"]

SENTENCE = "The old man walked to the river."   # 11 tokens with the tiny model's tokenizer; its
#   tokens fall both inside and outside the top 3
CHAT = [{"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Where does the river run?"}]
K = 3                                             # top_logprobs_num / prompt_logprobs
START_K = 4                                       # a logprob_start_len > 0


def sentence_ids(http) -> list[int]:
    """SENTENCE's token ids, as the server's /tokenize gives them."""
    t = ok(http.post("/tokenize", json={"prompt": SENTENCE}))["tokens"]
    assert 8 <= len(t) <= 12, t
    return t


def generate(http, ids, **fields) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, **fields}
    out = ok(http.post(GEN["route"], json=body))
    for key in GEN["response_keys"]["top_level"]:
        assert key in out, f"/generate response lacks {key}"
    return out["meta_info"]


def is_type(v, kind: str) -> bool:
    return any({"number": isinstance(v, (int, float)) and not isinstance(v, bool),
                "integer": isinstance(v, int) and not isinstance(v, bool),
                "string": isinstance(v, str),
                "null": v is None}[k] for k in kind.split("|"))
