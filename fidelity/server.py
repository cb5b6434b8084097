"""`fidelity serve`: the reference model under one arm as an OpenAI-compatible server, so
the same HTTP clients (needle sweeps, lm-eval, the `openai` package) measure golden, any
toggle arm and a real SGLang/vLLM deployment alike.

Endpoints: GET /health, GET /v1/models, POST /tokenize and /detokenize (vLLM/SGLang
shapes), POST /v1/completions (logprobs, echo), POST /v1/chat/completions (DeepSeek-V4
chat encoding; thinking via chat_template_kwargs.thinking, reasoning split into
reasoning_content). Logprobs are raw (before temperature), like vLLM's raw_logprobs.
One generation runs at a time (the model computes on all cores); requests queue.
No streaming, n=1 only; both are refused with a 400, not silently ignored."""
from __future__ import annotations

import threading
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from reference_model import Model
from reference_model.generate import generate
from reference_model.tokenizer import TokenizerError

DEFAULT_CHAT_MAX_TOKENS = 256


class BadRequest(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.status = param, status


class Engine:
    """The model, tokenizer and arm behind the server; generation under a lock."""

    def __init__(self, target, arm, model_name: str | None = None):
        self.target, self.arm = target, arm
        self.tok = target.tokenizer
        self.model = Model(target.weights, arm.numerics())
        self.name = model_name or target.name
        self.max_model_len = target.cfg.max_seq_len
        self.lock = threading.Lock()
        self.created = int(time.time())

    # ---- request fields -----------------------------------------------------------------
    @staticmethod
    def _num(body, key, default, lo=None, hi=None, kind=float):
        v = body.get(key, default)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
            raise BadRequest(f"{key} must be a number", key)
        v = kind(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise BadRequest(f"{key} must be in [{lo}, {hi}], got {v}", key)
        return v

    def _common(self, body):
        if body.get("stream"):
            raise BadRequest("stream=true is not supported by fidelity serve", "stream")
        if body.get("n", 1) not in (1, None):
            raise BadRequest("only n=1 is supported", "n")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise BadRequest("stop must be a string or a list of non-empty strings", "stop")
        seed = body.get("seed")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise BadRequest("seed must be an integer", "seed")
        return {"temperature": self._num(body, "temperature", 1.0, 0.0, 2.0),
                "top_p": self._num(body, "top_p", 1.0, 0.0, 1.0), "seed": seed, "stop": stop or []}

    def _check_len(self, n_prompt, max_tokens):
        if n_prompt == 0:
            raise BadRequest("prompt is empty", "prompt")
        if n_prompt + max_tokens > self.max_model_len:
            raise BadRequest(f"this model's maximum context length is {self.max_model_len} tokens; "
                             f"the request has {n_prompt} prompt tokens and max_tokens {max_tokens}",
                             "max_tokens")

    def _run(self, ids, max_tokens, p, logprobs=None, echo=False):
        stop = p["stop"]

        def should_stop(toks):
            return bool(stop) and any(s in self.tok.decode(toks) for s in stop)

        with self.lock:
            return generate(self.model, ids, max_tokens, p["temperature"], p["top_p"], p["seed"],
                            stop_ids={self.tok.eos_id}, logprobs=logprobs, echo_logprobs=echo,
                            should_stop=should_stop if stop else None)

    @staticmethod
    def _cut_stop(text, stop):
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        return text if cut < 0 else text[:cut]

    def _piece(self, i) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    # ---- endpoints ----------------------------------------------------------------------
    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.name, "object": "model", "created": self.created, "owned_by": "dsv4-fidelity",
            "root": self.name, "max_model_len": self.max_model_len, "arm": self.arm.name}]}

    def _chat_text(self, body) -> tuple[str, bool]:
        kw = body.get("chat_template_kwargs") or {}
        if not isinstance(kw, dict):
            raise BadRequest("chat_template_kwargs must be an object", "chat_template_kwargs")
        thinking = kw.get("thinking", kw.get("enable_thinking"))
        th = body.get("thinking")                       # DeepSeek API style {"type": "enabled"}
        if thinking is None and isinstance(th, dict):
            thinking = th.get("type") == "enabled"
        thinking = bool(thinking)
        effort = body.get("reasoning_effort", kw.get("reasoning_effort"))
        try:
            text = self.tok.render_chat(body.get("messages"), thinking, effort,
                                        body.get("add_generation_prompt", True)).text
        except TokenizerError as e:
            raise BadRequest(str(e), "messages") from None
        return text, thinking

    def tokenize(self, body) -> dict:
        if "messages" in body:
            text, _ = self._chat_text(body)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
        else:
            raise BadRequest("give prompt (a string) or messages", "prompt")
        ids = self.tok.encode(text)
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids}
        out["token_strs"] = self.tok.token_strs(ids) if body.get("return_token_strs") else None
        return out

    def detokenize(self, body) -> dict:
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(i, int) and 0 <= i < self.tok.vocab_size for i in ids):
            raise BadRequest("tokens must be a list of token ids", "tokens")
        return {"prompt": self.tok.decode(ids, skip_special_tokens=False)}

    def _prompt_ids(self, prompt):
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
            bad = [i for i in prompt if not 0 <= i < self.target.cfg.vocab_size]
            if bad:
                raise BadRequest(f"token id {bad[0]} out of range", "prompt")
            return list(prompt)
        raise BadRequest("prompt must be a string, a list of token ids, or a one-element list of either",
                         "prompt")

    def completions(self, body) -> dict:
        p = self._common(body)
        ids = self._prompt_ids(body.get("prompt"))
        max_tokens = self._num(body, "max_tokens", 16, 0, None, int)
        lp = body.get("logprobs")
        if lp is not None:
            lp = self._num(body, "logprobs", None, 0, 20, int)
        echo = bool(body.get("echo", False))
        self._check_len(len(ids), max_tokens)
        g = self._run(ids, max_tokens, p, lp, echo and lp is not None)
        text = self._cut_stop(self.tok.decode(g.tokens), p["stop"])
        prompt_text = self.tok.decode(ids, skip_special_tokens=False) if echo else ""
        choice = {"index": 0, "text": prompt_text + text, "logprobs": None,
                  "finish_reason": g.finish_reason}
        if lp is not None:
            toks = (list(ids) if echo else []) + g.tokens
            lps = (g.prompt_logprobs if echo else []) + g.logprobs
            tops = (g.prompt_top_logprobs if echo else []) + g.top_logprobs
            pieces = [self._piece(i) for i in toks]
            offs, at = [], 0
            for s in pieces:
                offs.append(at)
                at += len(s)
            choice["logprobs"] = {
                "tokens": pieces, "token_logprobs": lps, "text_offset": offs,
                "top_logprobs": [None if t is None else {self._piece(i): v for i, v in t} for t in tops]}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion",
                "created": int(time.time()), "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(g.tokens),
                          "total_tokens": len(ids) + len(g.tokens)}}

    def chat(self, body) -> dict:
        p = self._common(body)
        text, thinking = self._chat_text(body)
        ids = self.tok.encode(text)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if mt is None else self._num(
            {"max_tokens": mt}, "max_tokens", None, 1, None, int)
        want_lp = bool(body.get("logprobs"))
        top = self._num(body, "top_logprobs", 0, 0, 20, int) if want_lp else None
        self._check_len(len(ids), max_tokens)
        g = self._run(ids, max_tokens, p, top if want_lp else None)
        reasoning, content = self.tok.split_reasoning(g.tokens, thinking)
        if content is not None:
            content = self._cut_stop(content, p["stop"])
        msg = {"role": "assistant", "content": content}
        if thinking:
            msg["reasoning_content"] = reasoning
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": g.finish_reason}
        if want_lp:
            def ent(i, v):
                s = self._piece(i)
                return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
            choice["logprobs"] = {"content": [
                {**ent(i, v), "top_logprobs": [ent(a, b) for a, b in t]}
                for i, v, t in zip(g.tokens, g.logprobs, g.top_logprobs)]}
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": self.name, "choices": [choice],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(g.tokens),
                          "total_tokens": len(ids) + len(g.tokens)}}


def create_app(engine: Engine) -> FastAPI:
    app = FastAPI(title="dsv4-fidelity", docs_url=None, redoc_url=None)

    def err(e: BadRequest):
        return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error",
                                       "param": e.param, "code": None}}, status_code=e.status)

    async def handle(request: Request, fn, threaded=False):
        try:
            body = await request.json()
        except ValueError:
            return err(BadRequest("request body is not valid JSON"))
        if not isinstance(body, dict):
            return err(BadRequest("request body must be a JSON object"))
        try:
            return await run_in_threadpool(fn, body) if threaded else fn(body)
        except BadRequest as e:
            return err(e)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return engine.models()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await handle(request, engine.tokenize)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await handle(request, engine.detokenize)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, engine.completions, threaded=True)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, engine.chat, threaded=True)

    return app
