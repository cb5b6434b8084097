"""How a chat-check talks to an engine: its prompt token ids for a chat request (best
available way, chosen once: SGLang `/v1/tokenize` with messages, vLLM `/tokenize` with
messages, llama.cpp's `/apply-template` then its `/tokenize`, `prompt_token_ids` of a
one-token chat completion, or only `usage.prompt_tokens`
as the weakest fallback), its raw-text tokenizer and detokenizer, and a short completion
for the behaviour checks. Research engine-integration.md §3.4."""
from __future__ import annotations

from fidelity.kld.endpoint import Endpoint, EndpointError

# llama.cpp before vLLM: its /tokenize ignores `messages` and answers 200 with no tokens
METHODS = ("sglang-tokenize", "llamacpp-template", "vllm-tokenize", "response-ids", "usage-count")
WEAK = "usage-count"


class ProbeError(RuntimeError):
    pass


class ChatProbe:
    def __init__(self, endpoint: Endpoint, tokenizer=None):
        self.ep, self.local = endpoint, tokenizer
        self.method: str | None = None
        self.raw_route: str | None = None           # "/v1/tokenize" or "/tokenize"

    def _post(self, path, body, ok404=True):
        return self.ep.call("POST", path, {"model": self.ep.model, **body}, ok404=ok404)

    # ---- the engine's ids for a chat request ------------------------------------------------
    def chat_ids(self, case) -> tuple[list[int] | None, int]:
        """(ids or None when only a count is available, count)."""
        if self.method is None:
            return self._choose(case)
        return self._by(self.method, case)

    def _choose(self, case):
        for m in METHODS:
            try:
                got = self._by(m, case)
            except _Missing:
                continue
            self.method = m
            return got
        raise ProbeError(f"{self.ep.name}: no way to see prompt tokens: no tokenize route, no "
                         "prompt_token_ids and no usage.prompt_tokens in chat responses")

    def _by(self, method, case):
        b = case.body()
        if method == "sglang-tokenize":
            r = self._post("/v1/tokenize", {**b, "add_generation_prompt": True})
            if r is None or "tokens" not in r:
                raise _Missing()
            self.raw_route = self.raw_route or "/v1/tokenize"
            return list(r["tokens"]), len(r["tokens"])
        if method == "vllm-tokenize":
            if self.ep.llama_server:
                raise _Missing()
            kw = dict(b.pop("chat_template_kwargs", {}) or {})
            if "reasoning_effort" in b:                  # vLLM: no top-level reasoning_effort
                kw["reasoning_effort"] = b.pop("reasoning_effort")
            r = self._post("/tokenize", {**b, "chat_template_kwargs": kw, "add_generation_prompt": True})
            if r is None or "tokens" not in r:
                raise _Missing()
            self.raw_route = self.raw_route or "/tokenize"
            return list(r["tokens"]), len(r["tokens"])
        if method == "llamacpp-template":
            if not self.ep.llama_server:
                raise _Missing()
            r = self._post("/apply-template", b)
            if r is None or not isinstance(r.get("prompt"), str):
                raise _Missing()
            ids = self.ep.tokenize(r["prompt"])
            return ids, len(ids)
        r = self._post("/v1/chat/completions", {**b, "max_tokens": 1, "temperature": 0,
                                                "return_token_ids": True, "return_prompt_token_ids": True},
                       ok404=False)
        if method == "response-ids":
            ids = r.get("prompt_token_ids") or (r.get("choices") or [{}])[0].get("prompt_token_ids")
            if ids is None:
                raise _Missing()
            return list(ids), len(ids)
        n = (r.get("usage") or {}).get("prompt_tokens")
        if n is None:
            raise _Missing()
        return None, int(n)

    # ---- raw text -----------------------------------------------------------------------------
    def raw_ids(self, text: str) -> list[int] | None:
        """The engine's own tokenization of raw text (None without a tokenize route: then
        the local tokenizer stands in)."""
        if self.ep.llama_server:                         # its own body: content + parse_special
            self.raw_route = "/tokenize"
            return self.ep.tokenize(text)
        if self.raw_route is None:
            for route in ("/tokenize", "/v1/tokenize"):
                r = self._post(route, {"prompt": text})
                if r is not None and "tokens" in r:
                    self.raw_route = route
                    return list(r["tokens"])
            self.raw_route = ""
        if self.raw_route:
            return list(self._post(self.raw_route, {"prompt": text}, ok404=False)["tokens"])
        return None if self.local is None else self.local.encode(text)

    def decode(self, ids: list[int]) -> str:
        r = self._post("/detokenize", {"tokens": list(ids)})
        for key in ("prompt", "content"):                # SGLang/vLLM, llama.cpp
            if r is not None and isinstance(r.get(key), str):
                return r[key]
        if self.local is not None:
            return self.local.decode(ids, skip_special_tokens=False)
        return f"<{len(ids)} ids>"

    def complete(self, case, max_tokens: int = 4) -> dict:
        """A short chat completion of the case (behaviour checks; longer for a tool call)."""
        try:
            return self._post("/v1/chat/completions", {**case.body(), "max_tokens": max_tokens,
                                                        "temperature": 0}, ok404=False)
        except EndpointError as e:
            return {"error": str(e)}


class _Missing(Exception):
    """This way of seeing prompt tokens is not offered by the server."""
