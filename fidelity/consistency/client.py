"""A live server as the consistency probes see it: kld's Endpoint (model choice, dialect
detection, prompt scoring, the shared retry policy) plus a plain generation (greedy, or
sampled for long generations) with output logprobs -- no prompt logprobs, because
engines skip their prefix cache for those (vLLM's prompt_logprobs, SGLang's
logprob_start_len) -- the prompt tokens the engine says it took from its cache, streamed
filler requests, its cache-flush route, and the serving sizes it reports."""
from __future__ import annotations

import logging
import threading

import httpx

from infra.http import RequestFailed, check_status, retry, send, transport_failure

from fidelity import servers
from fidelity.kld.endpoint import Endpoint, EndpointError
from fidelity.servers.base import Generation, Reply

# flush routes, in the order tried: SGLang, vLLM
FLUSH_ROUTES = ("/flush_cache", "/reset_prefix_cache")
FILLER_ROUTE = "POST /v1/completions (filler)"      # how filler retries are counted
log = logging.getLogger(__name__)


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
        path, body, parse = servers.get(ep.dialect).generation(ids, g, ep)
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
                **({"ignore_eos": True} if servers.get(ep.dialect).takes_ignore_eos else {})}

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
