"""A running server as a scoring arm: its URL (root or /v1), model, dialect (detected:
SGLang when /get_model_info answers, vLLM when /version does, llama.cpp when /props does,
else OpenAI's echo; or given), the shapes its captures need, and one scoring call per prompt. Every request goes
through the shared transport (infra/http.py: connection errors, timeouts, 5xx, 429 with
Retry-After, and 200s whose body cannot be used are retried), each retry counted per route
and shown; a final
failure names the endpoint, route and status or what was malformed. Captures the server
offers but an answer lacks are retried too, then recorded as missing for that prompt (a
resumed run asks again) -- never turned off silently."""
from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import replace

import httpx
import numpy as np

from infra.http import (ModelChoiceError, RequestFailed, RetryPolicy, URLError, backoff_delay, bearer, check_url,
                        pick_model, redact_url, send, served_models, split_base)

from fidelity import servers
from fidelity.servers import llamacpp as L
from fidelity.servers.sglang import CAPTURE_SHAPE_KEYS, capture_shape, has_captures
from fidelity.servers.sglang import captures as sglang_captures

from fidelity.scores.bounds import Known
from fidelity.scores.dialects import PromptScores, Request, ScoringError

log = logging.getLogger(__name__)

IDS_PER_REQUEST = 512            # SGLang exact mode: requested ids per scoring request


class EndpointError(RuntimeError):
    pass


def merge_scores(a: PromptScores, b: PromptScores) -> PromptScores:
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
                 policy: RetryPolicy | None = None, tokenizer=None, on_retry=None, api_key: str | None = None):
        if dialect is not None and dialect not in servers.DIALECTS:
            raise EndpointError(f"{name}: unknown dialect {dialect!r} (one of {', '.join(servers.DIALECTS)})")
        try:
            check_url(url)                           # the CLI checks it when parsed; callers in code too
        except URLError as e:
            raise EndpointError(f"{name}: {e}") from None
        self.name, self.url = name, url
        self.root, self.v1 = split_base(url)
        self.policy = policy or RetryPolicy(retries=4, timeout=600.0, backoff=0.5)
        self.client = httpx.Client(timeout=httpx.Timeout(self.policy.timeout,
                                                         connect=self.policy.connect_timeout),
                                   headers=bearer(api_key))
        self.dialect, self.model, self.tokenizer = dialect, model, tokenizer
        self.detected = dialect is None          # a detected dialect may fall back to the others
        self.settled = False                     # a scoring request has succeeded
        self._piece_ids: dict | None = None
        self.shape: dict | None = None           # capture shape, once known
        self.meta: dict | None = None            # model id -> the server's stated facts, if any
        self.llama_server = False                # /props answered as llama-server does (any dialect)
        self.info: dict = {}
        self.ids_per_request = IDS_PER_REQUEST
        self.retries: Counter = Counter()        # "METHOD /route" -> retries made
        self.capture_failures: list[str] = []    # why captures were missing, per failed prompt
        self.on_retry = on_retry                 # callable(message): shows retries on the console

    def close(self) -> None:
        self.client.close()

    # ---- HTTP ---------------------------------------------------------------------------
    def _note_retry(self, route: str, attempt: int, why, delay: float) -> None:
        """Count and show retry number `attempt` of `route`, due in `delay` seconds."""
        self.retries[route] += 1
        msg = f"{self.name}: {route}: {why}; retry {attempt}/{self.policy.retries} in {delay:.1f}s"
        if self.on_retry is not None:                # the caller shows it; logging too printed it twice
            self.on_retry(msg)
        else:
            log.warning(msg)

    def _retry(self, route: str, attempt: int, why) -> None:
        """Count, show and wait before retry number `attempt` of `route`."""
        delay = backoff_delay(self.policy, attempt, None)
        self._note_retry(route, attempt, why, delay)
        time.sleep(delay)

    def call(self, method: str, path: str, body: dict | None = None, ok404: bool = False,
             parse=None, retry_malformed: bool = True):
        """parse(JSON) of `path` under the root (the JSON itself without parse), retried on
        transient failures (the shared transport's rules) and on bodies that are not JSON or
        that parse rejects with ScoringError (unless `retry_malformed` is False). None on a
        404 when `ok404` (a route the server does not have)."""
        url, route = self.root + path, f"{method} {path}"

        def answer(r: httpx.Response):
            try:
                data = r.json()
            except ValueError:
                raise RequestFailed(f"HTTP {r.status_code} with a body that is not JSON: "
                                    f"{r.text[:120]!r}", True, r.status_code) from None
            if parse is None:
                return data
            try:
                return parse(data)
            except ScoringError as e:
                raise RequestFailed(f"HTTP {r.status_code} with a malformed answer: {e}",
                                    retry_malformed, r.status_code) from None
        try:
            return send(self.client, method, url, answer, self.policy, json=body, missing_ok=ok404,
                        on_retry=lambda attempt, e, delay: self._note_retry(route, attempt, e, delay))
        except RequestFailed as e:
            tries = f" after {e.attempts} attempts" if e.retryable and e.attempts > 1 else ""
            raise EndpointError(f"{self.name}: {method} {redact_url(url)} failed{tries}: {e}") from None

    # ---- discovery ----------------------------------------------------------------------
    def connect(self) -> "Endpoint":
        """Model id (infra.http.pick_model: named like the arm, chosen, or the only one), dialect
        and (SGLang) capture shapes; the server's own view is kept."""
        def model_ids(d):
            try:
                self.meta = served_models(d)
            except ValueError as e:
                raise ScoringError(str(e)) from None
            return list(self.meta)
        ids = self.call("GET", "/v1/models", parse=model_ids)
        try:
            self.model = pick_model(self.name, self.model, ids)
        except ModelChoiceError as e:
            raise EndpointError(str(e)) from None
        info = self.call("GET", "/get_model_info", ok404=True)
        version = self.call("GET", "/version", ok404=True)
        props = None if info is not None or version is not None else self.call("GET", "/props", ok404=True)
        self.llama_server = L.is_llama_server(props)
        if self.dialect is None:
            self.dialect = servers.detect(servers.Found(info, version, self.llama_server, props))
        self.shape = capture_shape(info)         # None: no captures, or learnt when they come
        self.info = {"models": ids, "model_info": info, "version": version,
                     "server_info": self.call("GET", "/get_server_info", ok404=True)}
        if props is not None:
            self.info["props"] = servers.props_summary(props)
        return self

    def check_vocab(self, n_vocab: int) -> None:
        """A server that states its model's vocabulary size (llama-server's /v1/models meta)
        must state ours: scoring ids of one vocabulary on a model of another compares nothing."""
        got = ((self.meta or {}).get(self.model) or {}).get("n_vocab")
        if got is not None and int(got) != n_vocab:
            raise EndpointError(f"{self.name}: the served model {self.model!r} has a {got}-token "
                                f"vocabulary, ours has {n_vocab}: a GGUF of another model?")

    def fetch_shape(self) -> dict:
        """The capture shape from /get_model_info, for a server whose answers carry captures:
        an answer without it is malformed here, so it is retried."""
        def shape(d):
            got = capture_shape(d)
            if got is None:
                raise ScoringError(f"no capture shape ({', '.join(CAPTURE_SHAPE_KEYS)}) in {str(d)[:120]}")
            return got
        self.shape = self.call("GET", "/get_model_info", parse=shape)
        return self.shape

    def tokenize(self, text: str) -> list[int] | None:
        """The server's own token ids for a text (None when it has no /tokenize)."""
        def tokens(d):
            t = d.get("tokens") if isinstance(d, dict) else None
            if not isinstance(t, list):
                raise ScoringError(f"no `tokens` list in the answer: {str(d)[:120]}")
            return [int(x) for x in t]
        body = servers.served_as(self).tokenize_body(text, self.model)
        return self.call("POST", "/tokenize", body, ok404=True, parse=tokens)

    def describe(self) -> dict:
        d = {"name": self.name, "kind": self.kind, "url": redact_url(self.url),
             "dialect": self.dialect, "model": self.model, "server": self.fingerprint()}
        server = servers.find(self.dialect)
        if server and server.reading:
            d["reading"] = server.reading
        return d

    def fingerprint(self) -> dict:
        """What the server says it is, wherever it listens (beside the model id it serves):
        llama-server's build and model file, vLLM's version, the arm `fidelity serve` serves. Stored
        scores are matched on this, not on the URL (a relaunch on another port is the same
        engine; another build or model is not)."""
        i = self.info or {}
        v = i.get("version")
        got = {"build": (i.get("props") or {}).get("build_info"),
               "model_file": (i.get("props") or {}).get("model_file"),
               "route": (i.get("props") or {}).get("route"), "weights": (i.get("props") or {}).get("weights"),
               "version": v.get("version") if isinstance(v, dict) else v,
               "serves": (((i.get("server_info") or {}).get("arms") or {}).get(self.model)
                          if isinstance(i.get("server_info"), dict) else None)}
        return {k: val for k, val in got.items() if val}

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

    def _score_as(self, dialect: str, ids: list[int], req: Request, retry: bool = True) -> PromptScores:
        """One prompt's scores in `dialect` (its engine module's requests and parsers)."""
        return servers.get(dialect).score(self, ids, req, retry)

    def score_in_requests(self, server, ids: list[int], req: Request, retry: bool = True) -> PromptScores:
        """One request per prompt; SGLang's exact mode in several, `ids_per_request` requested
        ids each (`token_ids_logprob` is scored at every position, so a long prompt times a
        large id set would be one huge response), merged position by position."""
        chunks = [req.score_ids[a:a + self.ids_per_request]
                  for a in range(0, len(req.score_ids), self.ids_per_request)] or [()]
        out = None
        for c in chunks:
            got = self._one(server, ids, replace(req, score_ids=tuple(c), captures=req.captures and out is None),
                            retry)
            out = got if out is None else merge_scores(out, got)
        return out

    def _one(self, server, ids: list[int], req: Request, retry: bool = True) -> PromptScores:
        """One scoring request; a malformed answer is retried unless `retry` is False (a
        dialect tried as a fallback may simply be the wrong one)."""
        path, body = server.scoring_request(ids, replace(req, model=self.model))
        got = self.call("POST", path, body, retry_malformed=retry,
                        parse=lambda d: (d, server.parse_scores(d, ids, req, self)))
        if not (req.captures and server.captures):
            return got[1]
        return self._with_captures(path, body, ids, req, server, *got)

    def _with_captures(self, path, body, ids, req, server, data, scores) -> PromptScores:
        """Scores with the answer's captures decoded. Captures the server offers (a known
        shape) that an answer lacks or garbles are asked for again under the retry policy;
        then the scores are kept with `captures_missing` saying why."""
        route = f"POST {path} (captures)"
        for attempt in range(1, self.policy.retries + 2):
            why = None
            if has_captures(data):
                try:
                    return sglang_captures(scores, data["meta_info"], self.shape or self.fetch_shape())
                except ScoringError as e:
                    why = f"malformed captures: {e}"
                except EndpointError as e:            # the shape stays unknown: keep the scores
                    why = f"captures returned but their shape is unknown: {e}"
                    break
            elif self.shape is None:
                return scores                         # this server offers no captures
            else:
                why = "captures requested but absent from the answer"
            if attempt > self.policy.retries:
                break
            self._retry(route, attempt, why)
            data, scores = self.call("POST", path, body, parse=lambda d: (d, server.parse_scores(d, ids, req, self)))
        self.capture_failures.append(why)
        scores.captures_missing = why
        return scores

    def score(self, ids: list[int], req: Request) -> PromptScores:
        """The prompt's scores. Until one request has worked, a detected dialect that fails
        falls back to the others; if none works the error lists each one's failure and
        what the server needs for it."""
        if self.settled or not self.detected:
            try:
                out = self._score_as(self.dialect, ids, req)
            except EndpointError as e:
                if self.settled:                      # the dialect has worked: it is not the cause
                    raise
                raise EndpointError(f"{e}\n  dialect: {servers.get(self.dialect).hint} (override with "
                                    f"--dialect {self.name}={'|'.join(servers.DIALECTS)})") from None
            self.settled = True
            return out
        tried = []
        for d in [self.dialect] + [x for x in servers.DIALECTS if x != self.dialect]:
            try:
                out = self._score_as(d, ids, req, retry=d == self.dialect)
            except EndpointError as e:
                tried.append(f"  - {d}: {e}\n    needs {servers.get(d).hint}")
                continue
            self.dialect, self.settled = d, True
            return out
        raise EndpointError(f"{self.name}: no dialect returned prompt logprobs; tried:\n" + "\n".join(tried))
