"""HTTP runner for any OpenAI-compatible server (SGLang, vLLM, `fidelity serve`, ...).

httpx async with bounded concurrency per endpoint, a timeout per attempt, and retries
with exponential backoff (full jitter) on connection errors, timeouts, dropped
connections, 5xx, 429 and unparsable 200 bodies -- but not on other 4xx, which are the
request's fault and would fail again (the transport: infra/http.py). The start-up requests
(model list, /tokenize probe and counts, calibration probes) follow the same policy; when
they still fail, StartupError says which endpoint, route and status. `content` and
`reasoning_content` are kept apart. RequestOptions defaults follow DeepSeek's
recommendation (temperature 1.0, top_p 1.0). The API
key is read from an environment variable at request time and goes only into the
Authorization header: never into rows, logs or error messages."""
from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import httpx

from infra.http import (RequestFailed, RetryPolicy, StartupError, aretry, bearer, check_status, check_url,
                        pick_model, redact_url, send, served_models, split_base, transport_failure)

from .haystack import Prompt


SHARD = 8                                    # connections per httpx client (see aopen)
log = logging.getLogger(__name__)


@dataclass
class RequestOptions:
    """What a needle request sends besides the prompt (not the in-process sampler,
    reference_model.generate.Sampling)."""
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None            # None: 128, or 8192 when thinking
    seed: bool = True                        # send a per-trial seed (same for every arm)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    extra_body: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


class HttpRunner:
    kind = "http"

    def __init__(self, name: str, url: str, api: str = "chat", model: str | None = None,
                 options: RequestOptions | None = None, policy: RetryPolicy | None = None,
                 concurrency: int = 4, api_key_env: str | None = "OPENAI_API_KEY"):
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, got {api!r}")
        self.name, self.url, self.api, self.model = name, check_url(url), api, model
        self.root, self.v1 = split_base(url)
        self.options = options or RequestOptions()
        self.policy = policy or RetryPolicy()
        self.concurrency = max(1, int(concurrency))
        self.api_key_env = api_key_env
        self._clients: list[httpx.AsyncClient] = []
        self._load: list[int] = []
        self._sem: asyncio.Semaphore | None = None
        self.startup_retries = 0                 # start-up requests retried (also logged)
        self.startup_errors: list[str] = []      # what they failed with
        self._model_checked = False

    # ---- plumbing -----------------------------------------------------------------------
    def headers(self) -> dict:
        return bearer(os.environ.get(self.api_key_env) if self.api_key_env else None)

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.policy.timeout, connect=self.policy.connect_timeout)

    @property
    def detail(self) -> str:
        return redact_url(self.url)

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "url": self.detail, "api": self.api,
                "model": self.model, "sampling": self.options.to_dict(),
                "concurrency": self.concurrency}

    def startup_request(self, client: httpx.Client, method: str, url: str, parse,
                        json: dict | None = None, hint: str = ""):
        """parse(response) of one start-up request, under the same retry policy as the
        trials (parse raises RequestFailed for an answer it cannot use, retryable or not).
        Retries are counted in startup_retries and logged; a final failure is a
        StartupError naming the endpoint, the method and route, and the status."""
        route = urlsplit(url).path

        def retrying(attempts: int, e: RequestFailed, delay: float) -> None:
            self.startup_retries += 1
            self.startup_errors.append(f"{method} {route}: {e}")
            log.warning("endpoint %r: %s %s: %s; retry %d/%d in %.2fs", self.name, method,
                        route, e, attempts, self.policy.retries, delay)
        try:
            return send(client, method, url, parse, self.policy, json=json, on_retry=retrying)
        except RequestFailed as e:
            attempts = e.attempts
            why = (f"failed after {attempts} attempt{'s' * (attempts > 1)}" if e.retryable
                   else "failed" + (" (not retried)" if attempts == 1 else f" on attempt {attempts}"))
            raise StartupError(f"endpoint {self.name!r} ({redact_url(self.root)}): "
                               f"{method} {route} {why}: {e}"
                               + (f"; {hint}" if hint and not e.retryable and e.status not in (401, 403) else ""),
                               e, attempts) from None

    def discover_model(self) -> str:
        """The served model this arm queries (infra.http.pick_model: the one named like the arm,
        the one chosen, or the only one), from /v1/models. A chosen model is trusted when
        the server lists none (404)."""
        if self._model_checked:
            return self.model

        def ids(r: httpx.Response) -> list[str]:
            try:
                data = r.json()
            except ValueError:
                raise RequestFailed(f"malformed response body: {r.text[:120]!r}", True, r.status_code) from None
            try:
                return list(served_models(data))
            except ValueError as e:
                raise RequestFailed(str(e), False, r.status_code) from None

        with httpx.Client(timeout=self.timeout(), headers=self.headers()) as c:
            try:
                served = self.startup_request(c, "GET", self.v1 + "/models", ids,
                                              hint="pass a model name (--model)")
            except StartupError as e:
                if self.model is None or e.status != 404:
                    raise
                served = []
        self.model = pick_model(self.name, self.model, served)
        self._model_checked = True
        return self.model

    async def aopen(self):
        """Clients of at most SHARD connections each: one httpx pool serving many
        concurrent connections spends CPU per request growing with their number (52 vs
        430 req/s at 64 in flight here, bench/results/http.md)."""
        self.discover_model()
        k = -(-self.concurrency // SHARD)
        limits = httpx.Limits(max_connections=SHARD, max_keepalive_connections=SHARD)
        self._clients = [httpx.AsyncClient(timeout=self.timeout(), limits=limits) for _ in range(k)]
        self._load = [0] * k
        self._sem = asyncio.Semaphore(self.concurrency)

    async def aclose(self):
        for c in self._clients:
            await c.aclose()
        self._clients = []

    # ---- one request --------------------------------------------------------------------
    def template_kwargs(self, thinking: bool) -> dict:
        """chat_template_kwargs to send: {"thinking": ...} (DeepSeek templates on SGLang and
        vLLM), unless the user gave their own ({} sends none, e.g. for APIs that reject it)."""
        kw = self.options.chat_template_kwargs
        return {"thinking": thinking} if kw is None else dict(kw)

    def body(self, prompt: Prompt, seed: int) -> dict:
        s = self.options
        thinking = prompt.fmt.thinking
        max_tokens = s.max_tokens or (8192 if thinking else 128)
        b: dict = {"model": self.model, "max_tokens": max_tokens, "temperature": s.temperature,
                   "top_p": s.top_p, "stream": False}
        if s.seed:
            b["seed"] = seed % (2**31)
        if self.api == "chat":
            b["messages"] = prompt.messages()
            kw = self.template_kwargs(thinking)
            if kw:
                b["chat_template_kwargs"] = kw
            effort = s.reasoning_effort or prompt.fmt.reasoning_effort
            if effort:
                b["reasoning_effort"] = effort
        else:
            b["prompt"] = prompt.text
        b.update(s.extra_body)
        return b

    async def _post(self, path: str, body: dict) -> dict:
        i = min(range(len(self._clients)), key=self._load.__getitem__)   # least-loaded pool
        self._load[i] += 1
        try:
            r = await self._clients[i].post(self.v1 + path, json=body, headers=self.headers())
        except httpx.HTTPError as e:
            raise transport_failure(e) from None
        finally:
            self._load[i] -= 1
        check_status(r)
        return completion_body(r, self.api == "chat")

    async def arun(self, prompt: Prompt, seed: int) -> dict:
        body = self.body(prompt, seed)
        path = "/chat/completions" if self.api == "chat" else "/completions"
        errors = []
        async with self._sem:
            t0 = time.perf_counter()                  # latency excludes local queueing
            try:
                data = await aretry(lambda: self._post(path, body), self.policy,
                                    on_retry=lambda attempts, e, delay: errors.append(str(e)))
            except RequestFailed as e:
                errors.append(str(e))
                return {"error": str(e), "error_status": e.status, "attempts": e.attempts,
                        "errors": errors, "latency_s": time.perf_counter() - t0}
        return self._row(data, len(errors) + 1, errors, time.perf_counter() - t0)

    def _row(self, data: dict, attempts: int, errors: list, latency: float) -> dict:
        ch = data["choices"][0]
        if self.api == "chat":
            msg = ch.get("message") or {}
            content = msg.get("content")
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        else:
            content, reasoning = ch.get("text"), None
        usage = data.get("usage") or {}
        return {"model": data.get("model"), "response": content, "reasoning_content": reasoning,
                "finish_reason": ch.get("finish_reason"),
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "latency_s": latency, "attempts": attempts, "errors": errors or None,
                "error": None}

    # ---- token counting for prompt building -------------------------------------------------
    def counter(self):
        return make_http_counter(self)


def completion_body(r: httpx.Response, chat: bool = True) -> dict:
    """The JSON of a 2xx completion answer; an unusable body is retryable. A reply that
    carries no generated text (no `message` / `text`, or a null content with no reasoning
    or tool call) is unusable unless its usage says nothing was generated: scoring it would
    turn a server fault into an `empty` recall miss."""
    try:
        data = r.json()
        choice = data["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RequestFailed(f"malformed response body: {r.text[:120]!r}", True, r.status_code) from None
    if not isinstance(choice, dict):
        raise RequestFailed("malformed response: choice is not an object", True, r.status_code)
    missing = _no_generated_text(data, choice, chat)
    if missing:
        raise RequestFailed(f"malformed response: {missing}: {r.text[:120]!r}", True, r.status_code)
    return data


def _no_generated_text(data: dict, choice: dict, chat: bool) -> str | None:
    """What the reply lacks, or None when it carries text (or says it generated none)."""
    usage = data.get("usage")
    generated = usage.get("completion_tokens") if isinstance(usage, dict) else None
    said = (f" (usage says {generated} tokens were generated)" if generated
            else " (and no usage says nothing was generated)")
    if not chat:
        text = choice.get("text")
        return None if isinstance(text, str) or generated == 0 else "no text in the choice" + said
    msg = choice.get("message")
    if not isinstance(msg, dict):
        return "no message in the choice" + said
    if (isinstance(msg.get("content"), str) or msg.get("tool_calls")
            or any(isinstance(msg.get(k), str) for k in ("reasoning_content", "reasoning"))):
        return None
    return None if generated == 0 else "no content in the message" + said


def _token_count(r: httpx.Response) -> int:
    try:
        d = r.json()
        return int(d["count"]) if "count" in d else len(d["tokens"])
    except (ValueError, KeyError, TypeError):
        raise RequestFailed(f"malformed response body: {r.text[:120]!r}", True, r.status_code) from None


class TokenizeCounter:
    """Exact counts from the server's /tokenize (vLLM/SGLang shape: {"count", "tokens"}).
    Chat mode sends `messages` (vLLM applies the chat template); a server that refuses
    messages is counted as tokenize(user text) + the chat overhead measured once from a
    probe request's usage.prompt_tokens."""
    exact = True

    def __init__(self, runner: HttpRunner, path: str, client: httpx.Client, llama: bool = False):
        self.r, self.path, self.c, self.llama = runner, path, client, llama
        self.source = f"server-tokenize:{runner.model}"
        self.overhead: int | None = None

    def close(self) -> None:
        self.c.close()

    def _tok(self, body: dict) -> int:
        return self.r.startup_request(self.c, "POST", self.r.root + self.path, _token_count,
                                      json={"model": self.r.model, **body})

    def _text(self, text: str) -> int:
        """One text's count, in the server's body shape (llama.cpp: content + parse_special)."""
        return self._tok(llama_tokenize_body(text) if self.llama else {"prompt": text})

    def count(self, prompt: Prompt) -> int:
        if self.r.api == "completions":
            return self._text(prompt.text)
        if self.overhead is None and not self.llama:    # llama.cpp's /tokenize ignores messages
            try:
                return self._tok({"messages": prompt.messages(), "add_generation_prompt": True,
                                  "chat_template_kwargs": self.r.template_kwargs(prompt.fmt.thinking)})
            except StartupError:                     # e.g. 400: messages not accepted
                pass
        if self.overhead is None:
            self.overhead = _probe_usage(self.r, prompt) - self._text(prompt.user)
            self.source += "+chat-overhead"
        return self._text(prompt.user) + self.overhead


class CalibratedCounter:
    """No /tokenize: tokens ~ a + b * characters, fitted on two probe requests'
    usage.prompt_tokens. Not exact: each row records the server's count and the residual."""
    exact = False

    def __init__(self, runner: HttpRunner):
        self.r = runner
        self.source = f"calibrated:{runner.model}"
        self.a = self.b = None

    def calibrate(self, short: Prompt, long: Prompt) -> None:
        x0, x1 = len(short.text), len(long.text)
        y0, y1 = _probe_usage(self.r, short), _probe_usage(self.r, long)
        self.b = (y1 - y0) / max(1, x1 - x0)
        self.a = y0 - self.b * x0

    def count(self, prompt: Prompt) -> int:
        return int(round(self.a + self.b * len(prompt.text)))


def _probe_usage(runner: HttpRunner, prompt: Prompt) -> int:
    """usage.prompt_tokens of a 1-token request (retried like a trial)."""
    path = "/chat/completions" if runner.api == "chat" else "/completions"
    body = runner.body(prompt, 0)
    body["max_tokens"] = 1

    def prompt_tokens(r: httpx.Response) -> int:
        data = completion_body(r, runner.api == "chat")
        try:
            return int(data["usage"]["prompt_tokens"])
        except (KeyError, TypeError, ValueError):
            raise RequestFailed("no usage.prompt_tokens in the answer (needed to calibrate "
                                "prompt lengths on a server without /tokenize)", False,
                                r.status_code) from None

    with httpx.Client(timeout=runner.timeout(), headers=runner.headers()) as c:
        return runner.startup_request(c, "POST", runner.v1 + path, prompt_tokens, json=body)


def _is_tokenize(r: httpx.Response) -> bool:
    """A tokenize answer that counted the probe text: llama-server answers a body without
    its `content` with an empty token list, which counts nothing."""
    try:
        d = r.json()
    except ValueError:                             # e.g. a catch-all HTML page
        return False
    return isinstance(d, dict) and (bool(d.get("count")) or bool(d.get("tokens")))


def llama_tokenize_body(text: str) -> dict:
    """llama-server's /tokenize body: the text as `content`, special tokens parsed, no BOS added."""
    return {"content": text, "add_special": False, "parse_special": True}


def make_http_counter(runner: HttpRunner):
    """TokenizeCounter if the server has /tokenize (or /v1/tokenize), else a
    CalibratedCounter (calibrated later by the sweep, which knows the haystack).
    A 4xx (404: no such route) or a 2xx of another shape means no tokenize there;
    connection errors, timeouts, 5xx and 429 are retried, then are an error."""
    runner.discover_model()
    client = httpx.Client(timeout=runner.timeout(), headers=runner.headers())
    try:
        answered = set()                      # routes that answered 2xx without counting
        for path, llama in (("/tokenize", False), ("/v1/tokenize", False), ("/tokenize", True)):
            if llama and "/tokenize" not in answered:
                continue                          # llama-server answers `prompt` with no tokens
            body = llama_tokenize_body("hello") if llama else {"prompt": "hello"}
            try:
                ok = runner.startup_request(client, "POST", runner.root + path, _is_tokenize,
                                            json={"model": runner.model, **body})
            except StartupError as e:
                if e.exhausted:
                    raise
                continue
            if ok:
                return TokenizeCounter(runner, path, client, llama)
            answered.add(path)
    except BaseException:
        client.close()
        raise
    client.close()
    return CalibratedCounter(runner)
