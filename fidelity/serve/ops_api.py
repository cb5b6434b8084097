"""Routes around generation, in both engines' shapes: /tokenize and /v1/tokenize (`prompt`
or `text`, or `messages` rendered as for a chat completion: vLLM's and SGLang's request
fields), /detokenize, /version and /tokenizer_info (vLLM), /health, /health_generate (a real one-token
generation, as SGLang's), /get_server_info and /get_model_info (SGLang; also without the
`get_` prefix), the prefix cache's flush: /flush_cache (SGLang) and /reset_prefix_cache
(vLLM)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from reference_model.generate import Sampling

from .engine import Engine, GenerationRequest
from .errors import ApiError
from .fields import Fields, read_json, warn_unknown
from .scheduler import Busy, wait_done

HEALTH_GENERATE_TIMEOUT_S = 60.0
TOKENIZE_FIELDS = {"prompt", "text", "messages", "model", "add_special_tokens", "return_token_strs",
                   "chat_template_kwargs", "reasoning_effort", "thinking", "tools",
                   "add_generation_prompt", "continue_final_message"}


class OpsRoutes:
    def __init__(self, engine: Engine, version: str):
        self.e, self.tok, self.version = engine, engine.tok, version

    async def tokenize(self, request: Request):
        """Token ids of a prompt or a rendered chat. `add_special_tokens` is accepted and
        changes nothing: DeepSeek-V4's tokenizer adds no BOS/EOS (add_bos_token false)."""
        body = await read_json(request)
        warn_unknown(f"POST {request.url.path}", body, TOKENIZE_FIELDS)
        f = Fields(body)
        f.flag("add_special_tokens")
        if "messages" in body:
            text = self.e.chat_prompt(body, self.e.resolve(body.get("model"))).text
        else:
            text = f.string("prompt", None)
            text = f.string("text", None) if text is None else text
            if text is None:
                raise ApiError("give prompt (or text), a string, or messages", "prompt")
        ids = self.tok.encode(text)
        out = {"count": len(ids), "max_model_len": self.e.max_model_len, "tokens": ids}
        if f.flag("return_token_strs"):
            out["token_strs"] = self.tok.token_strs(ids)
        return out

    async def detokenize(self, request: Request):
        body = await read_json(request)
        warn_unknown(f"POST {request.url.path}", body, {"tokens", "model"})
        ids = Fields(body).ids("tokens", self.e.vocab)
        if "tokens" not in body:
            raise ApiError("tokens (a list of token ids) is required", "tokens")
        return {"prompt": self.tok.decode(ids, skip_special_tokens=False)}

    async def health_generate(self, request: Request):
        """200 once a one-token greedy generation from input_ids [0] finishes, 503 if the
        server is full or it does not finish in time (SGLang's readiness probe)."""
        try:
            job = self.e.submit(self.e.first, [0], GenerationRequest(1, Sampling(0.0)))
            await asyncio.wait_for(wait_done(job, request.is_disconnected), HEALTH_GENERATE_TIMEOUT_S)
        except (Busy, asyncio.TimeoutError):
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    async def flush_cache(self):
        """SGLang's POST /flush_cache: 200 with its plain-text message. The stand-in's
        snapshots are copies, so a flush while requests run is safe and always done."""
        self.e.flush_prefix_cache()
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. "
                                 "(When there are running or waiting requests, the operation "
                                 "will not be performed.)\n")

    async def reset_prefix_cache(self):
        """vLLM's POST /reset_prefix_cache: an empty 200."""
        self.e.flush_prefix_cache()
        return Response(status_code=200)

    def router(self) -> APIRouter:
        r = APIRouter()
        for path in ("/tokenize", "/v1/tokenize"):
            r.add_api_route(path, self.tokenize, methods=["POST"])
        for path in ("/detokenize", "/v1/detokenize"):
            r.add_api_route(path, self.detokenize, methods=["POST"])
        r.add_api_route("/version", lambda: {"version": self.version}, methods=["GET"])
        r.add_api_route("/tokenizer_info", self.e.tokenizer_info, methods=["GET"])
        r.add_api_route("/flush_cache", self.flush_cache, methods=["POST"])
        r.add_api_route("/reset_prefix_cache", self.reset_prefix_cache, methods=["POST"])
        r.add_api_route("/health", lambda: {"status": "ok"}, methods=["GET"])
        r.add_api_route("/health_generate", self.health_generate, methods=["GET"])
        for path in ("/get_server_info", "/server_info"):
            r.add_api_route(path, lambda: self.e.server_info(self.version), methods=["GET"])
        for path in ("/get_model_info", "/model_info"):
            r.add_api_route(path, self.e.model_info, methods=["GET"])
        return r
