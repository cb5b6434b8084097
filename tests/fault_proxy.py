"""A real server behind a misbehaving one: a loopback HTTP proxy that forwards every
request to an upstream server (e.g. a `fidelity serve` process) and, per route, spoils
the answers it is told to, in order. Clients then meet faults a real engine or gateway
produces, on top of real answers.

A fault list per path (e.g. "/tokenize", "/generate", "/v1/chat/completions") is
consumed one item per request to that path: "ok" (forward), an HTTP status ("500",
"502", ...: that status with an error body, upstream not asked), "drop" (connection
closed without an answer), "malformed" (200 with a truncated JSON body), "no_content"
(the upstream's 200 answer with every choice's `message` and `text` removed, its usage
kept: a reply that says tokens were generated but carries none), or a callable taking
the upstream's JSON answer and returning the 200 body to send instead (an answer of the
wrong shape). Every request is recorded: (method, path, JSON body)."""
from __future__ import annotations

import json

import httpx

from needle.stub import StubServer, ThreadedServer


def no_content(d: dict) -> dict:
    """A completion answer whose choices lost their message / text (usage kept)."""
    return {**d, "choices": [{k: v for k, v in c.items() if k not in ("message", "text")}
                             for c in d["choices"]]}


FAULTS = {"no_content": no_content}


class FaultProxy(ThreadedServer):
    def __init__(self, upstream: str, faults: dict[str, list] | None = None):
        self.upstream = upstream.rstrip("/")
        self.faults = {k: list(v) for k, v in (faults or {}).items()}
        self.seen: list[tuple[str, str, dict | None]] = []
        self.port: int | None = None
        self._client = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def count(self, path: str, method: str = "POST") -> int:
        return sum(1 for m, p, _ in self.seen if p == path and m == method)

    def bodies(self, path: str) -> list[dict]:
        return [b for _, p, b in self.seen if p == path and b is not None]

    async def _forward(self, method, path, headers, raw) -> tuple[int, bytes, str]:
        fwd = {k: v for k, v in headers.items() if k in ("content-type", "authorization")}
        r = await self._client.request(method, self.upstream + path, content=raw, headers=fwd)
        return r.status_code, r.content, r.headers.get("content-type", "application/json")

    async def _answer(self, method: str, path: str, headers: dict, raw: bytes) -> bytes | None:
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = None
        self.seen.append((method, path, body))
        queue = self.faults.get(path, [])
        fault = queue.pop(0) if queue else "ok"
        if fault == "drop":
            return None
        if fault == "malformed":
            return StubServer._response(200, b'{"choices": [{"message": ')
        if isinstance(fault, str) and fault.isdigit():
            err = json.dumps({"error": {"message": f"injected {fault}"}}).encode()
            return StubServer._response(int(fault), err)
        status, content, ctype = await self._forward(method, path, headers, raw)
        fault = FAULTS.get(fault, fault)
        if callable(fault) and status == 200:
            content = json.dumps(fault(json.loads(content))).encode()
        return StubServer._response(status, content, ctype)

    async def _setup(self) -> None:
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=30.0))

    async def _teardown(self) -> None:
        await self._client.aclose()
