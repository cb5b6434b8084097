"""A deterministic OpenAI-compatible stub server, optionally misbehaving, for testing and
benchmarking HTTP clients without a model.

It answers a needle question by reading the needles of every asked key back out of the
prompt (one key, or multiquery's "a, b, and c"; so a client's
whole path -- request, parsing, scoring -- is exercised with known outcomes); a fixed
hash-chosen share of prompts gets a wrong number. Faults are consumed one per generation
request, in order: an HTTP status ("500", "502", "429", "400", ...: that status with an
error body), "malformed" (200 with a broken JSON body), "drop" (connection closed without
a response), "timeout" (no answer for `hang` seconds), "bos" / "bos:reasoning" (the answer
with BOS in its content / its reasoning_content: a NaN logits row's argmax), "ok". `models_faults` and
`tokenize_faults` do the same, one per GET /v1/models and per POST /tokenize (either
path), so that start-up requests can misbehave too. Written on raw asyncio streams so that
drops and half-answers are real. Loopback only."""
from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading

_Q = re.compile(r"special magic \w+ for ((?:[a-z]+-[a-z]+(?:,? and |, )?)+) mentioned")


async def read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict, bytes] | None:
    """(method, path, lower-cased headers, body) of the next HTTP/1.1 request on a
    connection, None when the client has closed it."""
    line = await reader.readline()
    if not line:
        return None
    method, path, _ = line.decode("latin-1").split(" ", 2)
    headers = {}
    while True:
        h = await reader.readline()
        if h in (b"\r\n", b"\n", b""):
            break
        k, _, v = h.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    n = int(headers.get("content-length", 0))
    return method, path, headers, await reader.readexactly(n) if n else b""


def _chat_text(body: dict) -> str:
    """The prompt text of a chat request, rendered with DeepSeek-V4's chat template."""
    # lazy: reference_model loads torch; the stub serves completions without it
    from reference_model.tokenizer import render_chat
    kw = body.get("chat_template_kwargs") or {}
    return render_chat(body["messages"], bool(kw.get("thinking")))


class ThreadedServer:
    """An asyncio server on a free loopback port, run in a daemon thread, so tests and
    benches talk to it over real HTTP. Subclasses define `_answer(...)` and may
    open and close their own resources in `_setup` / `_teardown` (run on the server's loop)."""
    _loop: asyncio.AbstractEventLoop | None = None
    _thread: threading.Thread | None = None
    port: int | None = None

    async def _answer(self, method: str, path: str, headers: dict, raw: bytes) -> bytes | None:
        """The whole HTTP response to one request; None drops the connection."""
        raise NotImplementedError

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        """One keep-alive connection: requests answered in turn until the client leaves or
        an answer is None (the connection is dropped)."""
        try:
            while True:
                req = await read_request(reader)
                if req is None:
                    return
                out = await self._answer(*req)
                if out is None:
                    writer.transport.abort()
                    return
                writer.write(out)
                await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            return                           # cancelled at shutdown: end quietly
        finally:
            if not writer.transport.is_closing():
                writer.close()

    async def _setup(self) -> None:
        pass

    async def _teardown(self) -> None:
        pass

    def start(self):
        ready = threading.Event()

        def main():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._setup())
            server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", 0))
            self.port = server.sockets[0].getsockname()[1]
            ready.set()
            self._loop.run_forever()
            server.close()
            tasks = asyncio.all_tasks(self._loop)
            for t in tasks:
                t.cancel()
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            self._loop.run_until_complete(self._teardown())
            self._loop.close()

        self._thread = threading.Thread(target=main, daemon=True)
        self._thread.start()
        ready.wait(300)                      # a hang guard, not a speed requirement
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(300)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


class StubServer(ThreadedServer):
    def __init__(self, faults=(), delay: float = 0.0, hang: float = 5.0, wrong_every: int = 3,
                 tokenizer=None, tokenize: bool = True, models_faults=(), tokenize_faults=()):
        self.faults = list(faults)
        self.models_faults, self.tokenize_faults = list(models_faults), list(tokenize_faults)
        self.has_tokenize = tokenize            # False: /tokenize is 404 (like OpenAI's API)
        self.delay, self.hang, self.wrong_every = delay, hang, wrong_every
        self.tok = tokenizer
        self.requests = 0                     # generation requests received
        self.models_requests = 0              # GET /v1/models received
        self.tokenize_requests = 0            # POST /tokenize or /v1/tokenize received
        self.auth_sha256: set[str] = set()    # hashes of Authorization headers seen
        self.port: int | None = None
        self._thread: threading.Thread | None = None

    # ---- answers ------------------------------------------------------------------------
    def _count(self, text: str) -> int:
        return self.tok.count(text) if self.tok is not None else max(1, len(text) // 4)

    def answer(self, text: str) -> str:
        m = _Q.search(text)
        if not m:
            return "I do not know."
        vals = [v for k in re.findall(r"[a-z]+-[a-z]+", m.group(1))
                for v in re.findall(r"for " + re.escape(k) + r" is: ([0-9A-Za-z-]+)\.", text)]
        h = int(hashlib.sha256(text.encode()).hexdigest(), 16)
        if not vals or (self.wrong_every and h % self.wrong_every == 0):
            return "The special magic number is 1234567."
        return "The answer is: " + ", ".join(vals) + "."

    def _generate(self, path: str, body: dict) -> dict:
        if path.endswith("/chat/completions"):
            text = _chat_text(body)
            out = self.answer(body["messages"][-1]["content"])
            choice = {"index": 0, "message": {"role": "assistant", "content": out},
                      "finish_reason": "stop"}
        else:
            text = body["prompt"]
            out = " " + self.answer(text)
            choice = {"index": 0, "text": out, "finish_reason": "stop"}
        n = self._count(text)
        return {"id": "stub", "object": "x", "model": "stub", "choices": [choice],
                "usage": {"prompt_tokens": n, "completion_tokens": len(out.split()),
                          "total_tokens": n + len(out.split())}}

    def _tokenize(self, body: dict) -> dict:
        if "messages" in body:
            text = _chat_text(body)
        else:
            text = body.get("prompt", "")
        ids = self.tok.encode(text) if self.tok is not None else list(range(self._count(text)))
        return {"count": len(ids), "tokens": ids, "max_model_len": 1 << 20}

    # ---- HTTP ---------------------------------------------------------------------------
    @staticmethod
    def _response(status: int, body: bytes, ctype="application/json") -> bytes:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
                  429: "Too Many Requests", 500: "Internal Server Error", 502: "Bad Gateway",
                  503: "Service Unavailable"}.get(status, "X")
        return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode() + body

    async def _answer(self, method: str, path: str, headers: dict, raw: bytes) -> bytes | None:
        if "authorization" in headers:
            self.auth_sha256.add(hashlib.sha256(headers["authorization"].encode()).hexdigest())
        status, payload = 200, None
        models = method == "GET" and path.endswith("/models")
        tokenize = method == "POST" and path.endswith("/tokenize")
        generate = method == "POST" and path.endswith("completions")
        queue = (self.models_faults if models else self.tokenize_faults if tokenize
                 else self.faults if generate else [])
        self.models_requests += models
        self.tokenize_requests += tokenize
        self.requests += generate
        fault = queue.pop(0) if queue else "ok"
        if fault == "drop":
            return None
        if fault == "timeout":
            await asyncio.sleep(self.hang)
            return None
        if fault == "malformed":
            return self._response(200, b'{"choices": [{"message": ')
        if fault.isdigit():
            status, payload = int(fault), {"error": {"message": f"injected {fault}"}}
        elif models:
            payload = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
        elif method == "GET" and path == "/health":
            payload = {"status": "ok"}
        elif tokenize and self.has_tokenize:
            payload = self._tokenize(json.loads(raw or b"{}"))
        elif generate:
            if self.delay:
                await asyncio.sleep(self.delay)
            payload = self._generate(path, json.loads(raw))
            if fault.startswith("bos"):
                _plant_bos(payload, fault)
        else:
            status, payload = 404, {"error": {"message": "not found"}}
        return self._response(status, json.dumps(payload).encode())

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


def _plant_bos(payload: dict, fault: str) -> None:
    """The reply as a server writes it when one decode step's logits row was NaN and its
    argmax emitted token 0 (BOS), detokenized with special tokens kept: "bos" in the content,
    "bos:reasoning" in reasoning_content only (content unchanged)."""
    from reference_model.tokenizer import BOS
    ch = payload["choices"][0]
    msg = ch.get("message")
    if fault == "bos:reasoning" and msg is not None:
        msg["reasoning_content"] = f"Looking for the number.{BOS}{BOS} The key is named in the question."
    elif msg is not None:
        msg["content"] = msg["content"][:12] + BOS + msg["content"][12:]
    else:
        ch["text"] = ch["text"][:12] + BOS + ch["text"][12:]
