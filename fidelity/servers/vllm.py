"""vLLM: POST /v1/completions with prompt_logprobs (exact mode: -1, the whole vocabulary)
and token-id keyed top-k; detected by /version; launched with `vllm serve`, its toggles set
through the engine profiles of its version."""
from __future__ import annotations

from fidelity.scores.dialects import PromptScores, Request, ScoringError, known_from_pairs

from .base import Found, Generation, completions_body, completions_reply, legacy_tops, token_key
from .profiled import Profiled


class VLLM(Profiled):
    name = "vllm"
    hint = "vLLM: /v1/completions with prompt_logprobs (start vLLM with --max-logprobs >= k, or -1)"
    takes_ignore_eos = True
    exact = "full_vocab"

    def claims(self, found: Found) -> bool:
        return found.version is not None

    def scoring_request(self, ids, r):
        return request(ids, r)

    def parse_scores(self, data, ids, r, ep):
        return parse(data, ids, r)

    def generation(self, ids, g: Generation, ep):
        body = completions_body(ids, g, ep.model, {"ignore_eos": g.ignore_eos, "return_tokens_as_token_ids": True})
        return "/v1/completions", body, lambda d: completions_reply(d, None)

    def command(self, e):
        return [e.python, "-m", "vllm.entrypoints.cli.main", "serve", e.model, "--host", e.host,
                "--port", str(e.port)]

    def output_flags(self, captures, max_logprobs):
        return ["--max-logprobs", str(max_logprobs), "--logprobs-mode", "raw_logprobs"] \
            if max_logprobs is not None else []


def request(ids: list[int], r: Request) -> tuple[str, dict]:
    body = {"prompt": list(ids), "prompt_logprobs": -1 if r.full_vocab else r.k, "logprobs": r.k,
            "max_tokens": r.steps, "temperature": 0, "ignore_eos": True,
            "return_tokens_as_token_ids": True, "return_token_ids": True}
    if r.model:
        body["model"] = r.model
    return "/v1/completions", body


def parse(data: dict, ids: list[int], r: Request, shape: dict | None = None) -> PromptScores:
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
    tops = legacy_tops(lp, None)
    toks = [token_key(t, None) for t in lp.get("tokens") or []]
    if not tops or any(t is None for t in toks):
        raise ScoringError("the completion's logprobs lack token ids (needs logprobs k and "
                           "return_tokens_as_token_ids)")
    ladder = [known_from_pairs(tp + [(t, v)]) for tp, t, v in zip(tops, toks, lp["token_logprobs"])]
    return PromptScores(list(ids), known + [ladder[0]], actual + [None], ranks + [None],
                        [int(t) for t in toks], ladder)
