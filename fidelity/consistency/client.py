"""A live server as the consistency probes see it: kld's Endpoint (model choice, dialect
detection, prompt scoring, the shared retry policy) plus a plain generation (greedy, or
sampled for long generations) with output logprobs -- no prompt logprobs, because
engines skip their prefix cache for those (vLLM's prompt_logprobs, SGLang's
logprob_start_len) -- the prompt tokens the engine says it took from its cache, streamed
filler requests, its cache-flush route, and the serving sizes it reports."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import httpx

from infra.http import RequestFailed, check_status, retry, send, transport_failure

from fidelity.kld import llamacpp_dialect as L
from fidelity.kld.bounds import Known
from fidelity.kld.dialects import ScoringError, known_from_pairs
from fidelity.kld.endpoint import Endpoint, EndpointError

# flush routes, in the order tried: SGLang, vLLM
FLUSH_ROUTES = ("/flush_cache", "/reset_prefix_cache")
FILLER_ROUTE = "POST /v1/completions (filler)"      # how filler retries are counted
log = logging.getLogger(__name__)


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


def _sglang_body(ids, g: Generation, model):
    sp = {"max_new_tokens": g.max_tokens, "temperature": g.temperature, "ignore_eos": g.ignore_eos}
    if g.seed is not None:
        sp["sampling_seed"] = g.seed
    body = {"input_ids": list(ids), "return_logprob": True, "top_logprobs_num": g.k, "sampling_params": sp}
    return "/generate", {**body, **({"model": model} if model else {})}


def _sglang_reply(d: dict) -> Reply:
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


def _completions_body(ids, g: Generation, model, vllm: bool):
    body = {"prompt": list(ids), "max_tokens": g.max_tokens, "temperature": g.temperature, "logprobs": g.k}
    if g.seed is not None:
        body["seed"] = g.seed
    if vllm:
        body.update(ignore_eos=g.ignore_eos, return_tokens_as_token_ids=True)
    return "/v1/completions", {**body, **({"model": model} if model else {})}


def _completions_reply(d: dict, piece_ids: dict | None) -> Reply:
    try:
        ch = d["choices"][0]
        lp = ch["logprobs"]
        toks, vals, tops = lp["tokens"], lp["token_logprobs"], lp.get("top_logprobs") or []
    except (KeyError, IndexError, TypeError):
        raise ScoringError("the completion has no choices[0].logprobs (send logprobs k)") from None

    def tid(t: str) -> int | None:
        if t.startswith("token_id:"):
            return int(t.split(":", 1)[1])
        return None if piece_ids is None else piece_ids.get(t)
    ids = [tid(t) for t in toks]
    if any(i is None for i in ids):
        raise ScoringError("cannot map the generated tokens' text back to ids (give --tokenizer)")
    dists = []
    for i, v, top in zip(ids, vals, tops + [None] * (len(ids) - len(tops))):
        pairs = [(j, x) for t, x in (top or {}).items() if (j := tid(t)) is not None]
        dists.append(known_from_pairs(pairs + [(i, v)]))
    cached = ((d.get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
    return Reply(ids, dists, cached, str(ch.get("finish_reason") or ""))


def _llamacpp_reply(d: dict) -> Reply:
    """Tokens, top-k, cached tokens (`timings.cache_n`: prompt tokens taken from its cache)
    and the stop reason of a /completion answer."""
    probs = d.get("completion_probabilities") if isinstance(d, dict) else None
    if not isinstance(probs, list):
        raise ScoringError("the /completion answer has no completion_probabilities (send n_probs k)")
    got = [L.entry_known(e) for e in probs]
    finish = {"limit": "length", "eos": "stop", "word": "stop"}.get(str(d.get("stop_type")), str(d.get("stop_type") or ""))
    return Reply([t for t, _ in got], [k for _, k in got], (d.get("timings") or {}).get("cache_n"), finish)


class LiveArm:
    """An endpoint the probes send requests to (connect() first)."""

    def __init__(self, endpoint: Endpoint):
        self.ep = endpoint
        self.flush_route: str | None = None
        self.sent = 0        # generate / score requests sent (flushes and threaded fillers not counted)
        self._lock = threading.Lock()

    @property
    def name(self) -> str:
        return self.ep.name

    def connect(self) -> "LiveArm":
        self.ep.connect()
        return self

    def generate(self, ids: list[int], g: Generation) -> Reply:
        """Continuation of `ids` as `g` asks, with the top-k before each new token, logprobs
        raw as the engines report them."""
        ep = self.ep
        self.sent += 1
        if ep.dialect == "sglang":
            path, body = _sglang_body(ids, g, ep.model)
            parse = _sglang_reply
        elif ep.dialect == "llamacpp":            # no pinned slot: batch probes run side by side
            path, parse = "/completion", _llamacpp_reply
            body = L.body([list(ids)], g.k, g.max_tokens, ep.model, temperature=g.temperature, seed=g.seed,
                          ignore_eos=g.ignore_eos, slot=None)
        else:
            path, body = _completions_body(ids, g, ep.model, ep.dialect == "vllm")
            pieces = ep.piece_ids() if ep.dialect == "openai" else None
            parse = lambda d: _completions_reply(d, pieces)       # noqa: E731
        return ep.call("POST", path, body, parse=parse)

    def filler(self, ids: list[int], max_tokens: int, started) -> None:
        """A streamed completion that only takes up room in the engine's batch: sets
        `started` (a threading.Event) when its first token arrives -- it is then being
        decoded -- and reads the stream to its end (closing early would cancel it). A
        filler that fails (a reset, 5xx, 429, a stream without data) is sent again under
        the shared retry policy and counted as FILLER_ROUTE's retries, like any request."""
        ep = self.ep
        body = {"prompt": list(ids), "max_tokens": max_tokens, "temperature": 0, "stream": True,
                **({"model": ep.model} if ep.model else {}),
                **({"ignore_eos": True} if ep.dialect in ("sglang", "vllm", "llamacpp") else {})}

        def once():
            data = False
            try:
                with ep.client.stream("POST", ep.v1 + "/completions", json=body) as r:
                    if r.status_code >= 400:
                        r.read()                 # the error body, for the message
                        check_status(r)
                    for line in r.iter_lines():
                        if line.startswith("data:"):
                            data = True
                            started.set()
            except httpx.HTTPError as e:
                raise transport_failure(e) from None
            if not data:
                raise RequestFailed(f"HTTP {r.status_code} stream without any data line", True, r.status_code)
        try:
            retry(once, ep.policy, on_retry=self._filler_retry)
        except RequestFailed as e:
            tries = f" after {e.attempts} attempts" if e.retryable and e.attempts > 1 else ""
            raise EndpointError(f"{self.name}: a filler request failed{tries}: {e}") from None
        finally:
            started.set()                    # never leave the probe waiting

    def _filler_retry(self, attempt: int, why, delay: float) -> None:
        """Count and show a filler's retry as the endpoint's own are (fillers run in threads)."""
        with self._lock:
            self.ep.retries[FILLER_ROUTE] += 1
        msg = f"{self.name}: {FILLER_ROUTE}: {why}; retry {attempt}/{self.ep.policy.retries} in {delay:.1f}s"
        if self.ep.on_retry is not None:             # shown by the caller, not logged a second time
            self.ep.on_retry(msg)
        else:
            log.warning(msg)

    def score(self, ids: list[int], req):
        """kld's scoring of a prompt (prompt logprobs and a greedy ladder), counted."""
        self.sent += 1
        return self.ep.score(ids, req)

    def flush(self) -> str | None:
        """Empty the engine's prefix cache; the route that did it (None: the server has
        neither SGLang's nor vLLM's route, so a cold run needs a cache-busting prefix)."""
        ep = self.ep
        for route in ([self.flush_route] if self.flush_route else FLUSH_ROUTES):
            try:        # any 200 body: SGLang answers plain text, vLLM an empty body
                got = send(ep.client, "POST", ep.root + route, lambda r: True, ep.policy, json={},
                           missing_ok=True)
            except RequestFailed as e:
                if e.status in (404, 405):
                    continue
                raise EndpointError(f"{self.name}: POST {route} failed: {e}") from None
            if got:
                self.flush_route = route
                return route
        return None

    def sizes(self) -> dict:
        """The page and prefill-chunk sizes the server reports (SGLang's server-args names in
        /get_server_info; None where it does not say)."""
        info = self.ep.info.get("server_info") or {}
        return {"page_size": info.get("page_size"), "chunked_prefill_size": info.get("chunked_prefill_size")}
