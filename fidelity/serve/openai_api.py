"""OpenAI's routes as vLLM serves them: /v1/models, /v1/completions (logprobs, echo, vLLM's
`prompt_logprobs` and `return_token_ids`, `ignore_eos`, `top_k`), /v1/chat/completions
(DeepSeek-V4 chat encoding, reasoning split into `reasoning_content`), both streamed as
server-sent events on `stream: true` in OpenAI's chunk format. Logprobs are raw (vLLM's
default `raw_logprobs`)."""
from __future__ import annotations

import json
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from reference_model.generate import Sampling, Scoring

from .engine import Engine
from .errors import ApiError
from .fields import Fields, read_json
from .scheduler import token_events, wait_done
from .textstream import TextStream, cut_stop

DEFAULT_CHAT_MAX_TOKENS = 256


def sampling(f: Fields, vocab: int) -> Sampling:
    seed = f.body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(f"seed must be an integer, got {seed!r}", "seed")
    return Sampling(f.num("temperature", 1.0, 0.0, 2.0), f.num("top_p", 1.0, 0.0, 1.0),
                    f.integer("top_k", -1, -1, vocab), seed, f.logit_bias(vocab))


def _common(f: Fields) -> None:
    if f.body.get("n", 1) not in (1, None):
        raise ApiError("only n=1 is supported", "n")
    f.refuse("best_of", "one sample is drawn per request", (None, 1))


def _stream_options(f: Fields, stream: bool) -> bool:
    so = f.body.get("stream_options")
    if so is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(so, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    return Fields(so, "stream_options.").flag("include_usage")


def _usage(n_prompt: int, gen) -> dict:
    n = len(gen.tokens) + (gen.stop_token is not None)        # the stop token counts, as in engines
    return {"prompt_tokens": n_prompt, "completion_tokens": n, "total_tokens": n_prompt + n}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class OpenAIRoutes:
    def __init__(self, engine: Engine):
        self.e, self.tok = engine, engine.tok

    def piece(self, i: int) -> str:
        return self.tok.decode([i], skip_special_tokens=False)

    def _logprobs_k(self, f: Fields, key: str) -> int | None:
        if f.body.get(key) is None:
            return None
        hi = self.e.max_logprobs
        k = f.integer(key, None, -1, None)
        k = self.e.vocab if k == -1 else k
        if k > hi:
            raise ApiError(f"{key} {k} is larger than the server's max_logprobs {hi} "
                           "(start the server with a larger --max-logprobs)", key)
        return k

    # ---- /v1/completions ----------------------------------------------------------------
    async def completions(self, request: Request):
        body = await read_json(request)
        f = Fields(body)
        served = self.e.resolve(body.get("model"))
        _common(f)
        f.refuse("suffix", "DeepSeek-V4 has no fill-in-the-middle format", (None, ""))
        stream = f.flag("stream")
        usage_chunk = _stream_options(f, stream)
        ids = self.e.prompt_ids(body.get("prompt"))
        max_tokens = f.integer("max_tokens", 16, 0)
        lp = self._logprobs_k(f, "logprobs")
        echo = f.flag("echo")
        plp = self._logprobs_k(f, "prompt_logprobs")
        if plp is not None and stream:
            raise ApiError("prompt_logprobs is not allowed with stream: true", "prompt_logprobs")
        prompt_k = plp if plp is not None else lp if echo else None     # echo scores the prompt
        stop = f.strings("stop")
        scoring = Scoring(top=lp, prompt_top=prompt_k, prompt_from=0)
        job = self.e.submit(served, ids, max_tokens, sampling(f, self.e.vocab), scoring, stop,
                            f.flag("ignore_eos"))
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": served.id}
        if stream:
            return StreamingResponse(self._stream_completion(job, head, ids, lp, echo, stop, usage_chunk,
                                                             f.flag("return_tokens_as_token_ids")),
                                     media_type="text/event-stream")
        await wait_done(job, request.is_disconnected)
        g = job.decoder.out
        out = cut_stop(self.tok.decode(g.tokens), stop)
        prompt_text = self.tok.decode(ids, skip_special_tokens=False) if echo else ""
        choice = {"index": 0, "text": prompt_text + out, "logprobs": None,
                  "finish_reason": g.finish_reason, "stop_reason": None}
        if lp is not None:
            scores = (g.prompt_scores if echo else []) + g.scores[:len(g.tokens)]
            choice["logprobs"] = self._legacy_logprobs((ids if echo else []) + g.tokens, scores,
                                                       f.flag("return_tokens_as_token_ids"))
        if plp is not None:
            choice["prompt_logprobs"] = self._vllm_prompt_logprobs(g.prompt_scores)
        if f.flag("return_token_ids"):
            choice["prompt_token_ids"], choice["token_ids"] = list(ids), list(g.tokens)
        return {**head, "choices": [choice], "usage": _usage(len(ids), g)}

    def _legacy_logprobs(self, toks, scores, as_ids: bool = False) -> dict:
        """OpenAI's legacy shape; vLLM's `return_tokens_as_token_ids` spells every token
        "token_id:<id>" (texts can collide, ids cannot)."""
        name = (lambda i: f"token_id:{i}") if as_ids else self.piece
        pieces = [name(i) for i in toks]
        offs, at = [], 0
        for s in pieces:
            offs.append(at)
            at += len(s)
        return {"tokens": pieces, "token_logprobs": [None if s is None else s.logprob for s in scores],
                "text_offset": offs,
                "top_logprobs": [None if s is None else {name(i): v for i, v in s.top}
                                 for s in scores]}

    def _vllm_prompt_logprobs(self, scores) -> list:
        """vLLM's shape: null, then per position {"id": {logprob, rank, decoded_token}} with
        the prompt token first (its true rank), then the top k (ranks 1..k)."""
        out = []
        for s in scores:
            if s is None:
                out.append(None)
                continue
            d = {str(s.token): {"logprob": s.logprob, "rank": s.rank, "decoded_token": self.piece(s.token)}}
            for r, (i, v) in enumerate(s.top, 1):
                d.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": self.piece(i)})
            out.append(d)
        return out

    async def _stream_completion(self, job, head, ids, lp, echo, stop, usage_chunk, as_ids=False):
        text = TextStream(self.tok.decode, stop)
        if echo:
            yield _sse({**head, "choices": [{"index": 0, "text": self.tok.decode(ids, skip_special_tokens=False),
                                             "logprobs": None, "finish_reason": None}]})
        async for tok in token_events(job):
            delta = text.push(tok)
            choice = {"index": 0, "text": delta, "logprobs": None, "finish_reason": None}
            if lp is not None:
                choice["logprobs"] = self._legacy_logprobs([tok], [job.decoder.out.scores[len(text.ids) - 1]],
                                                           as_ids)
            yield _sse({**head, "choices": [choice]})
        g = job.decoder.out
        yield _sse({**head, "choices": [{"index": 0, "text": text.finish(), "logprobs": None,
                                         "finish_reason": g.finish_reason}]})
        if usage_chunk:
            yield _sse({**head, "choices": [], "usage": _usage(len(ids), g)})
        yield "data: [DONE]\n\n"

    # ---- /v1/chat/completions -----------------------------------------------------------
    async def chat(self, request: Request):
        body = await read_json(request)
        f = Fields(body)
        served = self.e.resolve(body.get("model"))
        _common(f)
        stream = f.flag("stream")
        usage_chunk = _stream_options(f, stream)
        text, thinking = self.e.chat_prompt(body, served)
        ids = self.tok.encode(text)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if mt is None else Fields({"max_tokens": mt}).integer(
            "max_tokens", None, 1)
        want_lp = f.flag("logprobs")
        top = f.integer("top_logprobs", 0, 0, self.e.max_logprobs) if want_lp else None
        stop = f.strings("stop")
        job = self.e.submit(served, ids, max_tokens, sampling(f, self.e.vocab), Scoring(top=top), stop,
                            f.flag("ignore_eos"))
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": served.id}
        if stream:
            return StreamingResponse(self._stream_chat(job, head, ids, thinking, want_lp, stop, usage_chunk),
                                     media_type="text/event-stream")
        await wait_done(job, request.is_disconnected)
        g = job.decoder.out
        reasoning, content = self._split(g.tokens, thinking, stop)
        msg = {"role": "assistant", "content": content}
        if thinking:
            msg["reasoning_content"] = reasoning
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": g.finish_reason}
        if want_lp:
            choice["logprobs"] = {"content": [self._chat_lp(s) for s in g.scores[:len(g.tokens)]]}
        out = {**head, "choices": [choice], "usage": _usage(len(ids), g)}
        if f.flag("return_token_ids"):
            out["prompt_token_ids"], choice["token_ids"] = list(ids), list(g.tokens)
        return out

    def _split(self, tokens, thinking, stop):
        """(reasoning, content) with the stop strings applied to the content."""
        reasoning, content = self.tok.split_reasoning(tokens, thinking)
        return reasoning, None if content is None else cut_stop(content, stop)

    def _chat_lp(self, s) -> dict:
        def ent(i, v):
            p = self.piece(i)
            return {"token": p, "logprob": v, "bytes": list(p.encode("utf-8"))}
        return {**ent(s.token, s.logprob), "top_logprobs": [ent(a, b) for a, b in s.top]}

    async def _stream_chat(self, job, head, ids, thinking, want_lp, stop, usage_chunk):
        head = {**head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if usage_chunk else {}

        def chunk(delta, finish=None, lp=None):
            return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}], **extra})

        yield chunk({"role": "assistant", "content": ""})
        reasoning = TextStream(self.tok.decode) if thinking else None
        content = TextStream(self.tok.decode, stop)
        n = 0
        async for tok in token_events(job):
            lp = {"content": [self._chat_lp(job.decoder.out.scores[n])]} if want_lp else None
            n += 1
            if reasoning is not None and tok == self.tok.end_think_id:
                rest = reasoning.finish()
                reasoning = None
                if rest or lp:
                    yield chunk({"reasoning_content": rest}, lp=lp)
                continue
            if reasoning is not None:
                d = reasoning.push(tok)
                if d or lp:
                    yield chunk({"reasoning_content": d}, lp=lp)
            else:
                d = content.push(tok)
                if d or lp:
                    yield chunk({"content": d}, lp=lp)
        rest = reasoning.finish() if reasoning is not None else content.finish()
        if rest:
            yield chunk({"reasoning_content": rest} if reasoning is not None else {"content": rest})
        g = job.decoder.out
        yield chunk({}, g.finish_reason)
        if usage_chunk:
            yield _sse({**head, "choices": [], "usage": _usage(len(ids), g)})
        yield "data: [DONE]\n\n"

    # ---- routes -------------------------------------------------------------------------
    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/v1/models", lambda: {"object": "list", "data": self.e.model_cards()},
                        methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        return r
