"""One scoring request per (arm, prompt) in each engine's own wire format, and its response
parsed into per-position known distributions (docs/research/engine-integration.md §1):

  sglang   POST /generate: input_ids, return_logprob, logprob_start_len 0,
           top_logprobs_num k, token_ids_logprob (exact mode), greedy max_new_tokens N
  vllm     POST /v1/completions: token-id prompt, prompt_logprobs k (-1 = the vocabulary:
           exact mode), logprobs k, return_tokens_as_token_ids, greedy max_tokens N
  llamacpp POST /completion: teacher-forced prefixes, n_probs k (llamacpp_dialect.py)
  openai   POST /v1/completions: echo + logprobs k (top-k keyed by token text; mapped back
           to ids through the tokenizer, ambiguous texts dropped)

Position j of the result is the distribution after prompt token j (predicting token j+1;
the last one predicts the first new token); the greedy continuation ("decode ladder")
follows with one distribution per new token. The engine's echo of the prompt ids is
checked: scoring a different sequence than the one sent would compare nothing."""
from __future__ import annotations

import base64
from dataclasses import dataclass, field

import numpy as np

from .bounds import Known

DIALECTS = ("sglang", "vllm", "llamacpp", "openai")


class ScoringError(ValueError):
    """A response that cannot be scored (named: what is missing or wrong)."""


@dataclass
class PromptScores:
    """One arm's scores for one prompt, as parsed from its dialect's answer."""
    ids: list[int]                                  # the prompt, as the engine echoed it
    known: list[Known]                              # one per prompt position
    actual: list[float | None]                      # logprob of token j+1 at position j
    ranks: list[int | None]                         # its rank (vLLM only)
    ladder_tokens: list[int] = field(default_factory=list)
    ladder: list[Known] = field(default_factory=list)   # before each ladder token
    indexer: np.ndarray | None = None               # (rows, CSA layers, index_topk)
    experts: np.ndarray | None = None               # (rows, layers, experts per token)
    captures_missing: str | None = None             # why captures expected from the arm are absent
    # in-process only: the indexer's scores at the last prompt position, per CSA layer over its
    # compressed entries (-inf: not visible or padding) -- selection margins (kld/margins.py)
    index_scores: np.ndarray | None = None          # (CSA layers, entries)
    # llama.cpp only: prompt tokens the server evaluated to answer each position (1: the
    # decode path on a cached prefix; more: a prefill) -- what the teacher-forced reading read
    evaluated: np.ndarray | None = None             # (prompt positions,)


@dataclass
class Request:
    k: int                          # top-k per position
    steps: int                      # decode ladder length (greedy new tokens, >= 1)
    score_ids: tuple[int, ...] = ()  # exact mode (sglang): ids scored at every position
    full_vocab: bool = False        # exact mode (vllm): prompt_logprobs -1
    captures: bool = False
    model: str | None = None


def known_from_pairs(pairs, null_is_nan: bool = False) -> Known:
    """Known from (id, logprob) pairs; duplicate ids (the actual token also in the top-k)
    kept once. A null log-prob is left out (a first prompt token has none), or kept as NaN
    with `null_is_nan` (a server that writes non-finite logits as JSON null)."""
    d: dict[int, float] = {}
    for i, v in pairs:
        if v is not None:
            d.setdefault(int(i), float(v))
        elif null_is_nan:
            d.setdefault(int(i), float("nan"))
    ids = np.fromiter(d.keys(), dtype=np.int64, count=len(d))
    return Known(ids, np.fromiter(d.values(), dtype=np.float64, count=len(d)))


def _b64_int32(s: str, rows: int, *tail: int) -> np.ndarray:
    a = np.frombuffer(base64.b64decode(s), "<i4")
    width = int(np.prod(tail))
    if a.size % width or a.size // width != rows:
        raise ScoringError(f"capture has {a.size} values, expected {rows} rows of {width}")
    return a.reshape(rows, *tail).astype(np.int64)


# ---- SGLang ------------------------------------------------------------------------------
def sglang_request(ids: list[int], r: Request) -> tuple[str, dict]:
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


def sglang_parse(data: dict, ids: list[int], r: Request, shape: dict | None = None) -> PromptScores:
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
        sglang_captures(s, m, shape)
    return s


CAPTURE_SHAPE_KEYS = ("indexer_layers", "index_topk", "num_hidden_layers", "num_experts_per_tok")


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


def sglang_captures(s: PromptScores, meta: dict, shape: dict) -> PromptScores:
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


# ---- vLLM --------------------------------------------------------------------------------
def vllm_request(ids: list[int], r: Request) -> tuple[str, dict]:
    body = {"prompt": list(ids), "prompt_logprobs": -1 if r.full_vocab else r.k, "logprobs": r.k,
            "max_tokens": r.steps, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    if r.model:
        body["model"] = r.model
    return "/v1/completions", body


def _token_key(key: str, piece_ids: dict | None) -> int | None:
    if key.startswith("token_id:"):
        return int(key.split(":", 1)[1])
    if piece_ids is not None:
        return piece_ids.get(key)            # None when unknown or ambiguous
    return None


def _legacy_tops(lp: dict, piece_ids) -> list[list[tuple[int, float]]]:
    out = []
    for d in lp.get("top_logprobs") or []:
        out.append([] if d is None else [(i, v) for k, v in d.items()
                                          if (i := _token_key(k, piece_ids)) is not None])
    return out


def vllm_parse(data: dict, ids: list[int], r: Request, shape: dict | None = None) -> PromptScores:
    try:
        ch = data["choices"][0]
        plp = ch["prompt_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ScoringError("the completion has no choices[0].prompt_logprobs (vLLM: start the "
                           "server with --max-logprobs >= k)") from None
    n = len(ids)
    if plp is None or len(plp) != n:
        raise ScoringError(f"prompt_logprobs has {0 if plp is None else len(plp)} entries, the prompt "
                           f"has {n} (a response shorter than the prompt)")
    echoed = ch.get("prompt_token_ids")
    if echoed is not None and list(echoed) != list(ids):
        j = next(i for i, (a, b) in enumerate(zip(echoed, ids)) if a != b)
        raise ScoringError(f"the engine scored different token ids: position {j} is {echoed[j]}, sent {ids[j]}")
    known, actual, ranks = [], [], []
    for j in range(1, n):
        d = plp[j] or {}
        tok = str(ids[j])
        if tok not in d:
            raise ScoringError(f"prompt_logprobs[{j}] lacks the prompt token {ids[j]}")
        known.append(known_from_pairs((int(k), v["logprob"]) for k, v in d.items()))
        actual.append(d[tok]["logprob"])
        ranks.append(d[tok].get("rank"))
    lp = ch.get("logprobs") or {}
    tops = _legacy_tops(lp, None)
    toks = [_token_key(t, None) for t in lp.get("tokens") or []]
    if not tops or any(t is None for t in toks):
        raise ScoringError("the completion's logprobs lack token ids (needs logprobs k and "
                           "return_tokens_as_token_ids)")
    ladder = [known_from_pairs(tp + [(t, v)]) for tp, t, v in zip(tops, toks, lp["token_logprobs"])]
    return PromptScores(list(ids), known + [ladder[0]], actual + [None], ranks + [None],
                     [int(t) for t in toks], ladder)


# ---- OpenAI legacy echo ------------------------------------------------------------------
def openai_request(ids: list[int], r: Request) -> tuple[str, dict]:
    body = {"prompt": list(ids), "echo": True, "logprobs": r.k, "max_tokens": r.steps,
            "temperature": 0}
    if r.model:
        body["model"] = r.model
    return "/v1/completions", body


def openai_parse(data: dict, ids: list[int], r: Request, piece_ids: dict | None = None) -> PromptScores:
    try:
        lp = data["choices"][0]["logprobs"]
        toks, vals = lp["tokens"], lp["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ScoringError("the completion has no logprobs (echo + logprobs)") from None
    n = len(ids)
    if len(vals) < n + 1:
        raise ScoringError(f"echo returned {len(vals)} entries for a {n}-token prompt plus new "
                           "tokens (a response shorter than the prompt)")
    tops = _legacy_tops(lp, piece_ids)
    out_ids = [_token_key(t, piece_ids) for t in toks[n:]]
    if any(i is None for i in out_ids):
        raise ScoringError("cannot map the new tokens' text back to ids (give the tokenizer)")
    seq = list(ids) + out_ids
    known = [known_from_pairs(tops[j + 1] + [(seq[j + 1], vals[j + 1])]) for j in range(len(seq) - 1)]
    return PromptScores(list(ids), known[:n], [vals[j + 1] for j in range(n - 1)] + [None],
                     [None] * n, out_ids, known[n - 1:])


PARSERS = {"sglang": (sglang_request, sglang_parse), "vllm": (vllm_request, vllm_parse),
           "openai": (openai_request, openai_parse)}
