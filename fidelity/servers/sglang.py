"""SGLang: POST /generate with return_logprob from position 0 (prompt and decode logprobs in
one answer), exact mode through token_ids_logprob, indexer / routed-expert captures when
launched with them; detected by /get_model_info; launched with sglang.launch_server, its
toggles set through the engine profiles of its version."""
from __future__ import annotations

import base64

import numpy as np

from fidelity.scores.dialects import PromptScores, Request, ScoringError, known_from_pairs

from .base import Found, Generation, Reply
from .profiled import Profiled

CAPTURE_SHAPE_KEYS = ("indexer_layers", "index_topk", "num_hidden_layers", "num_experts_per_tok")


class SGLang(Profiled):
    name = "sglang"
    hint = "SGLang: POST /generate with return_logprob (any recent SGLang)"
    takes_ignore_eos = True
    exact = "score_ids"
    captures = True
    ready_path = "/health_generate"

    def claims(self, found: Found) -> bool:
        return found.model_info is not None

    def scoring_request(self, ids, r):
        return request(ids, r)

    def parse_scores(self, data, ids, r, ep):
        return parse(data, ids, r)

    def generation(self, ids, g: Generation, ep):
        sp = {"max_new_tokens": g.max_tokens, "temperature": g.temperature, "ignore_eos": g.ignore_eos}
        if g.seed is not None:
            sp["sampling_seed"] = g.seed
        body = {"input_ids": list(ids), "return_logprob": True, "top_logprobs_num": g.k, "sampling_params": sp}
        return "/generate", {**body, **({"model": ep.model} if ep.model else {})}, reply

    def command(self, e):
        return [e.python, "-m", "sglang.launch_server", "--model-path", e.model, "--host", e.host,
                "--port", str(e.port)]

    def output_flags(self, captures, max_logprobs):
        return ["--enable-return-indexer-topk", "--enable-return-routed-experts"] if captures else []


def request(ids: list[int], r: Request) -> tuple[str, dict]:
    body = {"input_ids": list(ids), "return_logprob": True, "logprob_start_len": 0,
            "top_logprobs_num": r.k,
            "sampling_params": {"max_new_tokens": r.steps, "temperature": 0, "ignore_eos": True}}
    if r.score_ids:
        body["token_ids_logprob"] = list(r.score_ids)
    if r.captures:
        body["return_indexer_topk"] = body["return_routed_experts"] = True
    if r.model:
        body["model"] = r.model
    return "/generate", body


def parse(data: dict, ids: list[int], r: Request, shape: dict | None = None) -> PromptScores:
    try:
        m = data["meta_info"]
        inp, top = m["input_token_logprobs"], m["input_top_logprobs"]
        out_tok, out_top = m["output_token_logprobs"], m["output_top_logprobs"]
    except (KeyError, TypeError):
        raise ScoringError("the /generate response has no meta_info input/output logprobs "
                           "(needs return_logprob with logprob_start_len 0)") from None
    n = len(ids)
    if len(inp) != n or len(top) != n:
        raise ScoringError(f"the response scores {len(inp)} prompt positions, the prompt has {n} "
                           "(a response shorter than the prompt)")
    echoed = [int(e[1]) for e in inp]
    if echoed != list(ids):
        j = next(i for i, (a, b) in enumerate(zip(echoed, ids)) if a != b)
        raise ScoringError(f"the engine scored different token ids: position {j} is {echoed[j]}, "
                           f"sent {ids[j]}")
    tid_in = m.get("input_token_ids_logprobs") if r.score_ids else None
    tid_out = m.get("output_token_ids_logprobs") if r.score_ids else None
    if r.score_ids and (tid_in is None or tid_out is None):
        raise ScoringError("exact mode: the response has no input/output_token_ids_logprobs")

    def pos(j):                           # distribution after prompt token j < n-1
        pairs = [(e[1], e[0]) for e in top[j + 1] or []] + [(inp[j + 1][1], inp[j + 1][0])]
        if tid_in is not None:
            pairs += [(e[1], e[0]) for e in tid_in[j + 1] or []]
        return known_from_pairs(pairs)

    known = [pos(j) for j in range(n - 1)]
    ladder = []
    for t, e in enumerate(out_tok):
        pairs = [(x[1], x[0]) for x in out_top[t] or []] + [(e[1], e[0])]
        if tid_out is not None:
            pairs += [(x[1], x[0]) for x in tid_out[t] or []]
        ladder.append(known_from_pairs(pairs))
    if not ladder:
        raise ScoringError("the response has no output token (max_new_tokens >= 1 was sent)")
    s = PromptScores(list(ids), known + [ladder[0]], [inp[j + 1][0] for j in range(n - 1)] + [None],
                     [None] * n, [int(e[1]) for e in out_tok], ladder)
    if r.captures and shape and "indexer_topk" in m:
        captures(s, m, shape)
    return s


def reply(d: dict) -> Reply:
    """A /generate answer's tokens, top-k before each, cached prompt tokens, stop reason and
    speculative-decoding counts."""
    try:
        m = d["meta_info"]
        out, tops = m["output_token_logprobs"], m["output_top_logprobs"]
    except (KeyError, TypeError):
        raise ScoringError("the /generate answer has no meta_info output logprobs") from None
    dists = [known_from_pairs([(x[1], x[0]) for x in top or []] + [(e[1], e[0])]) for e, top in zip(out, tops)]
    finish = (m.get("finish_reason") or {}).get("type", "") if isinstance(m.get("finish_reason"), dict) \
        else str(m.get("finish_reason") or "")
    spec = {k: v for k, v in m.items() if k.startswith("spec_")} or None
    return Reply([int(e[1]) for e in out], dists, m.get("cached_tokens"), finish, spec)


def capture_shape(info) -> dict | None:
    """The shape facts a client needs to read captures, from /get_model_info (None when
    the answer does not give them all)."""
    if isinstance(info, dict) and all(k in info for k in CAPTURE_SHAPE_KEYS):
        ratios = {"compress_ratios": info["compress_ratios"]} if "compress_ratios" in info else {}
        return {**{k: info[k] for k in CAPTURE_SHAPE_KEYS}, **ratios}
    return None


def has_captures(data) -> bool:
    m = data.get("meta_info") if isinstance(data, dict) else None
    return isinstance(m, dict) and "indexer_topk" in m and "routed_experts" in m


def _b64_int32(s: str, rows: int, *tail: int) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s), "<i4")
    width = int(np.prod(tail))
    if a.size % width or a.size // width != rows:
        raise ScoringError(f"capture has {a.size} values, expected {rows} rows of {width}")
    return a.reshape(rows, *tail).astype(np.int64)


def captures(s: PromptScores, meta: dict, shape: dict) -> PromptScores:
    """Decode a /generate answer's indexer top-k and routed experts into `s` (ScoringError
    when their sizes do not fit the prompt and shape)."""
    rows = len(s.ids) + len(s.ladder_tokens) - 1
    try:
        idx = _b64_int32(meta["indexer_topk"], rows, len(shape["indexer_layers"]), shape["index_topk"])
        exp = _b64_int32(meta["routed_experts"], rows, shape["num_hidden_layers"],
                         shape["num_experts_per_tok"])
    except ScoringError:
        raise
    except (TypeError, ValueError) as e:                     # not base64, not a string
        raise ScoringError(f"captures cannot be decoded ({e})") from None
    s.indexer, s.experts = idx, exp
    return s
