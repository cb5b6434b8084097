"""The HTTP transport every client of a served model shares (needle's runner, kld's
endpoint, chat-check's probe): one retry policy, one backoff, one reading of a status.

A request is retried with exponential backoff (full jitter, at least Retry-After) on
connection errors, timeouts, dropped connections, 5xx, 429, and answers the caller's
parser rejects as retryable (e.g. an unparsable 200 body) -- but not on other 4xx, which
are the request's fault and would fail again. `retry` / `aretry` run any attempt under the
policy; `send` is one request with its status checked and its answer parsed. A URL is
recorded only through `redact_url` (no user:password); `check_url` refuses a non-http(s) one
before any request. Also here: which served model an
arm queries (`pick_model`, `model_options`), shared by `fidelity needle` and `fidelity kld`.
Imports nothing of ours."""
from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import httpx


class RequestFailed(Exception):
    """One failed attempt (or, raised out of retry/aretry/send, the last one; `attempts`
    says how many were made)."""

    def __init__(self, message: str, retryable: bool, status: int | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.retryable, self.status, self.retry_after = retryable, status, retry_after
        self.attempts = 1


class StartupError(RequestFailed, ValueError):
    """A start-up request that failed for good: a 4xx (or an answer that cannot be used),
    or a retryable failure after every retry (`exhausted`). A ValueError so that a command
    reports it as one line, without a traceback."""
    def __init__(self, message: str, cause: RequestFailed, attempts: int):
        super().__init__(message, False, cause.status)
        self.exhausted, self.attempts = cause.retryable, attempts


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


class URLError(ValueError):
    """An endpoint that is not an http(s) URL with a host: refused before any request,
    since no retry could make it answer."""


def check_url(url: str) -> str:
    """`url` if it is an http:// or https:// URL with a host (and a numeric port, if any);
    else URLError. Every command that takes an endpoint checks it here, when its option is
    parsed. The message never repeats a password."""
    try:
        p = urlsplit(url)
        ok = p.scheme in ("http", "https") and bool(p.hostname)
        p.port                                       # ValueError for a port that is not a number
    except ValueError:
        ok = False
    if not ok:
        shown = url if "@" not in url else "***@" + url.rsplit("@", 1)[1]
        raise URLError(f"{shown!r} is not an http:// or https:// URL with a host "
                       "(e.g. http://127.0.0.1:30000)")
    return url


def split_base(url: str) -> tuple[str, str]:
    """(server root, OpenAI base ending in /v1) from either form."""
    u = url.rstrip("/")
    root = u[:-3] if u.endswith("/v1") else u
    return root, root + "/v1"


AUTH_HINT = "OPENAI_API_KEY unless given"


def bearer(key: str | None) -> dict:
    """The Authorization header of an API key (none without one). The key goes only here:
    never into a message, a log, a manifest or a report."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def check_status(r: httpx.Response) -> None:
    """RequestFailed for an error status: retryable for 429 and 5xx (with Retry-After in
    seconds when given), not for other 4xx."""
    if r.status_code == 429 or r.status_code >= 500:
        ra = r.headers.get("retry-after")
        try:
            ra = float(ra) if ra is not None else None
        except ValueError:
            ra = None
        raise RequestFailed(f"HTTP {r.status_code}: {r.text[:200]}", True, r.status_code, ra)
    if r.status_code in (401, 403):
        raise RequestFailed(f"HTTP {r.status_code}: the server refused the request's credentials: {r.text[:200]} "
                            f"(an API key is sent from the variable --api-key-env names, {AUTH_HINT})",
                            False, r.status_code)
    if r.status_code >= 400:
        raise RequestFailed(f"HTTP {r.status_code}: {r.text[:300]}", False, r.status_code)


def transport_failure(e: httpx.HTTPError) -> RequestFailed:
    """A request that got no usable response: always retryable."""
    if isinstance(e, httpx.TimeoutException):
        return RequestFailed(f"timeout ({type(e).__name__})", True)
    if isinstance(e, httpx.TransportError):
        return RequestFailed(f"connection error ({type(e).__name__}: {e})", True)
    return RequestFailed(f"HTTP error ({type(e).__name__}: {e})", True)   # e.g. undecodable body


def backoff_delay(policy: RetryPolicy, attempts: int, retry_after: float | None) -> float:
    """Seconds to wait after failed attempt number `attempts`: full jitter under a ceiling
    doubling from policy.backoff, at least Retry-After, at most policy.backoff_max."""
    cap = min(policy.backoff_max, policy.backoff * 2 ** (attempts - 1))
    delay = random.uniform(0, cap)
    if retry_after is not None:
        delay = min(policy.backoff_max, max(delay, retry_after))
    return delay


def _retry_delay(e: RequestFailed, attempts: int, policy: RetryPolicy, on_retry) -> float | None:
    """Seconds before the next attempt after failure `e` of attempt number `attempts`
    (on_retry(attempts, e, delay) told first), or None when it was the last (e.attempts set)."""
    if not e.retryable or attempts > policy.retries:
        e.attempts = attempts
        return None
    delay = backoff_delay(policy, attempts, e.retry_after)
    if on_retry is not None:
        on_retry(attempts, e, delay)
    return delay


def retry(attempt, policy: RetryPolicy, on_retry=None):
    """attempt()'s result, attempt() called again after each retryable RequestFailed while
    the policy allows; on_retry(attempt number, error, delay) before each wait. The last
    failure is raised with `attempts` set."""
    attempts = 0
    while True:
        attempts += 1
        try:
            return attempt()
        except RequestFailed as e:
            delay = _retry_delay(e, attempts, policy, on_retry)
            if delay is None:
                raise
        time.sleep(delay)


async def aretry(attempt, policy: RetryPolicy, on_retry=None):
    """`retry` for a coroutine function: await attempt(), sleeping without blocking."""
    attempts = 0
    while True:
        attempts += 1
        try:
            return await attempt()
        except RequestFailed as e:
            delay = _retry_delay(e, attempts, policy, on_retry)
            if delay is None:
                raise
        await asyncio.sleep(delay)


def send(client: httpx.Client, method: str, url: str, parse, policy: RetryPolicy, *,
         json: dict | None = None, on_retry=None, missing_ok: bool = False):
    """parse(response) of one request under `policy` (see `retry`): a transport failure or
    an error status is a RequestFailed, and parse raises one for an answer it cannot use,
    retryable or not. None on a 404 when `missing_ok` (a route the server does not have)."""
    def once():
        try:
            r = client.request(method, url, json=json)
        except httpx.HTTPError as e:
            raise transport_failure(e) from None
        if missing_ok and r.status_code == 404:
            return None
        check_status(r)
        return parse(r)
    return retry(once, policy, on_retry)


# ---- which served model an arm queries ----------------------------------------------------
# One server may serve several arms (e.g. `fidelity serve --arm golden=... --arm engine=...`),
# so taking the first listed model would score every arm on one of them: an arm takes the
# model named like it, a model chosen for it, or the only one served -- and otherwise fails,
# naming what is served.

class ModelChoiceError(ValueError):
    """No served model can be told to be this arm's."""


def served_models(body) -> dict[str, object]:
    """/v1/models' answer read as {model id: its `meta` (llama-server states the vocabulary
    there), or None}; ValueError naming what came instead of a model list."""
    try:
        return {str(m["id"]): m.get("meta") for m in body["data"]}
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"no model list in {str(body)[:200]!r}") from None


def pick_model(arm: str, wanted: str | None, served: list[str]) -> str:
    """The model arm `arm` queries: `wanted` if given (it must be served), else the served
    model named `arm`, else the only one served."""
    listed = ", ".join(served) or "none"
    if wanted is not None:
        if served and wanted not in served:
            raise ModelChoiceError(f"endpoint {arm!r}: model {wanted!r} is not served (served: {listed})")
        return wanted
    if arm in served:
        return arm
    if len(served) == 1:
        return served[0]
    raise ModelChoiceError(
        f"endpoint {arm!r}: the server serves {len(served)} models ({listed}) and none is named "
        f"{arm!r}; name the arm after one (--endpoint MODEL=URL) or choose one with "
        f"--model {arm}=MODEL")


def model_options(values: list[str], arms: list[str]) -> tuple[str | None, dict[str, str]]:
    """--model values: 'ARM=MODEL' for one endpoint arm, a bare 'MODEL' for every arm not
    named. Returns (model for all, {arm: model})."""
    every, per = None, {}
    for v in values or []:
        name, sep, model = v.partition("=")
        if sep:
            if name.strip() not in arms or not model.strip():
                raise ModelChoiceError(f"--model {v!r}: expected ARM=MODEL with ARM an endpoint "
                                       f"arm ({', '.join(arms) or 'none'}), or a bare MODEL")
            per[name.strip()] = model.strip()
        elif every is None:
            every = v.strip()
        else:
            raise ModelChoiceError(f"--model {v!r}: a model for every endpoint is already given "
                                   f"({every!r}); use ARM=MODEL (arms: {', '.join(arms)})")
    return every, per
