"""OpenAI's routes as vLLM serves them: /v1/models, /v1/completions (logprobs, echo, vLLM's
`prompt_logprobs` and `return_token_ids`, `ignore_eos`, `top_k`), /v1/chat/completions
(DeepSeek-V4 / V4.1 chat encoding, reasoning split into `reasoning_content`, DSML tool
calls read into `tool_calls` when the request declares tools), both streamed as
server-sent events on `stream: true` in OpenAI's chunk format. Logprobs are raw (vLLM's
default `raw_logprobs`). A sampled stop token (EOS or a `stop_token_ids` id) is returned as
vLLM returns it: in `token_ids` and in every logprob list (its text left out of `text`), so
logprob entries = completion_tokens everywhere. A batched completions prompt (a list of
strings or of token-id lists) is answered as one request per prompt, choices in order."""
from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from reference_model.generate import Sampling, Scoring

from .engine import Engine, GenerationRequest
from .errors import ApiError
from .fields import Fields, read_json, warn_unknown
from .scheduler import token_events, wait_done
from .textstream import TextStream, cut_stop
from .tool_calls import CallStream, parse

DEFAULT_CHAT_MAX_TOKENS = 256
COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                 "stop_token_ids", "logit_bias", "ignore_eos", "return_token_ids", "stream",
                 "stream_options", "n", "best_of", "user", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "min_p"}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "logprobs", "echo", "prompt_logprobs", "suffix",
                                     "return_tokens_as_token_ids"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                               "chat_template_kwargs", "reasoning_effort", "thinking", "tools",
                               "tool_choice", "add_generation_prompt"}


@dataclass(frozen=True)
class StreamShape:
    """How a streamed answer's chunks look, fixed before the first one is sent, so the
    streaming generators take one object instead of a flag each."""
    head: dict                      # id, object, created, model: in every chunk
    stop: tuple[str, ...] = ()      # stop strings: text held back until they cannot match
    logprobs: int | None = None     # top logprobs per token (None: no logprobs)
    echo: bool = False              # completions: the prompt's text first
    as_ids: bool = False            # completions: tokens spelt "token_id:<id>"
    thinking: bool = False          # chat: reasoning streamed as reasoning_content
    dsml: str | None = None         # chat: DSML dialect tool calls are read in (None: not read)
    usage_chunk: bool = False       # a last chunk with the usage (stream_options)


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
    for k in ("presence_penalty", "frequency_penalty"):
        f.refuse(k, "no penalties are applied (0 only)", (None, 0))
    f.refuse("repetition_penalty", "no penalties are applied (1 only)", (None, 1))
    f.refuse("min_p", "use top_p / top_k (0 only)", (None, 0))


def _stream_options(f: Fields, stream: bool) -> bool:
    so = f.body.get("stream_options")
    if so is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true", "stream_options")
    if not isinstance(so, dict):
        raise ApiError("stream_options must be an object", "stream_options")
    return Fields(so, "stream_options.").flag("include_usage")


def _usage(pairs) -> dict:
    """Usage summed over (prompt ids, Generation) pairs; the stop token counts, as in engines.
    prompt_tokens_details.cached_tokens: prompt tokens restored from the prefix cache
    (OpenAI's and vLLM's field)."""
    p = sum(len(ids) for ids, _ in pairs)
    n = sum(len(g.output_ids) for _, g in pairs)
    c = sum(getattr(g, "cached_tokens", 0) for _, g in pairs)
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": c}}


async def _wait_all(jobs, is_disconnected) -> None:
    """Every job done; on any failure (client gone, an error) the others are cancelled."""
    try:
        for job in jobs:
            await wait_done(job, is_disconnected)
    except BaseException:
        for job in jobs:
            job.cancel()
        raise


def _stop_reason(g, req: GenerationRequest, text: str) -> int | str | None:
    """vLLM's stop_reason: the stop token id or stop string that ended it; None for EOS."""
    if g.stop_token is not None:
        return g.stop_token if g.stop_token in req.stop_ids else None
    if g.finish_reason == "stop":
        return next((s for s in req.stop if s in text), None)
    return None


def _tool_dialect(body: dict, rendered) -> str | None:
    """The DSML dialect the answer's tool calls are read in: the rendering's (the arm's
    request toggles may change it), when the request declares tools and tool_choice is
    not 'none'; None: the answer is all content, as engines leave it without tools."""
    if not body.get("tools") or body.get("tool_choice") == "none":
        return None
    return rendered.dsml


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
        return self.e.check_logprobs(f.integer(key, None, -1, None), key)

    def _submit_all(self, served, prompts, req: GenerationRequest):
        """One job per prompt, all checked before any runs; a refusal cancels the rest."""
        for i, ids in enumerate(prompts):
            self.e.check_len(len(ids), req.max_tokens, f"prompt[{i}]" if len(prompts) > 1 else "prompt")
        jobs = []
        try:
            for ids in prompts:
                jobs.append(self.e.submit(served, ids, req))
        except BaseException:
            for j in jobs:
                j.cancel()
            raise
        return jobs

    # ---- /v1/completions ----------------------------------------------------------------
    async def _open(self, request: Request, route: str, known):
        """What both generation routes read first: the JSON body (unknown fields logged),
        the served arm, the checks they share and the streaming options."""
        body = await read_json(request)
        warn_unknown(route, body, known)
        f = Fields(body)
        served = self.e.resolve(body.get("model"))
        _common(f)
        stream = f.flag("stream")
        return body, f, served, stream, _stream_options(f, stream)

    async def completions(self, request: Request):
        body, f, served, stream, usage_chunk = await self._open(request, "POST /v1/completions",
                                                                COMPLETION_FIELDS)
        f.refuse("suffix", "DeepSeek-V4 has no fill-in-the-middle format", (None, ""))
        prompts = self.e.prompts(body.get("prompt"))
        max_tokens = f.integer("max_tokens", 16, 0)
        lp = self._logprobs_k(f, "logprobs")
        echo = f.flag("echo")
        plp = self._logprobs_k(f, "prompt_logprobs")
        if plp is not None and stream:
            raise ApiError("prompt_logprobs is not allowed with stream: true", "prompt_logprobs")
        prompt_k = plp if plp is not None else lp if echo else None     # echo scores the prompt
        stop, stop_ids = f.strings("stop"), f.ids("stop_token_ids", self.e.vocab)
        as_ids = f.flag("return_tokens_as_token_ids")
        scoring = Scoring(top=lp, prompt_top=prompt_k, prompt_from=0)
        req = GenerationRequest(max_tokens, sampling(f, self.e.vocab), scoring, stop, stop_ids,
                                f.flag("ignore_eos"))
        jobs = self._submit_all(served, prompts, req)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": rid, "object": "text_completion", "created": created, "model": served.id}
        if stream:
            shape = StreamShape(head, stop, lp, echo, as_ids, usage_chunk=usage_chunk)
            return StreamingResponse(self._stream_completion(jobs, prompts, shape),
                                     media_type="text/event-stream")
        await _wait_all(jobs, request.is_disconnected)
        choices = []
        for i, (ids, job) in enumerate(zip(prompts, jobs)):
            g = job.decoder.out
            text = self.tok.decode(g.tokens)
            out = cut_stop(text, stop)
            prompt_text = self.tok.decode(ids, skip_special_tokens=False) if echo else ""
            choice = {"index": i, "text": prompt_text + out, "logprobs": None,
                      "finish_reason": g.finish_reason,
                      "stop_reason": _stop_reason(g, req, text)}
            if lp is not None:
                scores = (g.prompt_scores if echo else []) + g.scores
                choice["logprobs"] = self._legacy_logprobs((ids if echo else []) + g.output_ids, scores,
                                                           as_ids)
            if plp is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(g.prompt_scores)
            if f.flag("return_token_ids"):
                choice["prompt_token_ids"], choice["token_ids"] = list(ids), g.output_ids
            choices.append(choice)
        return {**head, "choices": choices,
                "usage": _usage([(ids, j.decoder.out) for ids, j in zip(prompts, jobs)])}

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

    async def _stream_completion(self, jobs, prompts, shape: StreamShape):
        """Each prompt's chunks in turn (choice index = prompt index); a sampled stop token
        comes in the finishing chunk, with its logprobs and no text (as vLLM streams it)."""
        try:
            for i, (ids, job) in enumerate(zip(prompts, jobs)):
                async for chunk in self._stream_one(i, job, ids, shape):
                    yield chunk
        finally:
            for job in jobs:
                if not job.decoder.done:
                    job.cancel()
        if shape.usage_chunk:
            yield _sse({**shape.head, "choices": [],
                        "usage": _usage([(ids, j.decoder.out) for ids, j in zip(prompts, jobs)])})
        yield "data: [DONE]\n\n"

    async def _stream_one(self, i, job, ids, shape: StreamShape):
        text = TextStream(self.tok.decode, shape.stop)
        lp, as_ids = shape.logprobs, shape.as_ids

        def chunk(delta, logprobs=None, finish=None):
            return _sse({**shape.head, "choices": [{"index": i, "text": delta, "logprobs": logprobs,
                                                    "finish_reason": finish}]})

        if shape.echo:
            yield chunk(self.tok.decode(ids, skip_special_tokens=False))
        async for tok in token_events(job):
            delta = text.push(tok)
            scores = job.decoder.out.scores
            yield chunk(delta, None if lp is None else
                        self._legacy_logprobs([tok], [scores[len(text.ids) - 1]], as_ids))
        g = job.decoder.out
        rest = text.finish()
        stop_lp = None
        if g.stop_token is not None and lp is not None:
            stop_lp = self._legacy_logprobs([g.stop_token], [g.scores[-1]], as_ids)
        if rest and stop_lp is not None:
            yield chunk(rest)
            rest = ""
        yield chunk(rest, stop_lp, g.finish_reason)

    # ---- /v1/chat/completions -----------------------------------------------------------
    async def chat(self, request: Request):
        body, f, served, stream, usage_chunk = await self._open(request, "POST /v1/chat/completions",
                                                                CHAT_FIELDS)
        rendered = self.e.chat_prompt(body, served)
        thinking, dsml = rendered.thinking, _tool_dialect(body, rendered)
        ids = self.tok.encode(rendered.text)
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        max_tokens = DEFAULT_CHAT_MAX_TOKENS if mt is None else Fields({"max_tokens": mt}).integer(
            "max_tokens", None, 1)
        want_lp = f.flag("logprobs")
        top = self.e.check_logprobs(f.integer("top_logprobs", 0, 0), "top_logprobs") if want_lp else None
        stop, stop_ids = f.strings("stop"), f.ids("stop_token_ids", self.e.vocab)
        req = GenerationRequest(max_tokens, sampling(f, self.e.vocab), Scoring(top=top), stop, stop_ids,
                                f.flag("ignore_eos"))
        (job,) = self._submit_all(served, [ids], req)
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
                "created": int(time.time()), "model": served.id}
        if stream:
            shape = StreamShape(head, stop, top, thinking=thinking, usage_chunk=usage_chunk, dsml=dsml)
            return StreamingResponse(self._stream_chat(job, ids, shape), media_type="text/event-stream")
        await wait_done(job, request.is_disconnected)
        g = job.decoder.out
        reasoning, content = self._split(g.tokens, thinking, stop, keep_specials=dsml is not None)
        msg = {"role": "assistant", "content": content}
        finish = g.finish_reason
        if dsml is not None and content is not None:
            msg["content"], calls = parse(content, dsml)
            if calls:
                msg["tool_calls"] = [c.openai() for c in calls]
                finish = "tool_calls" if finish == "stop" else finish
        if thinking:
            msg["reasoning_content"] = reasoning
        choice = {"index": 0, "message": msg, "logprobs": None, "finish_reason": finish,
                  "stop_reason": _stop_reason(g, req, self.tok.decode(g.tokens))}
        if want_lp:
            choice["logprobs"] = {"content": [self._chat_lp(s) for s in g.scores]}
        out = {**head, "choices": [choice], "usage": _usage([(ids, g)])}
        if f.flag("return_token_ids"):
            out["prompt_token_ids"], choice["token_ids"] = list(ids), g.output_ids
        return out

    def _split(self, tokens, thinking, stop, keep_specials: bool = False):
        """(reasoning, content) with the stop strings applied to the content. With tool
        calls to read, the content keeps special-token text (｜DSML｜ is one in DeepSeek's
        vocabulary), as engines decode for their tool parsers."""
        reasoning, content = self.tok.split_reasoning(tokens, thinking)
        if keep_specials and content is not None:
            ids = list(tokens)
            ids = ids[ids.index(self.tok.end_think_id) + 1:] if thinking else ids
            content = self.tok.decode(ids, skip_special_tokens=False)
        return reasoning, None if content is None else cut_stop(content, stop)

    def _chat_lp(self, s) -> dict:
        def ent(i, v):
            p = self.piece(i)
            return {"token": p, "logprob": v, "bytes": list(p.encode("utf-8"))}
        return {**ent(s.token, s.logprob), "top_logprobs": [ent(a, b) for a, b in s.top]}

    async def _stream_chat(self, job, ids, shape: StreamShape):
        head = {**shape.head, "object": "chat.completion.chunk"}
        extra = {"usage": None} if shape.usage_chunk else {}
        want_lp = shape.logprobs is not None

        def chunk(delta, finish=None, lp=None):
            return _sse({**head, "choices": [{"index": 0, "delta": delta, "logprobs": lp,
                                              "finish_reason": finish}], **extra})

        yield chunk({"role": "assistant", "content": ""})
        reasoning = TextStream(self.tok.decode) if shape.thinking else None
        calls = CallStream(shape.dsml) if shape.dsml else None
        content = TextStream(partial(self.tok.decode, skip_special_tokens=False) if calls else self.tok.decode,
                             shape.stop)
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
                d = calls.push(d) if calls else d
                if d or lp:
                    yield chunk({"content": d}, lp=lp)
        rest = reasoning.finish() if reasoning is not None else content.finish()
        found = []
        if reasoning is None and calls is not None:            # the content's held-back end
            rest = calls.push(rest)
            held, found = calls.finish()
            rest += held
        if rest:
            yield chunk({"reasoning_content": rest} if reasoning is not None else {"content": rest})
        if found:
            yield chunk({"tool_calls": [c.openai(i) for i, c in enumerate(found)]})
        g = job.decoder.out
        stop_lp = ({"content": [self._chat_lp(g.scores[-1])]}
                   if want_lp and g.stop_token is not None else None)
        finish = "tool_calls" if found and g.finish_reason == "stop" else g.finish_reason
        yield chunk({}, finish, stop_lp)      # the stop token's logprobs, no text
        if shape.usage_chunk:
            yield _sse({**head, "choices": [], "usage": _usage([(ids, g)])})
        yield "data: [DONE]\n\n"

    # ---- routes -------------------------------------------------------------------------
    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/v1/models", lambda: {"object": "list", "data": self.e.model_cards()},
                        methods=["GET"])
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        return r
