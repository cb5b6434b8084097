"""HTTP runner for any OpenAI-compatible server (SGLang, vLLM, `fidelity serve`, ...).

httpx async with bounded concurrency per endpoint, a timeout per attempt, and retries
with exponential backoff (full jitter) on connection errors, timeouts, dropped
connections, 5xx, 429 and unparsable 200 bodies -- but not on other 4xx, which are the
request's fault and would fail again. `content` and `reasoning_content` are kept apart.
Sampling defaults follow DeepSeek's recommendation (temperature 1.0, top_p 1.0). The API
key is read from an environment variable at request time and goes only into the
Authorization header: never into rows, logs or error messages."""
from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit, urlunsplit

import httpx

from .haystack import Prompt


SHARD = 8                                    # connections per httpx client (see aopen)


class RequestFailed(Exception):
    def __init__(self, message: str, retryable: bool, status: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.retryable, self.status, self.retry_after = retryable, status, retry_after


@dataclass
class Sampling:
    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int | None = None            # None: 128, or 8192 when thinking
    seed: bool = True                        # send a per-trial seed (same for every arm)
    reasoning_effort: str | None = None
    chat_template_kwargs: dict | None = None
    extra_body: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RetryPolicy:
    retries: int = 4                         # extra attempts after the first
    timeout: float = 300.0                   # seconds per attempt
    connect_timeout: float = 10.0
    backoff: float = 0.5                     # first backoff ceiling, doubled each retry
    backoff_max: float = 16.0


def redact_url(url: str) -> str:
    """The URL without user:password (never recorded)."""
    p = urlsplit(url)
    host = p.hostname or ""
    if p.port:
        host += f":{p.port}"
    return urlunsplit((p.scheme, host, p.path, p.query, ""))


def split_base(url: str) -> tuple[str, str]:
    """(server root, OpenAI base ending in /v1) from either form."""
    u = url.rstrip("/")
    root = u[:-3] if u.endswith("/v1") else u
    return root, root + "/v1"


class HttpRunner:
    kind = "http"

    def __init__(self, name: str, url: str, api: str = "chat", model: str | None = None,
                 sampling: Sampling | None = None, policy: RetryPolicy | None = None,
                 concurrency: int = 4, api_key_env: str | None = "OPENAI_API_KEY"):
        if api not in ("chat", "completions"):
            raise ValueError(f"api must be chat or completions, got {api!r}")
        self.name, self.url, self.api, self.model = name, url, api, model
        self.root, self.v1 = split_base(url)
        self.sampling = sampling or Sampling()
        self.policy = policy or RetryPolicy()
        self.concurrency = max(1, int(concurrency))
        self.api_key_env = api_key_env
        self._clients: list[httpx.AsyncClient] = []
        self._load: list[int] = []
        self._sem: asyncio.Semaphore | None = None

    # ---- plumbing -----------------------------------------------------------------------
    def headers(self) -> dict:
        key = os.environ.get(self.api_key_env) if self.api_key_env else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.policy.timeout, connect=self.policy.connect_timeout)

    @property
    def detail(self) -> str:
        return redact_url(self.url)

    def describe(self) -> dict:
        return {"name": self.name, "kind": self.kind, "url": self.detail, "api": self.api,
                "model": self.model, "sampling": self.sampling.to_dict(),
                "concurrency": self.concurrency}

    def discover_model(self) -> str:
        """The served model id (first of /v1/models) unless one was given."""
        if self.model:
            return self.model
        with httpx.Client(timeout=self.timeout(), headers=self.headers()) as c:
            try:
                r = c.get(self.v1 + "/models")
                r.raise_for_status()
                self.model = r.json()["data"][0]["id"]
            except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
                raise RequestFailed(f"{self.name}: cannot list models at {redact_url(self.v1)}/models "
                                    f"({type(e).__name__}); pass a model name", False) from None
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
        kw = self.sampling.chat_template_kwargs
        return {"thinking": thinking} if kw is None else dict(kw)

    def body(self, prompt: Prompt, seed: int) -> dict:
        s = self.sampling
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
        except httpx.TimeoutException as e:
            raise RequestFailed(f"timeout ({type(e).__name__})", True) from None
        except httpx.TransportError as e:
            raise RequestFailed(f"connection error ({type(e).__name__}: {e})", True) from None
        except httpx.HTTPError as e:                   # e.g. a body that cannot be decoded
            raise RequestFailed(f"HTTP error ({type(e).__name__}: {e})", True) from None
        finally:
            self._load[i] -= 1
        if r.status_code == 429 or r.status_code >= 500:
            ra = r.headers.get("retry-after")
            try:
                ra = float(ra) if ra is not None else None
            except ValueError:
                ra = None
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:200]}", True, r.status_code, ra)
        if r.status_code >= 400:
            raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}", False, r.status_code)
        try:
            data = r.json()
            choice = data["choices"][0]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RequestFailed(f"malformed response body: {r.text[:120]!r}", True, r.status_code) from None
        if not isinstance(choice, dict):
            raise RequestFailed("malformed response: choice is not an object", True, r.status_code)
        return data

    async def arun(self, prompt: Prompt, seed: int) -> dict:
        body = self.body(prompt, seed)
        path = "/chat/completions" if self.api == "chat" else "/completions"
        attempts, errors = 0, []
        async with self._sem:
            t0 = time.perf_counter()                  # latency excludes local queueing
            while True:
                attempts += 1
                try:
                    data = await self._post(path, body)
                    break
                except RequestFailed as e:
                    errors.append(str(e))
                    if not e.retryable or attempts > self.policy.retries:
                        return {"error": str(e), "error_status": e.status, "attempts": attempts,
                                "errors": errors, "latency_s": time.perf_counter() - t0}
                    cap = min(self.policy.backoff_max, self.policy.backoff * 2 ** (attempts - 1))
                    delay = random.uniform(0, cap)
                    if e.retry_after is not None:
                        delay = min(self.policy.backoff_max, max(delay, e.retry_after))
                    await asyncio.sleep(delay)
        return self._row(data, attempts, errors, time.perf_counter() - t0)

    def _row(self, data: dict, attempts: int, errors: list, latency: float) -> dict:
        ch = data["choices"][0]
        if self.api == "chat":
            msg = ch.get("message") or {}
            content = msg.get("content")
            reasoning = msg.get("reasoning_content", msg.get("reasoning"))
        else:
            content, reasoning = ch.get("text"), None
        usage = data.get("usage") or {}
        return {"response": content, "reasoning_content": reasoning,
                "finish_reason": ch.get("finish_reason"),
                "prompt_tokens": usage.get("prompt_tokens"),
                "completion_tokens": usage.get("completion_tokens"),
                "latency_s": latency, "attempts": attempts, "errors": errors or None,
                "error": None}

    # ---- token counting for prompt building -------------------------------------------------
    def counter(self):
        return make_http_counter(self)


class TokenizeCounter:
    """Exact counts from the server's /tokenize (vLLM/SGLang shape: {"count", "tokens"}).
    Chat mode sends `messages` (vLLM applies the chat template); a server that refuses
    messages is counted as tokenize(user text) + the chat overhead measured once from a
    probe request's usage.prompt_tokens."""
    exact = True

    def __init__(self, runner: HttpRunner, path: str, client: httpx.Client):
        self.r, self.path, self.c = runner, path, client
        self.source = f"server-tokenize:{runner.model}"
        self.overhead: int | None = None

    def close(self) -> None:
        self.c.close()

    def _tok(self, body: dict) -> int:
        r = self.c.post(self.r.root + self.path, json={"model": self.r.model, **body})
        r.raise_for_status()
        d = r.json()
        return int(d["count"]) if "count" in d else len(d["tokens"])

    def count(self, prompt: Prompt) -> int:
        if self.r.api == "completions":
            return self._tok({"prompt": prompt.text})
        if self.overhead is None:
            try:
                return self._tok({"messages": prompt.messages(), "add_generation_prompt": True,
                                  "chat_template_kwargs": self.r.template_kwargs(prompt.fmt.thinking)})
            except (httpx.HTTPError, KeyError, ValueError):
                self.overhead = _probe_usage(self.r, prompt) - self._tok({"prompt": prompt.user})
                self.source += "+chat-overhead"
        return self._tok({"prompt": prompt.user}) + self.overhead


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
    """usage.prompt_tokens of a 1-token request."""
    path = "/chat/completions" if runner.api == "chat" else "/completions"
    body = runner.body(prompt, 0)
    body["max_tokens"] = 1
    with httpx.Client(timeout=runner.timeout(), headers=runner.headers()) as c:
        r = c.post(runner.v1 + path, json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["prompt_tokens"])


def make_http_counter(runner: HttpRunner):
    """TokenizeCounter if the server has /tokenize (or /v1/tokenize), else a
    CalibratedCounter (calibrated later by the sweep, which knows the haystack)."""
    runner.discover_model()
    client = httpx.Client(timeout=runner.timeout(), headers=runner.headers())
    for path in ("/tokenize", "/v1/tokenize"):
        try:
            r = client.post(runner.root + path, json={"model": runner.model, "prompt": "hello"})
            if r.status_code == 200 and ("count" in r.json() or "tokens" in r.json()):
                return TokenizeCounter(runner, path, client)
        except (httpx.HTTPError, ValueError):
            continue
    client.close()
    return CalibratedCounter(runner)
