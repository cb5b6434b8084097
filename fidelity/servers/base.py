"""What every engine module answers (fidelity.servers): how it is detected, how it is asked
for scores and for generations and how its answers are read, what route tokenizes, what a
report must say about its reading, its in-process twin, and how it is launched. Defaults
are a plain OpenAI-compatible server's; each engine overrides what it does differently.
Also the wire types the generation requests share (Generation, Reply) and the parsers of
OpenAI's completions shape, which vLLM and plain OpenAI servers both answer in."""
from __future__ import annotations

from dataclasses import dataclass

from fidelity.scores.bounds import Known
from fidelity.scores.dialects import ScoringError, known_from_pairs


@dataclass
class Reply:
    """One generation: its tokens, the distribution (top-k and the chosen token)
    before each, how many prompt tokens the engine reports from its cache (None: it does
    not say) and why it ended."""
    tokens: list[int]
    dists: list[Known]
    cached: int | None
    finish: str
    spec: dict | None = None     # the engine's speculative-decoding counts (SGLang meta_info spec_*)


@dataclass(frozen=True)
class Generation:
    """What a probe asks an engine to generate: how many tokens, the top-k reported before
    each, past EOS or not (where the dialect has the field), greedy unless `temperature`,
    and a seed where the engine takes one."""
    max_tokens: int
    k: int = 5
    ignore_eos: bool = True
    temperature: float = 0.0
    seed: int | None = None


@dataclass
class Found:
    """What discovery read from a server (None: the route is absent)."""
    model_info: dict | None = None        # GET /get_model_info (SGLang, fidelity serve)
    version: object = None                # GET /version (vLLM)
    llama_server: bool = False            # GET /props answered as llama-server does
    props: dict | None = None             # GET /props, whoever answered it


class Server:
    """One engine kind. `name` is both its wire dialect (as `--endpoint NAME=URL@dialect`
    and stored results spell it) and its launch kind in an engines TOML."""
    name = ""
    hint = ""                             # the scoring route it needs, for error messages
    wire = True                           # scored over HTTP in its own dialect
    takes_ignore_eos = False              # honours ignore_eos (vLLM's and SGLang's extension)
    exact = None                          # exact-mode request: "score_ids" (SGLang) | "full_vocab" (vLLM)
    captures = False                      # answers carry indexer / expert captures
    reading: str | None = None            # how its positions are read, when not from one prefill
    caveat: str | None = None             # what a reading through it cannot show ("`arm` <caveat>")
    ready_path = "/health"                # what a launcher polls until ready
    ready_poll = 1.0                      # seconds between polls
    profiled = False                      # toggles map to its settings through the engine profiles (per version)
    launch_needs = ""                     # what an engines TOML block must give (checked by `check`)

    # ---- discovery ----------------------------------------------------------------------
    def claims(self, found: Found) -> bool:
        """This server answered discovery as this engine does."""
        return False

    def props_summary(self, props) -> dict | None:
        """What a report keeps of a /props answer in this engine's shape (None: not its shape)."""
        return None

    # ---- scoring (fidelity kld) ---------------------------------------------------------
    def scoring_request(self, ids: list[int], r) -> tuple[str, dict]:
        raise NotImplementedError(f"{self.name} has no single scoring request")

    def parse_scores(self, data: dict, ids: list[int], r, ep):
        raise NotImplementedError(f"{self.name} has no single scoring answer")

    def score(self, ep, ids: list[int], r, retry: bool):
        """One prompt's scores; by default one request (ids per request chunked by the
        endpoint for exact mode)."""
        return ep.score_in_requests(self, ids, r, retry)

    def tokenize_body(self, text: str, model: str | None) -> dict:
        return {"prompt": text, "model": model}

    # ---- generation (fidelity consistency) -------------------------------------------------
    def generation(self, ids: list[int], g: Generation, ep) -> tuple[str, dict, object]:
        """(path, body, parse) of one generation with output logprobs."""
        body = completions_body(ids, g, ep.model)
        return "/v1/completions", body, lambda d: completions_reply(d, ep.piece_ids())

    # ---- twin (fidelity.kld.twin, fidelity.engines.twins) --------------------------------------
    def twin_of_endpoint(self, ep) -> tuple[str, str] | None:
        """(arm spelling, where it came from) of a served endpoint's twin, or None."""
        return None

    def twin_of_arm(self, e, arm) -> tuple[str, str] | None:
        """(arm spelling, where it came from) of a launched arm's twin, or None."""
        return None

    # ---- launch (fidelity engines) ------------------------------------------------------
    def check(self, e, where: str) -> str | None:
        """What an engines TOML block of this kind lacks, in words; None when complete."""
        return None

    def command(self, e) -> list[str]:
        raise NotImplementedError(f"{self.name} cannot be launched")

    def numerics(self, arm, e, env: dict, flags: list, notes: list) -> None:
        """The arm's toggles as this engine's flags and env (added to `flags`, `env`);
        refusals raise SpecError naming the toggle."""

    def flag_factors(self, flags: list[str], env: dict[str, str]) -> tuple[set[str], bool] | None:
        """(toggles, patched beyond them) an arm's own flags and env set, for an engine whose
        flags are read as toggles; None for one whose are not."""
        return None

    def output_flags(self, captures: bool, max_logprobs: int | None) -> list[str]:
        """Launch flags for what scoring needs from it (captures, enough logprobs)."""
        return []


def completions_body(ids, g: Generation, model, extra: dict | None = None) -> dict:
    body = {"prompt": list(ids), "max_tokens": g.max_tokens, "temperature": g.temperature, "logprobs": g.k}
    if g.seed is not None:
        body["seed"] = g.seed
    body.update(extra or {})
    return {**body, **({"model": model} if model else {})}


def token_key(key: str, piece_ids: dict | None) -> int | None:
    """A completions top-k key as a token id: `token_id:N`, else its text through `piece_ids`."""
    if key.startswith("token_id:"):
        return int(key.split(":", 1)[1])
    if piece_ids is not None:
        return piece_ids.get(key)            # None when unknown or ambiguous
    return None


def legacy_tops(lp: dict, piece_ids) -> list[list[tuple[int, float]]]:
    """The completions shape's `top_logprobs` (one dict per token) as (id, logprob) pairs."""
    out = []
    for d in lp.get("top_logprobs") or []:
        out.append([] if d is None else [(i, v) for k, v in d.items()
                                          if (i := token_key(k, piece_ids)) is not None])
    return out


def completions_reply(d: dict, piece_ids: dict | None) -> Reply:
    try:
        ch = d["choices"][0]
        lp = ch["logprobs"]
        toks, vals, tops = lp["tokens"], lp["token_logprobs"], lp.get("top_logprobs") or []
    except (KeyError, IndexError, TypeError):
        raise ScoringError("the completion has no choices[0].logprobs (send logprobs k)") from None
    ids = [token_key(t, piece_ids) for t in toks]
    if any(i is None for i in ids):
        raise ScoringError("cannot map the generated tokens' text back to ids (give --tokenizer)")
    dists = []
    for i, v, top in zip(ids, vals, tops + [None] * (len(ids) - len(tops))):
        pairs = [(j, x) for t, x in (top or {}).items() if (j := token_key(t, piece_ids)) is not None]
        dists.append(known_from_pairs(pairs + [(i, v)]))
    cached = ((d.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return Reply(ids, dists, cached, str(ch.get("finish_reason") or ""))
