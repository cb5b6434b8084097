"""SGLang's native `POST /generate` (docs/research/engine-integration.md §1.1, §2.2): `text` or
`input_ids`, `sampling_params`, prompt and output logprobs in `meta_info` as
`[logprob, token_id, text|null]` triples (the first prompt entry's logprob is null; top
lists sorted descending), `token_ids_logprob`, and the indexer top-k / routed-expert
captures of the served arm's own forward. An optional `model` field (ours) picks the arm
when several are served."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Request

from reference_model.generate import Sampling, Scoring

from .engine import EXPERTS_TAP, INDEXER_TAP, Engine, GenerationRequest
from .errors import ApiError
from .fields import Fields, read_json, warn_unknown
from .scheduler import wait_done
from .speculative import meta_info as spec_meta
from .textstream import cut_stop

SAMPLING_KEYS = {"temperature", "top_p", "top_k", "max_new_tokens", "stop", "stop_token_ids",
                 "ignore_eos", "sampling_seed", "skip_special_tokens", "no_stop_trim", "n", "min_p"}
FIELDS = {"text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
          "top_logprobs_num", "token_ids_logprob", "return_text_in_logprobs", "return_indexer_topk",
          "return_routed_experts", "routed_experts_start_len", "stream", "model", "rid"}


class SGLangRoutes:
    def __init__(self, engine: Engine):
        self.e, self.tok = engine, engine.tok

    def _input_ids(self, body: dict) -> list[int]:
        text, ids = body.get("text"), body.get("input_ids")
        if (text is None) == (ids is None):
            raise ApiError("give exactly one of text or input_ids", "text")
        if isinstance(text, list) or (isinstance(ids, list) and ids and isinstance(ids[0], list)):
            raise ApiError("batched requests are not supported: send one prompt per request",
                           "input_ids" if ids is not None else "text")
        if text is not None:
            if not isinstance(text, str):
                raise ApiError("text must be a string", "text")
            return self.tok.encode(text)
        return Fields(body).ids("input_ids", self.e.vocab)

    def _sampling(self, sp: dict) -> tuple[Sampling, int, dict]:
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            raise ApiError(f"sampling_params.{unknown[0]} is not supported by fidelity serve "
                           f"(supported: {', '.join(sorted(SAMPLING_KEYS))})", f"sampling_params.{unknown[0]}")
        f = Fields(sp, "sampling_params.")
        if sp.get("n", 1) != 1:
            raise ApiError("sampling_params.n must be 1", "sampling_params.n")
        if f.num("min_p", 0.0, 0.0, 1.0):
            raise ApiError("sampling_params.min_p is not supported (use top_p / top_k)",
                           "sampling_params.min_p")
        seed = f.integer("sampling_seed", None)
        s = Sampling(f.num("temperature", 1.0, 0.0, None), f.num("top_p", 1.0, 0.0, 1.0),
                     f.integer("top_k", -1, -1, self.e.vocab), seed)
        opts = {"stop": f.strings("stop"), "stop_ids": f.ids("stop_token_ids", self.e.vocab),
                "ignore_eos": f.flag("ignore_eos"), "skip_special": f.flag("skip_special_tokens", True),
                "no_stop_trim": f.flag("no_stop_trim")}
        return s, f.integer("max_new_tokens", 128, 0), opts

    def _triple(self, lp, i: int, text: bool) -> list:
        return [lp, i, self.tok.decode([i], skip_special_tokens=False) if text else None]

    async def generate(self, request: Request):
        body = await read_json(request)
        warn_unknown("POST /generate", body, FIELDS)
        f = Fields(body)
        served = self.e.resolve(body.get("model"))
        if f.flag("stream"):
            raise ApiError("stream is not supported on /generate; use /v1/completions with "
                           "stream: true", "stream")
        ids = self._input_ids(body)
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise ApiError("sampling_params must be an object", "sampling_params")
        sampling, max_new, opts = self._sampling(sp)
        want_lp = f.flag("return_logprob")
        start = f.integer("logprob_start_len", -1, -1, len(ids) - 1 if ids else 0)
        start = len(ids) - 1 if start == -1 else start          # -1: the last prompt token only
        k = self.e.check_logprobs(f.integer("top_logprobs_num", 0, 0), "top_logprobs_num")
        score_ids = tuple(f.ids("token_ids_logprob", self.e.vocab)) if "token_ids_logprob" in body else None
        text_lp = f.flag("return_text_in_logprobs")
        want_idx, want_exp = f.flag("return_indexer_topk"), f.flag("return_routed_experts")
        exp_from = f.integer("routed_experts_start_len", 0, 0)
        capture = ([INDEXER_TAP] if want_idx else []) + ([EXPERTS_TAP] if want_exp else [])
        scoring = Scoring(top=k, prompt_top=k, prompt_from=start + 1, ids=score_ids or ()) if want_lp else None
        t0 = time.perf_counter()
        job = self.e.submit(served, ids, GenerationRequest(max_new, sampling, scoring, opts["stop"],
                                                           opts["stop_ids"], opts["ignore_eos"], capture))
        await wait_done(job, request.is_disconnected)
        g = job.decoder.out
        out_ids = g.tokens + ([g.stop_token] if g.stop_token is not None else [])
        text = self.tok.decode(g.tokens, skip_special_tokens=opts["skip_special"])
        matched = next((s for s in opts["stop"] if s in text), None)
        if matched is not None and not opts["no_stop_trim"]:
            text = cut_stop(text, opts["stop"])
        if g.stop_token is not None:
            finish = {"type": "stop", "matched": g.stop_token}
        elif g.finish_reason == "stop" and matched is not None:
            finish = {"type": "stop", "matched": matched}
        else:
            finish = {"type": "length", "length": len(out_ids)}
        meta = {"id": uuid.uuid4().hex, "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(out_ids), "cached_tokens": getattr(g, "cached_tokens", 0),
                "e2e_latency": time.perf_counter() - t0, "model": served.id}
        meta.update(spec_meta(g))
        if want_lp:
            meta.update(self._logprobs(ids, start, g, k, score_ids, text_lp))
        if capture:
            meta.update(self.e.captures(g.taps, want_idx, want_exp, exp_from))
        return {"text": text, "output_ids": out_ids, "meta_info": meta}

    def _logprobs(self, ids, start, g, k, score_ids, text_lp) -> dict:
        """meta_info's logprob fields: prompt entries from `start` (the first one null),
        then the output tokens (the stop token included)."""
        prompt = [None] + g.prompt_scores                       # position `start` has no score
        out = g.scores
        tri = self._triple
        m = {"input_token_logprobs": [tri(None if s is None else s.logprob, int(ids[start + j]), text_lp)
                                      for j, s in enumerate(prompt)],
             "output_token_logprobs": [tri(s.logprob, s.token, text_lp) for s in out]}
        if k:
            m["input_top_logprobs"] = [None if s is None else [tri(v, i, text_lp) for i, v in s.top]
                                       for s in prompt]
            m["output_top_logprobs"] = [[tri(v, i, text_lp) for i, v in s.top] for s in out]
        if score_ids is not None:
            m["input_token_ids_logprobs"] = [None if s is None else [tri(v, i, text_lp) for i, v in s.ids]
                                             for s in prompt]
            m["output_token_ids_logprobs"] = [[tri(v, i, text_lp) for i, v in s.ids] for s in out]
        return m

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/generate", self.generate, methods=["POST"])
        return r
