"""Any OpenAI-compatible server: /v1/completions with echo + logprobs, the top-k keyed by
token text and mapped back to ids through the tokenizer (texts several ids share are
dropped: looser KL bounds); the dialect every server is read in when it answers none of
the engines' own discovery routes. Not launched (an already running server is `external`)."""
from __future__ import annotations

from fidelity.scores.dialects import PromptScores, Request, ScoringError, known_from_pairs

from .base import Found, Server, legacy_tops, token_key


class OpenAI(Server):
    name = "openai"
    hint = "OpenAI-compatible: /v1/completions with echo + logprobs"
    caveat = ("was read through the OpenAI dialect: its top-k comes keyed by text and is mapped back to ids through the tokenizer (texts several "
              "ids share are dropped), and it may report no cached-token count: bit-identity and greedy "
              "tokens are as strong as elsewhere, the KL bounds are looser.")

    def claims(self, found: Found) -> bool:
        return True                                  # the fallback: registered last

    def scoring_request(self, ids, r):
        return request(ids, r)

    def parse_scores(self, data, ids, r, ep):
        return parse(data, ids, r, ep.piece_ids() if ep is not None else None)


def request(ids: list[int], r: Request) -> tuple[str, dict]:
    body = {"prompt": list(ids), "echo": True, "logprobs": r.k, "max_tokens": r.steps,
            "temperature": 0}
    if r.model:
        body["model"] = r.model
    return "/v1/completions", body


def parse(data: dict, ids: list[int], r: Request, piece_ids: dict | None = None) -> PromptScores:
    try:
        lp = data["choices"][0]["logprobs"]
        toks, vals = lp["tokens"], lp["token_logprobs"]
    except (KeyError, IndexError, TypeError):
        raise ScoringError("the completion has no logprobs (echo + logprobs)") from None
    n = len(ids)
    if len(vals) < n + 1:
        raise ScoringError(f"echo returned {len(vals)} entries for a {n}-token prompt plus new "
                           "tokens (a response shorter than the prompt)")
    tops = legacy_tops(lp, piece_ids)
    out_ids = [token_key(t, piece_ids) for t in toks[n:]]
    if any(i is None for i in out_ids):
        raise ScoringError("cannot map the new tokens' text back to ids (give the tokenizer)")
    seq = list(ids) + out_ids
    known = [known_from_pairs(tops[j + 1] + [(seq[j + 1], vals[j + 1])]) for j in range(len(seq) - 1)]
    return PromptScores(list(ids), known[:n], [vals[j + 1] for j in range(n - 1)] + [None],
                        [None] * n, out_ids, known[n - 1:])
