"""A running server as a scoring arm: its URL (root or /v1), model, dialect (detected:
SGLang when /get_model_info answers, vLLM when /version does, else OpenAI's echo; or
given), the shapes its captures need, and one scoring call per prompt. Every request is
retried like the needle runner's (connection errors, timeouts, 5xx, 429 with Retry-After)
and a final failure names the endpoint, route and status."""
from __future__ import annotations

import time
from dataclasses import replace

import httpx
import numpy as np

from needle.http import (RequestFailed, RetryPolicy, backoff_delay, check_status, redact_url,
                         split_base, transport_failure)

from .bounds import Known
from .dialects import DIALECTS, PARSERS, ArmScores, Request, ScoringError

HINTS = {"sglang": "SGLang: POST /generate with return_logprob (any recent SGLang)",
         "vllm": "vLLM: /v1/completions with prompt_logprobs (start vLLM with --max-logprobs "
                 ">= k, or -1)",
         "openai": "OpenAI-compatible: /v1/completions with echo + logprobs"}


IDS_PER_REQUEST = 512            # SGLang exact mode: requested ids per scoring request


class EndpointError(RuntimeError):
    pass


def merge_scores(a: ArmScores, b: ArmScores) -> ArmScores:
    """Scores of one prompt from two requests (different requested ids): each position's
    known ids united (greedy continuations must agree: same engine, same prompt)."""
    if a.ladder_tokens != b.ladder_tokens:
        raise EndpointError("two scoring requests of one prompt decoded differently "
                            f"({a.ladder_tokens} vs {b.ladder_tokens}): the engine is not deterministic")

    def union(x: Known, y: Known) -> Known:
        ids = np.concatenate([x.ids, y.ids])
        logp = np.concatenate([x.logp, y.logp])
        _, first = np.unique(ids, return_index=True)
        return Known(ids[first], logp[first])
    return replace(a, known=[union(x, y) for x, y in zip(a.known, b.known)],
                   ladder=[union(x, y) for x, y in zip(a.ladder, b.ladder)])


class Endpoint:
    kind = "endpoint"

    def __init__(self, name: str, url: str, dialect: str | None = None, model: str | None = None,
                 policy: RetryPolicy | None = None, tokenizer=None):
        if dialect is not None and dialect not in DIALECTS:
            raise EndpointError(f"{name}: unknown dialect {dialect!r} (one of {', '.join(DIALECTS)})")
        self.name, self.url = name, url
        self.root, self.v1 = split_base(url)
        self.policy = policy or RetryPolicy(retries=4, timeout=600.0, backoff=0.5)
        self.client = httpx.Client(timeout=httpx.Timeout(self.policy.timeout,
                                                         connect=self.policy.connect_timeout))
        self.dialect, self.model, self.tokenizer = dialect, model, tokenizer
        self.detected = dialect is None          # a detected dialect may fall back to the others
        self.settled = False                     # a scoring request has succeeded
        self._piece_ids: dict | None = None
        self.shape: dict | None = None
        self.info: dict = {}
        self.ids_per_request = IDS_PER_REQUEST

    def close(self) -> None:
        self.client.close()

    # ---- HTTP ---------------------------------------------------------------------------
    def call(self, method: str, path: str, body: dict | None = None, ok404: bool = False):
        """JSON of `path` under the root, retried on transient failures (the needle
        runner's rules). None on a 404 when `ok404` (a route the server does not have)."""
        url = self.root + path
        for attempt in range(1, self.policy.retries + 2):
            try:
                try:
                    r = self.client.request(method, url, json=body)
                except httpx.HTTPError as e:
                    raise transport_failure(e) from None
                if r.status_code == 404 and ok404:
                    return None
                check_status(r)
                try:
                    return r.json()
                except ValueError:
                    raise RequestFailed(f"HTTP {r.status_code} with a body that is not JSON: "
                                        f"{r.text[:120]!r}", True, r.status_code) from None
            except RequestFailed as e:
                if not e.retryable or attempt > self.policy.retries:
                    tries = f" after {attempt} attempts" if e.retryable else ""
                    raise EndpointError(f"{self.name}: {method} {redact_url(url)} failed{tries}: {e}") from None
                time.sleep(backoff_delay(self.policy, attempt, e.retry_after))

    # ---- discovery ----------------------------------------------------------------------
    def connect(self) -> "Endpoint":
        """Model id, dialect and (SGLang) capture shapes; the server's own view is kept."""
        models = self.call("GET", "/v1/models")
        try:
            ids = [m["id"] for m in models["data"]]
        except (KeyError, TypeError):
            raise EndpointError(f"{self.name}: /v1/models answered {str(models)[:200]}") from None
        if self.model is None:                 # a server with several arms names one after us
            self.model = self.name if self.name in ids else ids[0]
        elif self.model not in ids:
            raise EndpointError(f"{self.name}: model {self.model!r} is not served (served: {', '.join(ids)})")
        info = self.call("GET", "/get_model_info", ok404=True)
        version = self.call("GET", "/version", ok404=True)
        if self.dialect is None:
            self.dialect = "sglang" if info is not None else "vllm" if version is not None else "openai"
        self.shape = info if info and "indexer_layers" in info else None
        self.info = {"models": ids, "model_info": info, "version": version,
                     "server_info": self.call("GET", "/get_server_info", ok404=True)}
        return self

    def tokenize(self, text: str) -> list[int] | None:
        """The server's own token ids for a text (None when it has no /tokenize)."""
        r = self.call("POST", "/tokenize", {"prompt": text, "model": self.model},
                      ok404=True)
        return None if r is None else list(r["tokens"])

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "url": redact_url(self.url),
                "dialect": self.dialect, "model": self.model}

    # ---- scoring ------------------------------------------------------------------------
    def piece_ids(self) -> dict | None:
        """Token text -> id for the OpenAI dialect's text-keyed top-k (texts that several
        ids decode to are left out: they cannot be attributed)."""
        if self._piece_ids is None and self.tokenizer is not None:
            seen: dict[str, list[int]] = {}
            for i in range(self.tokenizer.vocab_size):
                seen.setdefault(self.tokenizer.decode([i], skip_special_tokens=False), []).append(i)
            self._piece_ids = {t: v[0] for t, v in seen.items() if len(v) == 1}
        return self._piece_ids

    def _score_as(self, dialect: str, ids: list[int], req: Request) -> ArmScores:
        """One request; SGLang's exact mode in several, `ids_per_request` requested ids each
        (`token_ids_logprob` is scored at every position, so a long prompt times a large id
        set would be one huge response), merged position by position."""
        chunks = [req.score_ids[a:a + self.ids_per_request]
                  for a in range(0, len(req.score_ids), self.ids_per_request)] or [()]
        out = None
        for c in chunks:
            got = self._one(dialect, ids, replace(req, score_ids=tuple(c), captures=req.captures and out is None))
            out = got if out is None else merge_scores(out, got)
        return out

    def _one(self, dialect: str, ids: list[int], req: Request) -> ArmScores:
        build, parse = PARSERS[dialect]
        path, body = build(ids, replace(req, model=self.model))
        data = self.call("POST", path, body)
        try:
            return parse(data, ids, req, self.piece_ids() if dialect == "openai" else self.shape)
        except ScoringError as e:
            raise EndpointError(f"{self.name}: {e}") from None

    def score(self, ids: list[int], req: Request) -> ArmScores:
        """The prompt's scores. Until one request has worked, a detected dialect that fails
        falls back to the others; if none works the error lists each one's failure and
        what the server needs for it."""
        if self.settled or not self.detected:
            try:
                out = self._score_as(self.dialect, ids, req)
            except EndpointError as e:
                raise EndpointError(f"{e}\n  dialect: {HINTS[self.dialect]} (override with "
                                    f"--dialect {self.name}=sglang|vllm|openai)") from None
            self.settled = True
            return out
        tried = []
        for d in [self.dialect] + [x for x in DIALECTS if x != self.dialect]:
            try:
                out = self._score_as(d, ids, req)
            except EndpointError as e:
                tried.append(f"  - {d}: {e}\n    needs {HINTS[d]}")
                continue
            self.dialect, self.settled = d, True
            return out
        raise EndpointError(f"{self.name}: no dialect returned prompt logprobs; tried:\n" + "\n".join(tried))
